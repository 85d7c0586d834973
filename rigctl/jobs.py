"""Detached jobs on the hosts: transient systemd units that outlive the SSH connection.

A job is one run (bench, eval, spec, server-speed) executed *on the host*. The hosts have Python
3.11 and no rigctl, so the job's code travels with it: :func:`start` copies the stdlib-only job
runtime :mod:`rigctl.hostside.jobrun` and one task module from :mod:`rigctl.hostside` (``bench_task``,
``eval_task``, ...) into ``/var/lib/rigctl/jobs/<id>/``, with the host-side modules they import under
``rigctl/hostside/`` there (:func:`rigctl.hostside.ship.package_files`), ``spec.json`` (the task's
parameters and the run record's first fields) and any extra files (in one round trip), and starts::

    systemd-run --unit rigctl-<id> --collect -p User=llama -p ProtectSystem=strict ... \
        -p ReadWritePaths=/var/lib/rigctl/results/<host>/<id> python3 jobrun.py /var/lib/rigctl/jobs/<id>

**Privileges.** The job runs as the host's service account (:attr:`rigctl.inventory.Host.service_account`,
the account llama-server runs as) with the ``llama-server@`` unit's sandbox (:mod:`rigctl.hostside.sandbox`):
what llama.cpp code it runs (llama-bench on a hostile model) may write its run directory and nothing else.
The job tree and the code in it are root's (:mod:`rigctl.hostside.jobfiles`). The one privileged thing a
job needs, the host's llama-server units stopped for a bench and started again after, is granted to no
account: root's steps of the unit (ExecStartPre=+, ExecStopPost=+) do it for the units the start named,
which the job cannot change (:func:`rigctl.hostside.jobhost.unit_argv`); they also free the lock.

The host's half of starting, listing, following and pulling is :mod:`rigctl.hostside.jobhost`, sent
as a one-shot command. The job id is the run id (:func:`rigctl.results.record.new_run_id`,
``bench-20261130T051200Z-3f9a``), so
the unit is ``rigctl-<kind>-<timestamp>-<hex>``. The runtime writes the run directory
``/var/lib/rigctl/results/<host>/<id>/``: ``.state.json`` (state, done/total, message: what :func:`status`
and ``rigctl jobs`` show), ``run.json`` and the raw files, sealed with every
raw file's sha256 when the job ends. :func:`pull` copies finished run directories into the
controller's :class:`rigctl.results.store.ResultsStore` (same layout), each file checked against the
sha256 in ``run.json``, a run directory appearing only once complete; runs the store already has
are never copied again. A run whose unit died without sealing it (SIGKILL, the host going down) is
sealed as ``lost`` on the host first, so what it wrote comes home too (an eval resumes from it).

**Locks.** A job may name a lock (bench jobs: ``"gpu"``). Starting takes
``/var/lib/rigctl/jobs/locks/<lock>.json`` under a mutex: if the job named there still has an
active unit the start is refused with :class:`rigctl.errors.JobBusyError` naming it, otherwise the
new job becomes the holder. The unit's last step releases the lock, whatever the outcome; a
holder whose unit is gone (host rebooted) does not block.

**Writing a task** (how ``rigctl eval --remote`` runs through this module): put a stdlib-only
module in ``rigctl/hostside/<name>.py`` with ``run(job) -> None``. ``job`` (:class:`rigctl.hostside.
jobrun.Job`) gives ``job.params`` (the JobSpec's params, JSON), ``job.dir`` (the job directory,
where ``JobSpec.files`` were shipped), ``job.run_dir`` (write raw files here), ``job.record`` (the
run record, :class:`rigctl.hostside.runrecord.RunRecord`: the spec's ``record`` fields with the stamp
completed on the host — ``gpu``, ``llama_cpp``, the servers' argv — and ``extra.host_facts``; fill
``artifacts``, ``extra``, ...),
``job.progress(done, total, message)``, ``job.run(argv, timeout=, stdout=, stderr=)`` (recorded in
``commands``), ``job.artifact(name, path)`` (sha256 + manifest), ``job.save_record()``,
``job.log(msg)``, ``job.gpu_query(fields)``, ``job.TaskError`` (raise it for a one-line failure)
and ``job.now()``. Then::

    from rigctl import jobs
    spec = jobs.JobSpec(kind="eval", task="eval_task", params={...}, lock=None,
                        record={"task": {...}, "seed": 0}, files={"questions.jsonl": path})
    info = jobs.start(host, spec)              # JobInfo; JobBusyError if the lock is held
    info = jobs.wait(host, info.id, on_progress=print)   # follows .state.json, survives SSH drops
    result = jobs.pull(host)                   # PullResult: copied / skipped run ids

``start``, ``wait`` and ``pull`` take ``client=`` (an open :class:`rigctl.ssh.SshClient`) to share one
connection; inside a :func:`rigctl.connections.connections` scope (every CLI command) they share the
command's anyway. Other entry points: :func:`status` (one job), :func:`list_jobs` (a host's jobs by id:
kind, then start time), :func:`stop`, :func:`jobs_on_hosts`, :func:`pull_hosts` and
:func:`follow_and_pull` (several hosts at once; per-host results, failures kept). Job directories stay
on the host (a few KiB each).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shlex
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any

import rigctl
from rigctl.connections import on_each_host
from rigctl.errors import (
    ConfigError,
    ConnectError,
    JobBusyError,
    JobError,
    RigctlError,
    TransferError,
    TrustError,
    one_line,
)
from rigctl.hostside import ship
from rigctl.hostside.bench_cells import CELLS_FILE, cell_files
from rigctl.hostside.jobfiles import FINAL_STATES, READ_LIMIT
from rigctl.inventory import Host, Inventory
from rigctl.results.record import (
    RUN_FILE,
    RUN_ID,
    RunKind,
    RunRecord,
    new_run_id,
    parse_json,
)
from rigctl.results.stamp import inventory_gpu
from rigctl.results.store import ResultsStore, read_jsonl
from rigctl.ssh import SshClient, session
from rigctl.trust import inside, relative_path

log = logging.getLogger(__name__)

JOBS_DIR = "/var/lib/rigctl/jobs"
RESULTS_DIR = "/var/lib/rigctl/results"
UNIT_PREFIX = "rigctl-"
COMMAND_TIMEOUT = 60.0
# Pulled files and directories get these modes, whatever the host's say.
FILE_MODE = 0o644
DIR_MODE = 0o755
TRANSFER_TIMEOUT = 600.0
#: Bytes of run files a pull takes inline with the run listing (base64 in its JSON); the rest by SFTP.
INLINE_LIMIT = 8 << 20

@dataclass(frozen=True)
class JobSpec:
    """What to run: a task module of :mod:`rigctl.hostside` with JSON params."""

    kind: RunKind
    task: str
    params: Mapping[str, Any]
    lock: str | None = "gpu"
    record: Mapping[str, Any] = field(default_factory=dict)  # first run-record fields (matrix, task, server, ...)
    files: Mapping[str, Path] = field(default_factory=dict)  # shipped into the job dir: name -> local path
    max_runtime_s: int = 24 * 3600
    #: Stop the host's running llama-server units for the job (their argv stamped first) and start them after.
    stop_servers: bool = False
    #: Model files on the host the job records: hashed into the host's cache by root before the job runs.
    artifacts: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobInfo:
    """A job on a host as its state file and unit say."""

    host: str
    id: str
    kind: str
    unit: str
    state: str  # starting, running, finishing (root's last step), done, failed, stopped; lost: no unit, not ended
    done: int = 0
    total: int = 0
    message: str = ""
    started: str | None = None
    updated: str | None = None
    ended: str | None = None
    error: str | None = None
    run_dir: str | None = None
    lock: str | None = None

    @property
    def finished(self) -> bool:
        return self.state in FINAL_STATES

    def describe(self) -> str:
        progress = f"{self.done}/{self.total}" if self.total else "-"
        text = f"{self.host}: {self.id} {self.state} [{progress}] {self.message}"
        return text + (f": {self.error}" if self.error else "")


@dataclass
class PullResult:
    host: str
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already in the store
    running: list[str] = field(default_factory=list)  # not finished on the host yet
    lost: list[str] = field(default_factory=list)  # their unit died unsealed: sealed as lost, then copied
    refused: list[str] = field(default_factory=list)  # one line per run not trusted: nothing of it written
    files: int = 0
    bytes: int = 0


def unit_name(job_id: str) -> str:
    return f"{UNIT_PREFIX}{job_id}"




def parse_job(host: str, entry: Mapping[str, Any]) -> JobInfo:
    """One entry of the host's job listing as a :class:`JobInfo` (pure)."""
    spec, state = entry["spec"], entry["state"]
    name = str(state.get("state", "starting"))
    if name in ("running", "starting") and not entry.get("active"):
        name = "lost"  # the unit is gone but never wrote a final state (killed, host rebooted)
    return JobInfo(
        host=host, id=str(spec["id"]), kind=str(spec["kind"]), unit=str(spec["unit"]), state=name,
        done=int(state.get("done", 0)), total=int(state.get("total", 0)), message=str(state.get("message", "")),
        started=state.get("started"), updated=state.get("updated"), ended=state.get("ended"),
        error=state.get("error"), run_dir=state.get("run_dir"), lock=spec.get("lock"),
    )




