"""The report's Markdown pieces: tables, the links from a figure to the raw file it came from, number formats."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from rigctl.results.store import StoredRun

#: Under a campaign step's heading while the store holds no run of it.
NOT_PULLED = "Nothing pulled yet."


class Links:
    """Markdown links relative to the report's directory."""

    def __init__(self, out_dir: Path, results_root: Path) -> None:
        self.out_dir = out_dir.resolve()
        self.root = results_root.resolve()

    def rel(self, path: Path) -> str:
        return os.path.relpath(path.resolve(), self.out_dir).replace(" ", "%20")

    def result(self, relative: str) -> Path:
        return self.root / relative

    def number(self, text: str, files: Sequence[Path]) -> str:
        """``text`` linked to the first file, the others as numbered superscript links."""
        if not files:
            return text
        first, *rest = files
        extra = "".join(f"<sup>[{i}]({self.rel(p)})</sup>" for i, p in enumerate(rest, 2))
        return f"[{text}]({self.rel(first)}){extra}"


def md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("\n", " ") for c in cells) + " |"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> list[str]:
    aligns = [("---:" if (align[i:i + 1] or "r") == "r" else ":---") for i in range(len(header))]
    return [md_row(header), md_row(aligns), *(md_row(r) for r in rows)]


def mean_sd(values: Sequence[float]) -> str:
    mean = float(np.mean(values))
    sd = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return f"{mean:.2f} ± {sd:.2f}"


def quoted(text: str) -> str:
    """A reply as an indented code block: whatever the model wrote cannot break the Markdown around it."""
    return "\n".join("    " + line for line in (text or "(empty reply)").splitlines() or [""])


def ms_text(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


class _Named(Protocol):
    @property
    def name(self) -> str: ...


Step = TypeVar("Step", bound=_Named)


def pulled_steps(lines: list[str], steps: Iterable[Step], runs: Mapping[str, StoredRun | None],
                 heading: Callable[[Step], str]) -> Iterator[tuple[Step, StoredRun]]:
    """Each campaign step with its pulled run (``runs``, by step name), its ``###`` heading appended to
    ``lines`` first; a step with no run gets :data:`NOT_PULLED` under its heading and is passed over."""
    for step in steps:
        run = runs.get(step.name)
        lines += [f"### {heading(step)}", ""]
        if run is None:
            lines += [NOT_PULLED, ""]
            continue
        yield step, run
