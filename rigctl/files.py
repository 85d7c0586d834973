"""The controller's own files: its cache directory, and writing so that a reader sees the old content
or the new, never half."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from rigctl.errors import ConfigError, RigctlError

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
        entries = self.read()
        entries[key] = sha256
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, json.dumps(entries, indent=2, sort_keys=True) + "\n")