@functools.cache
def task_sources(task: str) -> Mapping[str, str]:
    """What a job of ``task`` ships besides its spec: the runtime, the task and the host-side modules they
    import, by path in the job directory. Read and parsed once per process; a command may call this ahead
    of :func:`start`, while its inventory loads."""
    return MappingProxyType({"jobrun.py": ship.source("jobrun"), f"{task}.py": ship.source(task),
                             **ship.package_files(["jobrun", task])})


def job_host_spec(host: Host, spec: JobSpec, job_id: str) -> dict[str, Any]:
    """``spec.json`` of job ``job_id`` on ``host``: what the host's side starts the unit from
    (:func:`rigctl.hostside.jobhost.unit_argv`), with the service account's sandbox writable only the run
    directory."""
    job_dir = f"{JOBS_DIR}/{job_id}"
    lock_file = f"{JOBS_DIR}/locks/{spec.lock}.json" if spec.lock else None
    account = host.service_account
    return {
        "id": job_id, "kind": spec.kind, "host": host.name, "unit": unit_name(job_id), "task": spec.task,
        "params": dict(spec.params), "lock": spec.lock, "lock_file": lock_file, "job_dir": job_dir,
        # The stamp as the inventory knows it (the GPU here); the job completes it on the host.
        "results_dir": RESULTS_DIR, "record": {"gpu": dataclasses.asdict(inventory_gpu(host)), **spec.record},
        "rigctl_version": rigctl.__version__, "rigctl_commit": rigctl.__commit__,
        "max_runtime_s": int(spec.max_runtime_s), "stop_servers": spec.stop_servers,
        "artifacts": list(spec.artifacts), "account": {"user": account.user, "group": account.group},
        # Writable: the run directory, nothing else.
        "unit_properties": account.unit_properties([f"{RESULTS_DIR}/{host.name}/{job_id}"]),
    }


