"""A bench run's ``cells.jsonl``: one line per llama-bench cell, written on the host by
:mod:`rigctl.hostside.bench_task`, read on the controller by :mod:`rigctl.bench.matrix` and checked by
:mod:`rigctl.jobs` when it pulls the run (every raw file a line names must be the run's own). Standard library
only."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

CELLS_FILE = "cells.jsonl"


def cell_files(cells: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(where, path) of every raw file the lines of a ``cells.jsonl`` name (pure)."""
    for number, cell in enumerate(cells, 1):
        for key in ("raw", "log"):
            if cell.get(key) is not None:
                yield f"line {number} {key}", cell[key]
