"""``rigctl init DIR``: a starter inventory, commented, that passes ``inventory check`` with no hosts yet; the
first host comes with ``rigctl -i DIR hosts add``. The files are the package's ``inventory/data/starter/``."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from rigctl.errors import ConfigError

STARTER = Path(__file__).resolve().parent / "data" / "starter"


def write_starter(dest: Path) -> list[Path]:
    """The starter inventory at ``dest`` (a new directory, or an empty one): every file lands at once by one
    rename, or none does. The files written, relative to ``dest``."""
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"{dest}: not a directory")
    if dest.is_dir() and any(dest.iterdir()):
        raise ConfigError(f"{dest}: not empty; init writes a new inventory, it never adds to one")
    parent = dest.absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"{dest}: its directory {parent} does not exist")
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=parent))
    except OSError as exc:
        raise ConfigError(f"{dest}: cannot write in {parent} ({exc.strerror})") from None
    try:
        shutil.copytree(STARTER, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        staging.chmod(0o755)
        if dest.is_dir():
            dest.rmdir()  # empty, checked above; the rename needs its name free
        os.replace(staging, dest)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError(f"{dest}: could not write the starter inventory ({exc.strerror or exc})") from None
    return sorted(p.relative_to(dest) for p in dest.rglob("*") if p.is_file())