def start(host: Host, spec: JobSpec, *, job_id: str | None = None, client: SshClient | None = None) -> JobInfo:
    """Ship the runtime, the task and its files to ``host`` and start the job's unit.

    Raises :class:`JobBusyError` (nothing left behind) when ``spec.lock`` is held by an active job.
    ``client``: an open connection to reuse (else one is made and closed).
    """
    job_id = job_id or new_run_id(spec.kind)
    job_dir = f"{JOBS_DIR}/{job_id}"
    for name, path in spec.files.items():
        if "/" in name or name in ("spec.json", "state.json", "finished.json", "output.log", "jobrun.py",
                                   f"{spec.task}.py", "rigctl"):
            raise ConfigError(f"job file name {name!r}: must be a plain name not used by the job itself")
        if not Path(path).is_file():
            raise ConfigError(f"job file {name}: {path} does not exist")
    remote_spec = job_host_spec(host, spec, job_id)
    sources = {**task_sources(spec.task), "spec.json": json.dumps(remote_spec, indent=2, sort_keys=True) + "\n"}
    with session(host, client) as ssh:
        if spec.files:  # data files (datasets) may be large or binary: SFTP, before the unit can start
            ssh.run(f"mkdir -p {shlex.quote(job_dir)}", timeout=COMMAND_TIMEOUT, check=True)
            for name, path in spec.files.items():
                ssh.put(path, f"{job_dir}/{name}", timeout=TRANSFER_TIMEOUT)
        result = ssh.run(ship.python_command("jobhost", "start"), timeout=COMMAND_TIMEOUT, check=True,
                         input=json.dumps(sources))
        answer = parse_json(result.stdout, f"{host.name}: its answer to starting {job_id}")
        if "started" not in answer:
            if "refused" in answer:
                raise JobBusyError(host.name, str(spec.lock), str(answer["refused"].get("job")))
            raise JobError(f"{host.name}: cannot start job {job_id}: {answer.get('error')}")
    log.info("%s: started %s (unit %s)", host.name, job_id, unit_name(job_id))
    return JobInfo(host=host.name, id=job_id, kind=spec.kind, unit=unit_name(job_id), state="starting",
                   run_dir=f"{RESULTS_DIR}/{host.name}/{job_id}", lock=spec.lock)


