"""The host's half of :mod:`rigctl.jobs`: start a job, list jobs, wait on one, list run records.

Standard library only; run as a one-shot command (:func:`rigctl.hostside.ship.python_command`), each
command one round trip that prints one JSON document:

* ``start``: reads ``{relative path: text}`` from stdin (``spec.json`` among them), writes the job
  directory (root's) and makes the run directory (the service account's, :mod:`rigctl.hostside.jobfiles`),
  then, under a mutex, refuses while the lock's holder is active, else takes the lock and starts the unit
  (:func:`unit_argv`). Prints ``{"started": unit}``, ``{"refused": holder}`` or ``{"error": text}``.
* ``list ROOT [ID]``: every job directory's state (its spec while the runtime has not written
  ``.state.json`` yet, ``finishing`` until the unit's root step after it is done) and whether its unit is
  active.
* ``wait ROOT ID LAST HOLD EVERY``: waits on the host until the job's state file shows other progress
  than ``LAST`` (:func:`progress_key`), or ``HOLD`` seconds pass, then lists that job: one round trip
  and one process per change of progress, instead of a process (and a systemctl) per poll competing
  with the bench for the CPUs.
* ``seal-lost ROOT ID``: seals the run of a job whose unit died without sealing it (``jobrun.py
  --seal-lost``, run in the job's own sandbox as the service account: root never writes into a run
  directory), then frees its lock; prints the record.
* ``runs ROOT UNIT_PREFIX INLINE_LIMIT [ID ...]``: the run records under ``ROOT`` (those named, if any)
  as ``{run id: {"record", "active"}}`` (the unit is only asked about for runs still ``running``); with
  an ``INLINE_LIMIT`` above 0 a finished run's entry also carries its files' bytes, base64, up to that
  many bytes in all (``"inline"``, :func:`inline_files`), so a pull of small runs is one round trip.
"""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from typing import Any

from rigctl.hostside import commands, stamp
from rigctl.hostside.jobfiles import (
    FINAL_STATES,
    FINISHED_FILE,
    NOT_STARTED_FILE,
    READ_LIMIT,
    SPEC_FILE,
    read_below,
    read_json,
    read_state,
    release_lock,
    run_dir,
    sandboxed,
    unit_active,
)
from rigctl.hostside.runrecord import Server
from rigctl.hostside.sandbox import run_options

PROGRESS_KEYS = ("state", "done", "total", "message")
#: The host's python3 for a job's runtime: no PYTHON* variables, no user site (imports from the job directory).
PYTHON = ("/usr/bin/python3", "-E", "-s")
#: What a job's files are written with: the job may read them, nobody but root change them.
FILE_MODE = 0o644
DIR_MODE = 0o755
#: The run files a job writes: readable by whoever pulls them (the fleet user over SFTP).
JOB_UMASK = "0022"
#: How a job appears while its unit's ExecStopPost= (servers started again, lock freed) still runs.
FINISHING = "finishing"

_load = read_json


def progress_key(state: dict[str, Any] | None) -> str:
    """What ``wait`` compares a job's state against: the JSON of its progress fields ("" for none)."""
    return "" if state is None else json.dumps([state.get(k) for k in PROGRESS_KEYS])


def write_job_dir(job_dir: str, files: dict[str, str]) -> None:
    """The shipped files under ``job_dir``, root's and read-only to everyone else, whatever the umask."""
    for name, text in files.items():
        path = os.path.normpath(os.path.join(job_dir, name))
        if not path.startswith(job_dir.rstrip("/") + "/"):
            raise ValueError(f"job file {name!r} is not inside the job directory")
        parent = os.path.dirname(path)
        os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
        os.chmod(parent, DIR_MODE)
        with open(path, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), FILE_MODE)
            out.write(text)


