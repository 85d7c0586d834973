"""The controller's own files: its cache directory, and writing so that a reader sees the old content
or the new, never half."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

#: Environment variable naming the controller's cache directory (downloads, locks, parsed tables).
CACHE_ENV = "RIGCTL_CACHE_DIR"


def cache_dir() -> Path:
    """Where the controller keeps what is slow to make again: $RIGCTL_CACHE_DIR, else ~/.cache/rigctl."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/rigctl").expanduser()


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to a temp file beside ``path`` with ``mode``, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