def start_each(hosts: Iterable[Host], spec_for: Callable[[Host], JobSpec]) -> dict[str, JobInfo | RigctlError]:
    """One job per host, each from ``spec_for(host)``; per host name its job or what stopped it (a spec the
    host cannot run, a busy lock, a failed start): one host's error never stops the others."""
    out: dict[str, JobInfo | RigctlError] = {}
    for host in hosts:
        try:
            out[host.name] = start(host, spec_for(host))
        except RigctlError as exc:
            out[host.name] = exc
    return out


def list_jobs(host: Host, *, client: SshClient | None = None) -> list[JobInfo]:
    """Every job on ``host`` by id (kind, then start time), from its state file and unit."""
    return _list(host, None, client)


def status(host: Host, job_id: str, *, client: SshClient | None = None) -> JobInfo:
    found = _list(host, job_id, client)
    if not found:
        raise JobError(f"{host.name}: no job {job_id} under {JOBS_DIR}")
    return found[0]


def _list(host: Host, only: str | None, client: SshClient | None) -> list[JobInfo]:
    cmd = ship.python_command("jobhost", "list", JOBS_DIR, *([only] if only else []))
    with session(host, client) as ssh:
        result = ssh.run(cmd, timeout=COMMAND_TIMEOUT, check=True)
    return [parse_job(host.name, entry) for entry in parse_json(result.stdout, f"{host.name}: its job list")]


def _progress_key(info: JobInfo | None) -> str:
    """What the host's wait compares the state file against (:func:`rigctl.hostside.jobhost.progress_key`)."""
    return "" if info is None else json.dumps([info.state, info.done, info.total, info.message])


def _wait_change(host: Host, job_id: str, last: JobInfo | None, hold_s: float, poll_s: float,
                 ssh: SshClient) -> JobInfo:
    """The job once its progress differs from ``last`` (or after ``hold_s``), waited for on the host."""
    cmd = ship.python_command("jobhost", "wait", JOBS_DIR, job_id, _progress_key(last), f"{hold_s:g}", f"{poll_s:g}")
    answer = ssh.run(cmd, timeout=hold_s + COMMAND_TIMEOUT, check=True).stdout
    found = [parse_job(host.name, e) for e in parse_json(answer, f"{host.name}: its job {job_id}")]
    if not found:
        raise JobError(f"{host.name}: no job {job_id} under {JOBS_DIR}")
    return found[0]


def wait(
    host: Host,
    job_id: str,
    *,
    on_progress: Callable[[JobInfo], None] | None = None,
    poll_s: float = 0.05,
    hold_s: float = 20.0,
    timeout_s: float = 24 * 3600,
    reconnect_s: float = 5.0,
    client: SshClient | None = None,
) -> JobInfo:
    """Follow ``job_id`` until it ends; ``on_progress`` gets each changed state. The host watches the job's
    state file every ``poll_s`` and answers on a change (or after ``hold_s``, when a unit that died
    unsealed shows as lost). A lost connection is retried until ``timeout_s`` (the job does not depend on
    it). ``client``: the connection to use (else the scope's or a new one, see :func:`rigctl.ssh.session`)."""
    deadline = time.monotonic() + timeout_s
    last: tuple[Any, ...] | None = None
    seen: JobInfo | None = None
    with session(host, client) as ssh:
        while True:
            try:
                info = _wait_change(host, job_id, seen, max(0.0, min(hold_s, deadline - time.monotonic())), poll_s,
                                    ssh)
            except (ConnectError, TransferError) as exc:
                log.warning("%s: lost the connection while following %s (%s); retrying", host.name, job_id, exc)
                ssh.close()  # its next command connects again
                if time.monotonic() + reconnect_s > deadline:
                    raise JobError(f"{host.name}: cannot follow job {job_id}: {exc}") from None
                time.sleep(reconnect_s)
                continue
            key = (info.state, info.done, info.total, info.message)
            if key != last and on_progress is not None:
                on_progress(info)
            last, seen = key, info
            if info.finished:
                return info
            if time.monotonic() >= deadline:
                raise JobError(f"{host.name}: job {job_id} still {info.state} after {timeout_s:g} s")


