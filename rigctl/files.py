"""The controller's own files: its cache directory, and writing so that a reader sees the old content
or the new, never half.

Several rigctl processes fill one cache at once (two lab slots preparing, a prepare beside a ``lab up``):
an entry that is slow to make is made under :func:`entry_lock`, so that one process makes it while the
others wait and then find it made, and it lands by one rename, so that its presence means it is complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rigctl.errors import ConfigError, RigctlError

#: Environment variable naming the controller's cache directory (downloads, locks, parsed tables).
CACHE_ENV = "RIGCTL_CACHE_DIR"


def cache_dir() -> Path:
    """Where the controller keeps what is slow to make again: $RIGCTL_CACHE_DIR, else ~/.cache/rigctl."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/rigctl").expanduser()


def write_atomically(path: Path, text: str | bytes, mode: int = 0o644) -> None:
    """Write ``text`` (or bytes, written as they are) to a temp file beside ``path`` with ``mode``, then
    rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


#: How often a writer waiting for another's entry lock tries again.
ENTRY_LOCK_POLL_S = 0.2


@contextlib.contextmanager
def entry_lock(entry: Path, timeout: float, error: type[RigctlError] = RigctlError) -> Iterator[None]:
    """Hold ``<entry>.lock`` (beside the entry) for the block: one writer of ``entry`` at a time across
    processes. Waits up to ``timeout`` seconds for another writer (it is making the same entry: the caller
    looks again once it holds the lock), then raises ``error`` naming the lock. The kernel releases a lock
    whose holder died, so a killed writer never blocks the next one."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    lock_path = entry.with_name(f"{entry.name}.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise error(f"{lock_path}: another rigctl process has been making {entry.name} for over "
                                f"{timeout:.0f}s") from None
                time.sleep(ENTRY_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)


#: A hash lock's writer holds its lock for a read and a write: milliseconds.
HASH_LOCK_TIMEOUT_S = 30


class HashLock:
    """A lock file ``{key: sha256}``: the hash a download had the first time it was fetched without a known
    one (trust on first use), checked on every later fetch. Bad content raises ``error`` naming the file."""

    def __init__(self, path: Path, error: type[RigctlError] = ConfigError):
        self.path = path
        self.error = error

    def read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError as exc:
            raise self.error(f"{self.path}: lock file is not JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict):
            raise self.error(f"{self.path}: lock file is not a JSON object")
        return {str(k): str(v) for k, v in data.items()}

    def get(self, key: str) -> str | None:
        return self.read().get(key)

    def record(self, key: str, sha256: str) -> None:
        # Read, add and write under the file's own lock: two fetches recording at once keep both entries.
        with entry_lock(self.path, HASH_LOCK_TIMEOUT_S, self.error):
            entries = self.read()
            entries[key] = sha256
            write_atomically(self.path, json.dumps(entries, indent=2, sort_keys=True) + "\n")
