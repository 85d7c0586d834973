"""The job runtime: runs one task module on a host, inside the transient systemd unit that
:func:`rigctl.jobs.start` made. Standard library only (the hosts have Python 3.11, no rigctl).

Invoked as ``python3 jobrun.py JOB_DIR`` by the unit, as the service account in the ``llama-server@`` unit's
sandbox, which may write its run directory and nothing else (:mod:`rigctl.hostside.jobfiles`). ``JOB_DIR``
(root's, read-only to the job) holds what the controller shipped::

    spec.json      id, kind, host, task (module name), params, lock, lock_file, results_dir, record
    jobrun.py      this file
    <task>.py      the task module: ``run(job: Job) -> None``
    rigctl/        the host-side modules these two import (``rigctl.hostside.model_files``, ...): the
                   script's directory comes first on ``sys.path``, so they import as on the controller
    <extra files>  whatever the JobSpec shipped (datasets, prompts)

and ``output.log``, stdout and stderr of the unit (systemd appends; also in the journal). The runtime
writes ``.state.json`` (progress: state running|done|failed|stopped|lost, done/total, message, run_dir,
error) in the run directory.

The run directory ``<results_dir>/<host>/<id>/`` gets ``run.json`` (the run record,
:class:`rigctl.hostside.runrecord.RunRecord`) as soon as the job starts (status ``running``) and again,
sealed with every raw file's sha256, when it ends. The spec's ``record`` holds its first fields, the stamp as
the controller knows it from the inventory among them; before the task runs, the stamp is completed here by
the one builder, :func:`rigctl.hostside.stamp.complete` (the GPU, the llama.cpp build, each server's argv as
deployed), and host facts are added.

On SIGTERM (``systemctl stop``, RuntimeMaxSec) the running child is terminated, the task's
``finally`` blocks run and the run is sealed as ``stopped``.

Two steps of the unit run as root, from the root-owned job directory, on the spec alone (never on what the
job wrote): ``--prepare JOB_DIR`` before the job (ExecStartPre=+): hash the spec's ``artifacts`` into the
host's hash cache, which the job reads and cannot write, and stop the spec's ``stop_units`` (the llama-server
units a bench takes the card from; :mod:`rigctl.hostside.jobhost` stamped them at the start); and
``--finish JOB_DIR`` after it, however it ended, SIGKILL included (ExecStopPost=+): start those units again,
release the lock, and write ``finished.json`` (what :mod:`rigctl.hostside.jobhost` waits for before it shows
the job's final state). The job itself is granted nothing.

A unit that dies without sealing (SIGKILL, out of memory, the host rebooting) leaves its run
``running``. ``python3 jobrun.py --seal-lost JOB_DIR`` (what :func:`rigctl.jobs.pull` runs for such
a run, through ``jobhost seal-lost``: in the job's sandbox) seals it as ``lost`` with the raw files it did
write; it refuses while the unit is active.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rigctl.hostside import jobfiles, sandbox, stamp, units
from rigctl.hostside.hash_cache import HASH_CACHE_FILE, cached_sha256
from rigctl.hostside.runrecord import RUN_FILE, Artifact, RunRecord, RunStatus, utc_now, write_json_atomically

#: Space set aside in the run directory when the job starts and freed to seal it: a disk that fills up
#: mid-run still gets its sealed record saying why, instead of a run left "running" (then "lost").
RESERVE_FILE = ".reserve"
RESERVE_BYTES = 1 << 20
#: Less free space than this after a failure: the failure is (most likely) the disk being full.
DISK_FULL_BYTES = 16 << 20
SPEC_FILE = jobfiles.SPEC_FILE


class Stopped(Exception):
    """The unit was asked to stop (SIGTERM)."""


class TaskError(Exception):
    """A task failed in a way it can name in one line."""


def disk_full(path: str | os.PathLike[str]) -> str | None:
    """``disk full on <path>: N KiB free`` when the file system of ``path`` is (nearly) out of space."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    return f"disk full on {path}: {free // 1024} KiB free" if free < DISK_FULL_BYTES else None


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError; ENOSPC says the disk is full, naming the file."""
    where = f"{exc.filename}: " if exc.filename else ""
    if exc.errno == errno.ENOSPC:
        return f"disk full: {where}no space left on device"
    return f"{where}{exc.strerror or exc}"


def host_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"hostname": socket.gethostname(), "kernel": os.uname().release,
                             "cpus": os.cpu_count()}
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                facts["os"] = line.split("=", 1)[1].strip('"')
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                facts["mem_total_mib"] = int(line.split()[1]) // 1024
    except OSError as exc:
        facts["error"] = str(exc)
    return facts


class Job:
    """What a task sees: its parameters, its run directory, the record, progress and commands.

    Tasks reach the runtime's names through the job (``job.TaskError``, ``job.now()``): this file
    runs as ``__main__``, so a task importing it would get a second copy of its classes."""

    TaskError = TaskError
    Stopped = Stopped

    def __init__(self, job_dir: Path):
        self.dir = job_dir
        self.spec: dict[str, Any] = json.loads((job_dir / SPEC_FILE).read_text())
        self.id: str = self.spec["id"]
        self.params: dict[str, Any] = self.spec.get("params") or {}
        self.run_dir = Path(jobfiles.run_dir(self.spec))
        self.state_file = Path(jobfiles.state_path(self.spec))
        self.record = RunRecord.from_plain({
            "rigctl_version": self.spec.get("rigctl_version", ""), "rigctl_commit": self.spec.get("rigctl_commit", ""),
            **(self.spec.get("record") or {}),
            "id": self.id, "kind": self.spec["kind"], "host": self.spec["host"], "started": utc_now()})
        self._state: dict[str, Any] = {
            "id": self.id, "kind": self.spec["kind"], "host": self.spec["host"], "unit": self.spec["unit"],
            "state": "running", "done": 0, "total": 0, "message": "starting", "run_dir": str(self.run_dir),
            "started": self.record.started, "updated": self.record.started, "ended": None, "error": None,
        }
        self._child: subprocess.Popen[bytes] | None = None
        self.stopping = False

    # ------------------------------------------------------------------ progress and records

    @staticmethod
    def now() -> str:
        return utc_now()

    def progress(self, done: int, total: int, message: str) -> None:
        self._state.update(done=done, total=total, message=message, updated=utc_now())
        write_json_atomically(self.state_file, self._state)
        self.log(f"[{done}/{total}] {message}")

    def log(self, message: str) -> None:
        print(f"{utc_now()} {message}", flush=True)

    def save_record(self) -> None:
        self.record.save(self.run_dir)

    def reserve_space(self) -> None:
        with contextlib.suppress(OSError), open(self.run_dir / RESERVE_FILE, "wb") as handle:
            handle.write(b"\0" * RESERVE_BYTES)

    def seal(self, status: RunStatus, error: str | None) -> None:
        (self.run_dir / RESERVE_FILE).unlink(missing_ok=True)
        self.record.seal(self.run_dir, status, error)
        self._state.update(state=status, ended=self.record.ended, updated=self.record.ended, error=error)
        if status == "done":
            self._state["done"] = self._state["total"]
            self._state["message"] = "done"
        write_json_atomically(self.state_file, self._state)

    # ------------------------------------------------------------------ commands and facts

    def run(
        self, argv: list[str], *, timeout: float, stdout: Path | None = None, stderr: Path | None = None,
        record: bool = True, env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[bytes]:
        """Run ``argv`` (recorded in the run record's commands, with ``env``: variables set on top of the
        job's own), its output to files or captured."""
        if self.stopping:
            raise Stopped()
        if record:
            self.record.commands.append(shlex.join([*(f"{k}={v}" for k, v in (env or {}).items()), *argv]))
        out = open(stdout, "wb") if stdout else subprocess.PIPE  # noqa: SIM115 (closed below)
        err = open(stderr, "wb") if stderr else subprocess.PIPE  # noqa: SIM115
        try:
            self._child = subprocess.Popen(argv, stdout=out, stderr=err,
                                           env={**os.environ, **env} if env else None)
            try:
                captured_out, captured_err = self._child.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.communicate()
                raise TaskError(f"`{shlex.join(argv)}` ran past {timeout:g} s") from None
            rc = self._child.returncode
        finally:
            self._child = None
            for handle in (out, err):
                if handle is not subprocess.PIPE:
                    handle.close()
        if self.stopping:
            raise Stopped()
        return subprocess.CompletedProcess(argv, rc, captured_out or b"", captured_err or b"")

    @contextlib.contextmanager
    def spawn(self, argv: list[str], *, stdout: Path, stderr: Path) -> Iterator[subprocess.Popen[bytes]]:
        """Run ``argv`` (recorded in the run record's commands) while the block reads what it writes (a FIFO);
        a SIGTERM terminates it as it does :meth:`run`'s child, and leaving the block kills it if it still
        runs. The block waits for it (``proc.wait``) and judges its exit status."""
        if self.stopping:
            raise Stopped()
        self.record.commands.append(shlex.join(argv))
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            self._child = subprocess.Popen(argv, stdout=out, stderr=err)
            try:
                yield self._child
            finally:
                if self._child.poll() is None:
                    self._child.kill()
                self._child.wait()
                self._child = None
        if self.stopping:
            raise Stopped()

    def gpu_query(self, fields: str, selection: list[str] | None = None) -> str | None:
        """``nvidia-smi --query-gpu=FIELDS`` (csv, no header, no units) of the GPUs ``selection`` names
        (``["-i", "0,1"]``; none: every GPU); None without nvidia-smi."""
        return stamp.gpu_query(fields, selection)

    def artifact(self, name: str, path: str) -> Artifact:
        """A model file as the run record lists it (:func:`rigctl.hostside.stamp.artifact`), its sha256
        hashed now, or taken from the host's hash cache when the file's identity (device, inode, size, mtime
        and ctime, which no write or rename leaves as they were) is the one it was hashed with;
        ``sha256_from`` says which."""
        if not os.path.isfile(path):
            raise TaskError(f"artifact {name}: {path} does not exist on {self.spec['host']}")
        entry, note = stamp.artifact(name, path, lambda p: cached_sha256(hash_cache_path(self.spec), p))
        if note:
            self.log(f"artifact {name}: {note}")
        return entry

    def collect_facts(self) -> None:
        """The stamp completed on this host (:func:`rigctl.hostside.stamp.complete`) and host facts: the
        servers the spec's record names (an eval's), else every llama-server running now (what a bench
        found, and stops; stamped as root at the start, before the job stopped them)."""
        self.record.extra["host_facts"] = host_facts()
        completed, notes = stamp.complete(self.record.provenance, running_servers=not self.record.servers)
        self.record.restamp(completed)
        for note in notes:
            self.log(note)

    # ------------------------------------------------------------------ stopping

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.stopping = True
        if self._child is not None and self._child.poll() is None:
            self._child.terminate()
        raise Stopped()


def hash_cache_path(spec: dict[str, Any]) -> Path:
    """The host's hash cache, beside the jobs directory (root's: :func:`prepare` writes it, jobs read it)."""
    return Path(spec["job_dir"]).parent.parent / HASH_CACHE_FILE


def prepare(job_dir: Path) -> int:
    """Root's step before the job (ExecStartPre=+): the spec's model files hashed into the host's cache,
    then the llama-server units the spec names stopped. Non-zero (the job does not run) when one will not
    stop."""
    spec = json.loads((job_dir / SPEC_FILE).read_text())
    for path in spec.get("artifacts") or []:
        if os.path.isfile(path):
            digest, source = cached_sha256(hash_cache_path(spec), str(path))
            print(f"{utc_now()} {path}: sha256 {digest} ({source})", flush=True)
    for unit in spec.get("stop_units") or []:
        print(f"{utc_now()} stopping {unit} for the job", flush=True)
        problem = units.run("stop", [unit])
        if problem:
            error = f"cannot stop {unit}: {problem}"
            print(f"{utc_now()} {error}", flush=True)
            write_json_atomically(job_dir / jobfiles.NOT_STARTED_FILE, {"error": error, "ended": utc_now()})
            return 1
    return 0


def finish(job_dir: Path) -> int:
    """Root's step after the job, however it ended (ExecStopPost=+): the units :func:`prepare` stopped started
    again, the lock released, ``finished.json`` written."""
    spec = json.loads((job_dir / SPEC_FILE).read_text())
    problems = []
    for unit in spec.get("stop_units") or []:
        print(f"{utc_now()} starting {unit} again", flush=True)
        problem = units.run("start", [unit])
        if problem:
            problems.append(f"{unit}: {problem}")
            print(f"{utc_now()} cannot start {unit}: {problem}", flush=True)
    jobfiles.release_lock(spec)
    finished: dict[str, Any] = {"ended": utc_now(), "restore_problems": problems}
    state = jobfiles.read_state(str(job_dir), spec)
    if not (isinstance(state, dict) and state.get("state") in jobfiles.FINAL_STATES):
        cause = unsealed_cause(job_dir, spec)
        if cause:
            finished["error"] = cause
    write_json_atomically(job_dir / jobfiles.FINISHED_FILE, finished)
    return 0


#: How systemd says a unit's process was killed (SERVICE_RESULT): the runtime had no chance to seal its run.
KILLED_RESULTS = frozenset({"signal", "core-dump", "oom-kill"})


def unsealed_cause(job_dir: Path, spec: dict[str, Any]) -> str | None:
    """Why a job's unit ended without a final state (root's step after it): the results disk being full (the
    job could not write even that), else the runtime's last complaint in the unit's output, else how systemd
    saw the unit end. None when it was killed (SIGKILL, out of memory) and said nothing: the job is lost,
    and ``rigctl pull`` seals its run so."""
    where = Path(jobfiles.run_dir(spec))
    while not where.is_dir() and where != where.parent:  # the job may not have made its directories
        where = where.parent
    full = disk_full(where)
    if full:
        return f"{full}: the job could not write its run"
    with contextlib.suppress(OSError):
        lines = (job_dir / "output.log").read_text(errors="replace").splitlines()
        said = [line for line in lines if line.startswith("jobrun: ")]
        if said:
            return said[-1].removeprefix("jobrun: ")
    result, status = os.environ.get("SERVICE_RESULT"), os.environ.get("EXIT_STATUS")
    if result in KILLED_RESULTS:
        return None
    return (f"the job's unit ended ({result or 'unknown'}"
            f"{', exit status ' + status if status else ''}) without writing a final state")


def load_task(job_dir: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, job_dir / f"{name}.py")
    if spec is None or spec.loader is None:
        raise TaskError(f"task module {name}.py not found in {job_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(job_dir: Path) -> int:
    # Whatever the job's unit was given from outside (the manager's environment, a drop-in), no variable that
    # llama.cpp reads as an option reaches what the task runs: the task's argv is the whole configuration.
    for name in [name for name in os.environ if sandbox.foreign_variable(name)]:
        del os.environ[name]
    job = Job(job_dir)
    signal.signal(signal.SIGTERM, job.on_sigterm)
    status, error = "failed", None
    try:
        job.progress(0, 0, "collecting facts")
        job.collect_facts()
        job.save_record()
        job.reserve_space()
        task = load_task(job_dir, job.spec["task"])
        task.run(job)
        status = "done"
    except Stopped:
        status, error = "stopped", "stopped by SIGTERM"
    except TaskError as exc:
        error = str(exc)
        full = disk_full(job.run_dir)
        if full and "disk full" not in error:
            error += f" ({full})"
    except OSError as exc:  # a write that failed: the disk filling up, mostly
        error = describe_os_error(exc)
        job.log(f"job {job.id}: {error}")
    except Exception as exc:  # the one place that turns any task failure into a sealed, failed run
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        job.seal(status, error)
    job.log(f"job {job.id}: {status}" + (f": {error}" if error else ""))
    return 0 if status == "done" else 1


LOST_ERROR = "the job's unit ended without sealing its run (killed, or the host went down)"


def seal_lost(job_dir: Path) -> int:
    """Seal the run of a job whose unit is gone but never sealed it, as ``lost``; prints the record."""
    job = Job(job_dir)
    if jobfiles.unit_active(job.spec["unit"]):
        print(f"job {job.id}: unit {job.spec['unit']} is still active", file=sys.stderr)
        return 1
    # A file the unit died before writing leaves the fresh one standing.
    found = jobfiles.read_json(str(job.run_dir / RUN_FILE))
    if isinstance(found, dict):
        job.record = RunRecord.from_plain(found)
    state = jobfiles.read_json(str(job.state_file))
    if isinstance(state, dict):
        job._state.update(state)
    if job.record.status == "running":
        job.seal("lost", LOST_ERROR)
    print(json.dumps(job.record.to_dict()))
    return 0


if __name__ == "__main__":
    try:
        if sys.argv[1] == "--seal-lost":
            sys.exit(seal_lost(Path(sys.argv[2]).resolve()))
        if sys.argv[1] == "--prepare":
            sys.exit(prepare(Path(sys.argv[2]).resolve()))
        if sys.argv[1] == "--finish":
            sys.exit(finish(Path(sys.argv[2]).resolve()))
        sys.exit(main(Path(sys.argv[1]).resolve()))
    except OSError as exc:  # the controller shows this line: one line, not a traceback
        print(f"jobrun: {describe_os_error(exc)}", file=sys.stderr)
        sys.exit(1)