def stop(host: Host, job_id: str, *, timeout: float = 180.0) -> JobInfo:
    """Stop a running job's unit (the runtime seals its run as ``stopped``)."""
    with session(host) as ssh:
        info = status(host, job_id, client=ssh)
        if not info.finished:
            ssh.run(f"systemctl stop {shlex.quote(info.unit)}", timeout=timeout, check=True)
        return status(host, job_id, client=ssh)


def pull(host: Host, store: ResultsStore | None = None, *, runs: Iterable[str] | None = None,
         timeout: float = TRANSFER_TIMEOUT, client: SshClient | None = None) -> PullResult:
    """Copy ``host``'s finished run directories that ``store`` lacks (of ``runs``, when given: a followed
    job's), every file checked against the sha256 in its ``run.json``. A run appears in the store only
    once all of it has arrived. Small files come inline with the run listing (one round trip for the
    listing, one for what the store lacks; one in all for named runs), larger ones by SFTP.

    What the host sends is data: a run whose id is not one rigctl makes or differs from its record's,
    whose record names another host, or whose record or ``cells.jsonl`` points outside the run is
    refused (one line in ``refused``, for the caller to report) and nothing of it is written; so is a run
    whose copy fails in any other way (a name the filesystem refuses, a file that does not match), and
    the host's other runs come home all the same. Every path is resolved and must stay in the store;
    files land 0644 and directories 0755 whatever their mode on the host.
    """
    store = store or ResultsStore()
    result = PullResult(host=host.name)
    remote_root = f"{RESULTS_DIR}/{host.name}"
    host_dir = inside(store.root, host.name, f"host {host.name!r}")
    named = sorted(set(runs)) if runs is not None else None
    with session(host, client) as ssh:
        if named == []:
            return result
        # Named runs (a followed job's) come with their files at once; a full listing sends records only,
        # then the files of the runs the store lacks.
        listing = _list_runs(ssh, remote_root, INLINE_LIMIT if named else 0, named or [])
        wanted = [r for r in listing if RUN_ID.match(r) and not (host_dir / r / RUN_FILE).is_file()
                  and isinstance(listing[r], dict) and "inline" not in listing[r]]
        if named is None and wanted:
            listing.update(_list_runs(ssh, remote_root, INLINE_LIMIT, wanted))
        for run_id, entry in sorted(listing.items()):
            try:
                _check_run_id(run_id)
                if (host_dir / run_id / RUN_FILE).is_file():
                    result.skipped.append(run_id)
                    continue
                if not isinstance(entry, dict) or not isinstance(entry.get("record"), dict):
                    raise TrustError("its listing entry has no record")
                data = entry["record"]
                if data.get("status") == "running":
                    if entry.get("active"):
                        result.running.append(run_id)
                        continue
                    data = _seal_lost(ssh, run_id)
                    result.lost.append(run_id)
                record = _vetted_record(host.name, run_id, data)
                inline = entry.get("inline") if isinstance(entry.get("inline"), dict) else {}
                _copy_run(ssh, f"{remote_root}/{run_id}", host_dir, record, result, timeout, inline)
            except ConnectError:
                raise  # the host is gone: that is the host's error, not each run's
            except Exception as exc:  # whatever one run provokes is that run's line; the others still come
                line = f"{host.name}: run {run_id!r} refused: {one_line(exc)}"
                log.info("%s", line)
                if not isinstance(exc, RigctlError):
                    log.debug("%s: run %s: the traceback", host.name, run_id, exc_info=True)
                result.refused.append(line)
                if run_id in result.lost:
                    result.lost.remove(run_id)
                continue
            result.copied.append(run_id)
    return result


