"""Answer habits of an eval run per set: how often the model answered without the tool it was given, missed a
call, ran into the token cutoff, and the other labels its scorer keeps (read from ``answers.jsonl``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigctl.analysis.compare import RunRef, label_text, load_answers
from rigctl.results.record import ANSWERS_FILE
from rigctl.results.store import StoredRun


@dataclass(frozen=True)
class SetHabits:
    """How a run answered one set: what it picked against the gold labels, cut-offs, missing tool calls."""

    set: str
    n: int
    cutoff: int
    tool_rows: int  # replies to tool-calling questions (rows that record ``toolless``)
    toolless: int
    missed_calls: int  # tool-less replies whose text looks like a call the parser missed
    predicted: dict[str, int] = field(default_factory=dict)
    gold: dict[str, int] = field(default_factory=dict)

    @property
    def cutoff_share(self) -> float:
        return self.cutoff / self.n if self.n else float("nan")

    @property
    def toolless_share(self) -> float:
        return self.toolless / self.tool_rows if self.tool_rows else float("nan")

    @property
    def top_label(self) -> tuple[str, int] | None:
        """The most predicted label and its count (``neutral`` on 298 of 299)."""
        return max(self.predicted.items(), key=lambda kv: (kv[1], kv[0])) if self.predicted else None


@dataclass(frozen=True)
class RunHabits:
    run: RunRef
    sets: tuple[SetHabits, ...]

    @property
    def file(self) -> Path:
        return self.run.path / ANSWERS_FILE


def habits_of(rows: Iterable[dict[str, Any]]) -> list[SetHabits]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault(str(row["set"]), []).append(row)
    out = []
    for name in sorted(grouped):
        group = grouped[name]
        tool_rows = [r for r in group if "toolless" in r]
        labelled = [r for r in group if "pred" in r and "gold" in r]
        out.append(SetHabits(
            set=name,
            n=len(group),
            cutoff=sum(bool(r.get("cutoff")) for r in group),
            tool_rows=len(tool_rows),
            toolless=sum(bool(r["toolless"]) for r in tool_rows),
            missed_calls=sum(bool(r.get("toolless")) and bool(r.get("missed_call")) for r in tool_rows),
            predicted=dict(Counter(label_text(r["pred"]) or "(none)" for r in labelled).most_common()),
            gold=dict(Counter(label_text(r["gold"]) or "(none)" for r in labelled).most_common()),
        ))
    return out


def answer_habits(run: StoredRun) -> RunHabits:
    return RunHabits(run=RunRef.of(run), sets=tuple(habits_of(load_answers(run))))