def unit_argv(spec: dict[str, Any]) -> list[str]:
    """The ``systemd-run`` command line of a job's unit: ``jobrun.py`` as the service account with the
    ``llama-server@`` unit's sandbox, writable only its run directory (``spec["unit_properties"]``, from the
    controller's :meth:`rigctl.inventory.model.ServiceAccount.unit_properties`). What needs root around it runs as
    root from the root-owned job directory, on no word of the job: ``--prepare`` before it (hash the model
    files into the host's cache, stop the servers the spec names) and ``--finish`` after it, whatever ended
    it (start those servers again, free the lock). ``--no-block``: hashing and stopping take their time."""
    job_dir = str(spec["job_dir"])
    runtime = os.path.join(job_dir, "jobrun.py")
    log = os.path.join(job_dir, "output.log")
    limit = int(spec["max_runtime_s"])
    properties = [
        *spec["unit_properties"], f"UMask={JOB_UMASK}",
        f"RuntimeMaxSec={limit}", f"TimeoutStartSec={limit}", "TimeoutStopSec=120",
        f"StandardOutput=append:{log}", f"StandardError=append:{log}",
        f"ExecStartPre=+{' '.join(PYTHON)} {runtime} --prepare {job_dir}",
        f"ExecStopPost=+{' '.join(PYTHON)} {runtime} --finish {job_dir}",
    ]
    return ["systemd-run", "--unit", str(spec["unit"]), "--collect", "--quiet", "--no-block",
            "--description", f"rigctl {spec['kind']} job {spec['id']}", "--working-directory", job_dir,
            *run_options(properties), *PYTHON, runtime, job_dir]


def _account(spec: dict[str, Any]) -> tuple[int, int]:
    account = spec.get("account") or {}
    try:
        return pwd.getpwnam(str(account.get("user"))).pw_uid, grp.getgrnam(str(account.get("group"))).gr_gid
    except KeyError:
        raise ValueError(f"the service account {account.get('user')}:{account.get('group')} does not exist "
                         "on the host (provision it first)") from None


def make_run_dir(spec: dict[str, Any]) -> str:
    """The job's run directory, the service account's, under root's ``<results>/<host>/``."""
    uid, gid = _account(spec)
    path = run_dir(spec)
    for parent in (str(spec["results_dir"]), os.path.dirname(path)):
        os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
        if os.lstat(parent).st_uid != 0:  # left the account's by an older rigctl or role
            os.chown(parent, 0, 0, follow_symlinks=False)
        os.chmod(parent, DIR_MODE)
    os.mkdir(path, DIR_MODE)  # a fresh run id: never there before
    os.chown(path, uid, gid)
    return path


def stop_servers(spec: dict[str, Any]) -> dict[str, Any]:
    """For a job that stops the host's llama-server units: each running one, its argv stamped now (the job
    finds them stopped), into the spec's record and ``stop_units`` (what ``--prepare`` stops and ``--finish``
    starts again)."""
    record = spec.setdefault("record", {})
    names = stamp.active_servers()
    servers = [Server(name=name, host=spec["host"]) for name in names]
    for server in servers:
        stamp.deployed_server(server)  # one it cannot read is read again by the job, and noted there
    record["servers"] = [dataclasses.asdict(s) for s in servers]
    record.setdefault("extra", {})["servers_stopped"] = names
    spec["stop_units"] = [s.unit for s in servers]
    return spec