def _list_runs(ssh: SshClient, remote_root: str, inline_limit: int, only: list[str]) -> dict[str, Any]:
    """The host's run listing (:func:`rigctl.hostside.jobhost.list_runs`): run id -> entry, as sent."""
    out = ssh.run(ship.python_command("jobhost", "runs", remote_root, UNIT_PREFIX, str(inline_limit), *only),
                  timeout=COMMAND_TIMEOUT, check=True).stdout
    try:
        listing = parse_json(out, f"{ssh.host}: the run listing of {remote_root}", deferred=True)
    except json.JSONDecodeError:
        listing = None
    if not isinstance(listing, dict):
        raise JobError(f"{ssh.host}: the run listing of {remote_root} is not a JSON object")
    return listing


def _check_run_id(run_id: str) -> None:
    if not RUN_ID.match(run_id):
        raise TrustError("not a run id rigctl makes (kind-YYYYMMDDTHHMMSSZ-xxxx)")


def _vetted_record(host: str, run_id: str, data: Any) -> RunRecord:
    """The host's record of ``run_id`` as a RunRecord, if it is the run it claims to be and stays inside it."""
    if not isinstance(data, dict):
        raise TrustError("its run.json is not a JSON object")
    record = RunRecord.from_dict(data)
    if record.id != run_id:
        raise TrustError(f"its run.json has id {record.id!r}")
    if record.host != host:
        raise TrustError(f"its run.json names host {record.host!r}")
    seen: set[str] = set()
    for raw in record.files:
        path = str(relative_path(raw.path, "raw file"))
        if path == RUN_FILE or path in seen:
            raise TrustError(f"raw file {raw.path!r} is listed twice or is the record itself")
        seen.add(path)
    # A file cannot also be a directory: `x` and `x/y` cannot both be copied.
    directories = {str(parent) for path in seen for parent in PurePosixPath(path).parents}
    both = sorted(seen & directories)
    if both:
        raise TrustError(f"raw file {both[0]!r} is also the directory of another raw file")
    return record


def _check_references(run_dir: Path, record: RunRecord) -> None:
    """Every raw-file path a record inside the run names (cells.jsonl's raw and log files) is one of the
    run's own files."""
    files = {raw.path for raw in record.files}
    if CELLS_FILE not in files:
        return
    for where, path in cell_files(read_jsonl(run_dir / CELLS_FILE)):
        relative_path(path, f"{CELLS_FILE} {where}")
        if path not in files:
            raise TrustError(f"{CELLS_FILE} {where}: {path!r} is not a file of the run")


def _seal_lost(ssh: SshClient, job_id: str) -> dict[str, Any]:
    """Have the job's own runtime seal its unsealed run as ``lost`` (what it wrote is kept), in the job's
    sandbox (:func:`rigctl.hostside.jobhost.seal_lost`); the record."""
    done = ssh.run(ship.python_command("jobhost", "seal-lost", JOBS_DIR, job_id), timeout=COMMAND_TIMEOUT,
                   check=False)
    if not done.ok:
        # The last line says why (a traceback's last line is its exception); the rest is for -v.
        output = [line for line in (done.stderr.strip() or done.stdout.strip()).splitlines() if line.strip()]
        log.debug("%s: --seal-lost %s: %s", ssh.host, job_id, "\n".join(output))
        raise JobError(f"{ssh.host}: run {job_id} was left running by a dead job and cannot be sealed: "
                       f"{output[-1].strip() if output else f'exit {done.rc}'}")
    log.warning("%s: job %s died without sealing its run; sealed it as lost", ssh.host, job_id)
    try:
        return parse_json(done.stdout, "its record sealed as lost")
    except json.JSONDecodeError:
        raise TrustError("sealing it as lost printed no JSON record") from None


