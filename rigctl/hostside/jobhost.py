"""The host's half of :mod:`rigctl.jobs`: start a job, list jobs, wait on one, list run records.

Standard library only; run as a one-shot command (:func:`rigctl.hostside.ship.python_command`), each
command one round trip that prints one JSON document:

* ``start``: reads ``{relative path: text}`` from stdin (``spec.json`` among them), writes the job
  directory, then, under a mutex, refuses while the lock's holder is active, else takes the lock and
  starts the unit. Prints ``{"started": unit}``, ``{"refused": holder}`` or ``{"error": text}``.
* ``list ROOT [ID]``: every job directory's state (its spec while the runtime has not written
  ``state.json`` yet) and whether its unit is active.
* ``wait ROOT ID LAST HOLD EVERY``: waits on the host until the job's state file shows other progress
  than ``LAST`` (:func:`progress_key`), or ``HOLD`` seconds pass, then lists that job: one round trip
  and one process per change of progress, instead of a process (and a systemctl) per poll competing
  with the bench for the CPUs.
* ``runs ROOT UNIT_PREFIX INLINE_LIMIT [ID ...]``: the run records under ``ROOT`` (those named, if any)
  as ``{run id: {"record", "active"}}`` (the unit is only asked about for runs still ``running``); with
  an ``INLINE_LIMIT`` above 0 a finished run's entry also carries its files' bytes, base64, up to that
  many bytes in all (``"inline"``, :func:`inline_files`), so a pull of small runs is one round trip.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

PROGRESS_KEYS = ("state", "done", "total", "message")


def unit_active(unit: str) -> bool:
    return subprocess.run(["systemctl", "is-active", "--quiet", unit], check=False).returncode == 0


def _load(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def progress_key(state: dict[str, Any] | None) -> str:
    """What ``wait`` compares a job's state against: the JSON of its progress fields ("" for none)."""
    return "" if state is None else json.dumps([state.get(k) for k in PROGRESS_KEYS])


def write_job_dir(job_dir: str, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = os.path.normpath(os.path.join(job_dir, name))
        if not path.startswith(job_dir.rstrip("/") + "/"):
            raise ValueError(f"job file {name!r} is not inside the job directory")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)


def start(files: dict[str, str]) -> dict[str, Any]:
    spec = json.loads(files["spec.json"])
    job_dir = spec["job_dir"]
    os.makedirs(job_dir, exist_ok=True)
    os.makedirs(spec["results_dir"], exist_ok=True)
    write_job_dir(job_dir, files)
    locks = os.path.join(os.path.dirname(job_dir), "locks")
    os.makedirs(locks, exist_ok=True)
    with open(os.path.join(locks, ".mutex"), "a") as mutex:
        fcntl.flock(mutex, fcntl.LOCK_EX)
        lock_file = spec.get("lock_file")
        if lock_file:
            holder = _load(lock_file)
            if isinstance(holder, dict) and unit_active(str(holder.get("unit"))):
                shutil.rmtree(job_dir)
                return {"refused": holder}
            with open(lock_file + ".tmp", "w", encoding="utf-8") as out:
                json.dump({"job": spec["id"], "unit": spec["unit"], "kind": spec["kind"]}, out)
            os.replace(lock_file + ".tmp", lock_file)
        log = os.path.join(job_dir, "output.log")
        argv = ["systemd-run", "--unit", spec["unit"], "--collect", "--quiet",
                "--description", f"rigctl {spec['kind']} job {spec['id']}",
                "--working-directory", job_dir,
                "-p", f"RuntimeMaxSec={int(spec['max_runtime_s'])}", "-p", "TimeoutStopSec=120",
                "-p", f"StandardOutput=append:{log}", "-p", f"StandardError=append:{log}",
                "/usr/bin/python3", os.path.join(job_dir, "jobrun.py"), job_dir]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            if lock_file:
                os.unlink(lock_file)
            shutil.rmtree(job_dir)
            return {"error": (done.stderr or done.stdout).strip() or f"systemd-run exited {done.returncode}"}
    return {"started": spec["unit"]}


def list_jobs(root: str, only: str = "") -> list[dict[str, Any]]:
    out = []
    names = sorted(n for n in os.listdir(root) if n != "locks") if os.path.isdir(root) else []
    for name in names:
        if only and name != only:
            continue
        spec = _load(os.path.join(root, name, "spec.json"))
        if not isinstance(spec, dict):
            continue
        state = _load(os.path.join(root, name, "state.json"))
        if not isinstance(state, dict):
            state = {"state": "starting", "message": "starting"}
        out.append({"spec": {k: spec.get(k) for k in ("id", "kind", "host", "unit", "lock")}, "state": state,
                    "active": unit_active(str(spec.get("unit")))})
    return out


def wait_for_change(job_dir: str, last: str, hold_s: float, every_s: float) -> None:
    end = time.monotonic() + hold_s
    while time.monotonic() < end and os.path.isdir(job_dir):
        state = _load(os.path.join(job_dir, "state.json"))
        if isinstance(state, dict) and progress_key(state) != last:
            return
        time.sleep(every_s)


def list_runs(root: str, unit_prefix: str, inline_limit: int = 0, only: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    budget = inline_limit
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if only and name not in only:
            continue
        record = _load(os.path.join(root, name, "run.json"))
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
    paths = ["run.json"] + [f.get("path") for f in record.get("files") or [] if isinstance(f, dict)]
    for rel in paths:
        if not isinstance(rel, str):
            continue
        path = os.path.normpath(os.path.join(run_dir, rel))
        if not path.startswith(run_dir.rstrip("/") + "/") or os.path.islink(path) or not os.path.isfile(path):
            continue
        if os.path.getsize(path) > budget:
            break
        with open(path, "rb") as handle:
            data = handle.read(budget + 1)
        if len(data) > budget:
            break
        found[rel] = base64.b64encode(data).decode("ascii")
        budget -= len(data)
    return found, budget


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "start":
        answer: Any = start(json.load(sys.stdin))
    elif command == "list":
        answer = list_jobs(args[0], args[1] if len(args) > 1 else "")
    elif command == "wait":
        root, job_id, last, hold_s, every_s = args
        wait_for_change(os.path.join(root, job_id), last, float(hold_s), float(every_s))
        answer = list_jobs(root, job_id)
    elif command == "runs":
        root, unit_prefix, inline_limit, *only = args
        answer = list_runs(root, unit_prefix, int(inline_limit), only)
    else:
        print(f"jobhost: unknown command {command!r}", file=sys.stderr)
        return 2
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
