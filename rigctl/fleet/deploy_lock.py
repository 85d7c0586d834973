"""One playbook run per inventory at a time: a lock file the second `rigctl provision` is refused by.

Two runs against the same hosts race each other (one restarts a server the other is waiting on, and
reports success before the first has finished). The lock is an flock(2) on a file named after the
inventory's resolved path, under the cache directory: the kernel drops it when its holder dies, so a
killed run never leaves a stale lock. The file holds the holder's pid, command line and start time
for the refusal message.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from rigctl.errors import DeployBusyError, DeployError
from rigctl.files import cache_dir


def lock_dir() -> Path:
    return cache_dir() / "locks"


def lock_path(inventory_source: Path) -> Path:
    resolved = str(Path(inventory_source).resolve())
    digest = hashlib.sha256(resolved.encode()).hexdigest()[:16]
    return lock_dir() / f"playbook-{Path(resolved).name}-{digest}.lock"


@contextlib.contextmanager
def inventory_lock(inventory_source: Path, command: str | None = None) -> Iterator[Path]:
    """Hold the inventory's playbook lock for the block; DeployBusyError naming the holder when taken."""
    path = lock_path(inventory_source)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")  # noqa: SIM115 (held for the block, closed below)
    except OSError as exc:
        raise DeployError(f"lock {path}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            try:
                holder = json.loads(handle.read() or "{}")
            except ValueError:
                holder = {}
            raise DeployBusyError(str(inventory_source), holder.get("pid"), str(holder.get("command") or "?"),
                                  str(holder.get("started") or "?")) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "command": command or shlex.join(["rigctl", *sys.argv[1:]]),
                                 "started": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                 "inventory": str(Path(inventory_source).resolve())}))
        handle.flush()
        yield path
    finally:
        handle.close()  # releases the flock