def start(files: dict[str, str]) -> dict[str, Any]:
    spec = json.loads(files[SPEC_FILE])
    job_dir = spec["job_dir"]
    os.makedirs(job_dir, mode=DIR_MODE, exist_ok=True)
    os.chmod(job_dir, DIR_MODE)
    try:
        make_run_dir(spec)
    except (OSError, ValueError) as exc:
        shutil.rmtree(job_dir)
        return {"error": str(exc)}
    locks = os.path.join(os.path.dirname(job_dir), "locks")
    os.makedirs(locks, mode=DIR_MODE, exist_ok=True)
    with open(os.path.join(locks, ".mutex"), "a") as mutex:
        fcntl.flock(mutex, fcntl.LOCK_EX)
        lock_file = spec.get("lock_file")
        if lock_file:
            holder = _load(lock_file)
            if isinstance(holder, dict) and unit_active(str(holder.get("unit"))):
                shutil.rmtree(job_dir)
                os.rmdir(run_dir(spec))
                return {"refused": holder}
            with open(lock_file + ".tmp", "w", encoding="utf-8") as out:
                json.dump({"job": spec["id"], "unit": spec["unit"], "kind": spec["kind"]}, out)
            os.replace(lock_file + ".tmp", lock_file)
        if spec.get("stop_servers"):
            spec = stop_servers(spec)
        write_job_dir(job_dir, {**files, SPEC_FILE: json.dumps(spec, indent=2, sort_keys=True) + "\n"})
        done = subprocess.run(unit_argv(spec), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            if lock_file:
                os.unlink(lock_file)
            shutil.rmtree(job_dir)
            os.rmdir(run_dir(spec))
            return {"error": (done.stderr or done.stdout).strip() or f"systemd-run exited {done.returncode}"}
    return {"started": spec["unit"]}


def job_state(job_dir: str, spec: dict[str, Any], state: dict[str, Any] | None) -> dict[str, Any]:
    """The job's progress as its state file says (``state``), ``finishing`` while a final state waits on the
    unit's ExecStopPost= (servers started again, lock freed), ``starting`` before the job wrote any, and
    ``failed`` when root's step before it kept it from running (:func:`rigctl.hostside.jobrun.prepare`) or
    found it ended without a final state (:func:`rigctl.hostside.jobrun.finish`, with the cause)."""
    if not isinstance(state, dict):
        refused = _load(os.path.join(job_dir, NOT_STARTED_FILE))
        if isinstance(refused, dict) and os.path.exists(os.path.join(job_dir, FINISHED_FILE)):
            return {"state": "failed", "message": "not started", "error": str(refused.get("error")),
                    "ended": refused.get("ended")}
    if not (isinstance(state, dict) and state.get("state") in FINAL_STATES):
        # Root's step after the job found it ended without a final state (the results disk full, say): why.
        finished = _load(os.path.join(job_dir, FINISHED_FILE))
        if isinstance(finished, dict) and finished.get("error"):
            return {**(state or {}), "state": "failed", "message": "ended without sealing its run",
                    "error": str(finished["error"]), "ended": finished.get("ended")}
    if not isinstance(state, dict):
        return {"state": "starting", "message": "starting"}
    if (state.get("state") in FINAL_STATES and sandboxed(spec)
            and not os.path.exists(os.path.join(job_dir, FINISHED_FILE))):
        return {**state, "state": FINISHING, "message": f"{state.get('message')} ({state.get('state')}; finishing)"}
    return state


def list_jobs(root: str, only: str = "") -> list[dict[str, Any]]:
    out = []
    names = sorted(n for n in os.listdir(root) if n != "locks") if os.path.isdir(root) else []
    for name in names:
        if only and name != only:
            continue
        job_dir = os.path.join(root, name)
        spec = _load(os.path.join(job_dir, SPEC_FILE))
        if not isinstance(spec, dict):
            continue
        active = unit_active(str(spec.get("unit")))
        raw = read_state(job_dir, spec)
        # A unit gone without finishing (the host went down, say) leaves the job as its state file says.
        state = job_state(job_dir, spec, raw) if active else job_state(job_dir, {}, raw)
        out.append({"spec": {k: spec.get(k) for k in ("id", "kind", "host", "unit", "lock")}, "state": state,
                    "active": active})
    return out


def wait_for_change(job_dir: str, last: str, hold_s: float, every_s: float) -> None:
    end = time.monotonic() + hold_s
    spec = _load(os.path.join(job_dir, SPEC_FILE))
    while time.monotonic() < end and os.path.isdir(job_dir) and isinstance(spec, dict):
        state = read_state(job_dir, spec)
        if isinstance(state, dict) and progress_key(job_state(job_dir, spec, state)) != last:
            return
        time.sleep(every_s)


def seal_lost(root: str, job_id: str) -> int:
    """``jobrun.py --seal-lost`` for a job whose unit is gone, as the job itself would run it: the service
    account in the job's sandbox (a job started before rigctl sandboxed its jobs: as it ran, root); then its
    lock is freed. Its output is the record; its exit status, ours."""
    job_dir = os.path.join(root, job_id)
    spec = _load(os.path.join(job_dir, SPEC_FILE))
    if not isinstance(spec, dict):
        print(f"jobhost: no job {job_id} under {root}", file=sys.stderr)
        return 1
    if unit_active(str(spec.get("unit"))):
        print(f"job {job_id}: unit {spec.get('unit')} is still active", file=sys.stderr)
        return 1
    command = [*PYTHON, os.path.join(job_dir, "jobrun.py"), "--seal-lost", job_dir]
    if sandboxed(spec):
        command = ["systemd-run", "--wait", "--pipe", "--quiet", "--collect", "--unit", f"{spec['unit']}-seal",
                   "--working-directory", job_dir, *run_options([*spec["unit_properties"], f"UMask={JOB_UMASK}"]),
                   *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode == 0:
        release_lock(spec)
    return done.returncode


def list_runs(root: str, unit_prefix: str, inline_limit: int = 0, only: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    budget = inline_limit
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if only and name not in only:
            continue
        raw = read_below(root, f"{name}/run.json", READ_LIMIT)  # a run directory that is a link is not read
        try:
            record = json.loads(raw) if raw is not None else None
        except (ValueError, RecursionError):
            record = None
        if not isinstance(record, dict):
            continue
        active = record.get("status") == "running" and unit_active(unit_prefix + name)
        out[name] = {"record": record, "active": active}
        if budget > 0 and record.get("status") != "running":
            out[name]["inline"], budget = inline_files(os.path.join(root, name), record, budget)
    return out


def inline_files(run_dir: str, record: dict[str, Any], budget: int) -> tuple[dict[str, str], int]:
    """``{relative path: base64}`` of the run's ``run.json`` and the files its record lists, while they fit
    in ``budget`` bytes (the rest travel by SFTP), and what is left of it. Only files inside the run."""
    found: dict[str, str] = {}
    files = [f for f in record.get("files") or [] if isinstance(f, dict)]
    # Each file no larger than the record says (run.json: the read limit), so a file grown since, or a
    # device, is never read past that: it travels by SFTP, bounded the same way, and is refused there.
    sized = [("run.json", READ_LIMIT)] + [(f.get("path"), f.get("bytes")) for f in files]
    for rel, recorded in sized:
        if not isinstance(rel, str) or not isinstance(recorded, int) or isinstance(recorded, bool) or recorded < 0:
            continue
        data = read_below(run_dir, rel, min(recorded, budget))
        if data is None:
            if recorded > budget:  # the rest travel by SFTP
                break
            continue  # not there, not a regular file inside the run, or grown past its record
        found[rel] = base64.b64encode(data).decode("ascii")
        budget -= len(data)
    return found, budget


def _wait(args: list[str]) -> Any:
    root, job_id, last, hold_s, every_s = args
    wait_for_change(os.path.join(root, job_id), last, float(hold_s), float(every_s))
    return list_jobs(root, job_id)


def _runs(args: list[str]) -> Any:
    root, unit_prefix, inline_limit, *only = args
    return list_runs(root, unit_prefix, int(inline_limit), only)


def main(argv: list[str]) -> int:
    if argv[:1] == ["seal-lost"]:  # answers with its exit status, not a document
        return seal_lost(argv[1], argv[2])
    return commands.answer("jobhost", argv, {
        "start": lambda _args: start(json.load(sys.stdin)),
        "list": lambda args: list_jobs(args[0], args[1] if len(args) > 1 else ""),
        "wait": _wait,
        "runs": _runs,
    })


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