def _copy_run(
    ssh: SshClient, remote: str, host_dir: Path, record: RunRecord, result: PullResult, timeout: float,
    inline: Mapping[str, Any],
) -> None:
    """Copy one run into the store through a staging directory: each file from ``inline`` (its base64
    as the listing sent it) or else by SFTP, checked against the record's sha256 either way."""
    local = inside(host_dir, record.id, f"run {record.id!r}")
    staging = inside(host_dir, f".{record.id}.partial", f"run {record.id!r}")
    shutil.rmtree(staging, ignore_errors=True)
    files = bytes_ = 0
    try:
        host_dir.parent.mkdir(parents=True, exist_ok=True)  # the store itself
        _make_dir(host_dir)
        _make_dir(staging)
        for raw in record.files:
            target = inside(staging, raw.path, "raw file")
            for parent in reversed(target.relative_to(staging).parents[:-1]):
                _make_dir(staging / parent)
            _fetch(ssh, f"{remote}/{raw.path}", target, inline.get(raw.path), raw.sha256, timeout, raw.bytes)
            files += 1
            bytes_ += raw.bytes
        _fetch(ssh, f"{remote}/{RUN_FILE}", staging / RUN_FILE, inline.get(RUN_FILE), None, timeout, READ_LIMIT)
        # run.json may only have changed if the host rewrote the run since the listing: check again.
        copied = _vetted_record(result.host, record.id, parse_json((staging / RUN_FILE).read_text(), RUN_FILE))
        if copied.files != record.files:
            raise JobError(f"{ssh.host}: run {record.id} changed on the host while it was pulled; pull again")
        _check_references(staging, copied)
        staging.rename(local)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result.files += files
    result.bytes += bytes_


def _fetch(ssh: SshClient, remote: str, target: Path, inline: Any, sha256: str | None, timeout: float,
           max_bytes: int) -> None:
    """One file of a run into ``target`` (mode :data:`FILE_MODE`): the listing's inline bytes when it sent
    them, else by SFTP, read no further than ``max_bytes`` (its record's size); TransferError when they are
    not the bytes ``sha256`` names."""
    if isinstance(inline, str):
        _write_inline(ssh.host, remote, target, inline, sha256)
    else:
        ssh.get(remote, target, timeout=timeout, sha256=sha256, mode=FILE_MODE, max_bytes=max_bytes)


def _write_inline(host: str, remote: str, target: Path, inline: str, sha256: str | None) -> None:
    try:
        data = base64.b64decode(inline, validate=True)
    except binascii.Error:
        raise TransferError(host, remote, "its inline content is not base64") from None
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256.lower():
        raise TransferError(host, remote, f"sha256 is {digest}, expected {sha256.lower()}")
    with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as out:
        os.fchmod(out.fileno(), FILE_MODE)  # whatever the umask
        out.write(data)


def _make_dir(path: Path) -> None:
    path.mkdir(exist_ok=True)
    path.chmod(DIR_MODE)


def jobs_on_hosts(hosts: Iterable[Host]) -> dict[str, list[JobInfo] | RigctlError]:
    """Each host's jobs, or the error that kept us from reading them."""
    return on_each_host(hosts, list_jobs, thread_name_prefix="rigctl-jobs")


def pull_hosts(hosts: Iterable[Host], store: ResultsStore | None = None) -> dict[str, PullResult | RigctlError]:
    """:func:`pull` on every host; one host failing keeps the others' results."""
    store = store or ResultsStore()
    return on_each_host(hosts, lambda host: pull(host, store), thread_name_prefix="rigctl-jobs")


@dataclass(frozen=True)
class Followed:
    """A job followed to its end and its host pulled: the job's last state and what the pull brought."""

    job: JobInfo
    pulled: PullResult

    @property
    def done(self) -> bool:
        return self.job.state == "done"


def follow_and_pull(
    inventory: Inventory, started: Mapping[str, str], store: ResultsStore, *,
    on_progress: Callable[[JobInfo], None] | None = None,
) -> dict[str, Followed | RigctlError]:
    """Follow each host's job (``started``: host name -> job id) to its end, every host at once, and pull
    each host as soon as its own job ends; per host name, what came of it or the error that stopped it."""
    def follow(host: Host) -> Followed:
        with session(host) as ssh:  # one connection for following and pulling
            info = wait(host, started[host.name], on_progress=on_progress, client=ssh)
            return Followed(info, pull(host, store, runs=[info.id], client=ssh))

    return on_each_host([inventory.host(name) for name in started], follow, thread_name_prefix="rigctl-follow")
