"""The lowest versions pyproject.toml allows, as pip constraints (``name==floor``, one a line), for `make
floor-check`: the floors are only true if the code works on them. A dependency without a ``>=`` floor is an
error: every one must say what it needs."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
_FLOOR = re.compile(r"^([A-Za-z0-9_.\-\[\]]+?)(\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)")


def floors(requirements: list[str]) -> list[str]:
    pins = []
    for requirement in requirements:
        match = _FLOOR.match(requirement)
        if match is None:
            raise SystemExit(f"{PYPROJECT}: {requirement!r} has no >= floor")
        pins.append(f"{match[1]}=={match[3]}")
    return pins


def main() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    groups = sys.argv[1:]  # optional-dependency groups to pin too (dev: the tests' own tools)
    requirements = list(project["dependencies"])
    for group in groups:
        requirements += project["optional-dependencies"][group]
    print("\n".join(floors(requirements)))


if __name__ == "__main__":
    main()
