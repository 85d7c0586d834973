"""Where a job's files are on a host and who may write them, for both sides of a job there:
:mod:`rigctl.hostside.jobhost` (root, over SSH) and :mod:`rigctl.hostside.jobrun` (the job's unit). Standard
library only.

The tree is root's; a job writes only its run directory::

    <jobs>/<id>/            root 0755: spec.json, the shipped code and files, output.log (systemd's),
                            finished.json (root's ExecStopPost= step, once the unit's end is handled),
                            not-started.json (root's ExecStartPre= step, when it kept the job from running)
    <jobs>/locks/           root: <lock>.json, the holder's job and unit
    <results>/<host>/       root 0755
    <results>/<host>/<id>/  the service account's: run.json, the raw files, .state.json (progress)

The job's unit runs as the service account with the ``llama-server@`` unit's sandbox
(:mod:`rigctl.hostside.sandbox`), ``ReadWritePaths=`` its run directory only, so whatever llama.cpp code it
runs cannot change the code or spec it was started with, another run, a lock or the hash cache. What root
reads back from a run directory is read with :func:`read_json`: no links followed, no FIFO waited on, bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
from typing import Any

SPEC_FILE = "spec.json"
#: The job's progress, in its run directory (hidden: not a raw file of the run).
STATE_FILE = ".state.json"
#: Where jobs started before the tree was root's kept their progress: the job directory.
OLD_STATE_FILE = "state.json"
FINISHED_FILE = "finished.json"
#: Why root's step before the job refused to let it run (a server that would not stop).
NOT_STARTED_FILE = "not-started.json"
#: The most a progress or record file is read to (a job can write a file of any size).
READ_LIMIT = 16 << 20
#: ``systemctl is-active`` states of a unit that is still there: starting (ExecStartPre=), running, or
#: ending (ExecStopPost=).
ACTIVE_STATES = frozenset({"active", "activating", "deactivating", "reloading", "refreshing"})
FINAL_STATES = frozenset({"done", "failed", "stopped", "lost"})


def run_dir(spec: dict[str, Any]) -> str:
    """The job's run directory: ``<results_dir>/<host>/<id>``."""
    return os.path.join(str(spec["results_dir"]), str(spec["host"]), str(spec["id"]))


def state_path(spec: dict[str, Any]) -> str:
    return os.path.join(run_dir(spec), STATE_FILE)


def sandboxed(spec: dict[str, Any]) -> bool:
    """Whether the job runs as the service account in its sandbox (every job this rigctl starts does)."""
    return bool(spec.get("unit_properties"))


_NO_LINK = os.O_NOFOLLOW | os.O_CLOEXEC


def open_below(root: str, relative: str) -> int | None:
    """A read-only fd of the regular file ``relative`` under ``root``, each directory on the way opened from its
    parent's fd without following a link (``O_NOFOLLOW``), so a link the job left anywhere in its run (its
    directory, a subdirectory, the file) is never followed out of it by root; None when a part is a link,
    missing, ``..``, or the file is not a regular file (a FIFO, a device)."""
    parts = relative.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return None
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _NO_LINK)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NO_LINK, dir_fd=fd)
            os.close(fd)
            fd = inner
        found = os.open(parts[-1], os.O_RDONLY | os.O_NONBLOCK | _NO_LINK, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(found).st_mode):
        os.close(found)
        return None
    return found


def read_below(root: str, relative: str, limit: int) -> bytes | None:
    """The bytes of :func:`open_below`'s file, None when there is none or it holds more than ``limit``."""
    fd = open_below(root, relative)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit + 1)
    return data if len(data) <= limit else None


def read_json(path: str, limit: int = READ_LIMIT) -> Any:
    """The JSON in the regular file ``path`` (not through a symbolic link), None when there is none or it is
    not JSON or larger than ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(limit + 1)
        return json.loads(data) if len(data) <= limit else None
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def read_state(job_dir: str, spec: dict[str, Any]) -> dict[str, Any] | None:
    """The job's progress: its run directory's state file (an older job's in its job directory)."""
    for path in (state_path(spec), os.path.join(job_dir, OLD_STATE_FILE)):
        state = read_json(path)
        if isinstance(state, dict):
            return state
    return None


def unit_state(unit: str) -> str:
    """``systemctl is-active UNIT``: active, activating, inactive, failed, ..."""
    try:
        done = subprocess.run(["systemctl", "is-active", unit], capture_output=True, text=True, timeout=60,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def unit_active(unit: str) -> bool:
    """Whether ``unit`` is still there: starting, running or ending."""
    return unit_state(unit) in ACTIVE_STATES


def release_lock(spec: dict[str, Any]) -> None:
    """Remove the job's lock file when it still names the job (root's, at the unit's end)."""
    lock_file = spec.get("lock_file")
    if not lock_file:
        return
    holder = read_json(str(lock_file))
    if isinstance(holder, dict) and holder.get("job") == spec.get("id"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(lock_file))
