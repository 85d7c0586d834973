"""Editing a copy of an inventory on purpose, for the tests that break one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml


def edit_yaml(path: Path, change: Callable[[Any], None]) -> None:
    """Load ``path`` (a missing file is an empty mapping), let ``change`` edit it in place, write it back."""
    data = yaml.safe_load(path.read_text()) if path.exists() else {}
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
