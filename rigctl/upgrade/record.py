"""An ``upgrade`` or ``bisect`` record read back (by ``rigctl report`` and by a bisect that resumes): its
``extra`` and a bisect's ``steps.jsonl`` held to the shapes :mod:`rigctl.upgrade.upgrade` and
:mod:`rigctl.upgrade.bisect` write, so a record edited or damaged on disk is one ``error:`` line naming the
file and the key, never a KeyError or AttributeError from deep inside the renderer.

The models check only what the readers read (other keys pass): they are checks, the readers keep the
mappings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rigctl.errors import ConfigError
from rigctl.inputs import error_line
from rigctl.results.store import StoredRun, read_jsonl

Number = float | None


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=True)  # an empty interval is recorded as NaN


class GateRow(_Open):
    gate: str
    verdict: str
    figures: str = ""
    n: int | None = None
    estimate: Number = None
    low: Number = None
    high: Number = None
    threshold: Number = None
    detail: dict[str, Any] = {}


class Measurement(_Open):
    results: list[GateRow] = []
    bench_runs: list[str] = []
    eval_runs: dict[str, str] = {}


class ServerRow(_Open):
    server: str
    build_info: str | None = None


class Rollout(_Open):
    host: str
    ok: bool
    current: str | None = None
    seconds: Number = None
    error: str | None = None
    servers: list[ServerRow] = []


class Gates(_Open):
    speed_margin: Number = None


class Candidate(_Open):
    plan: str | None = None
    seconds: Number = None
    cmake_flags: list[str] = []


class UpgradeExtra(_Open):
    verdict: str | None = None
    from_: str | None = Field(default=None, alias="from")
    to: str | None = None
    label: str | None = None
    canary: str | None = None
    instance: str | None = None
    scope: list[str] = []
    problems: list[str] = []
    error: str | None = None
    refused_by: str | None = None
    current: Candidate | None = None
    candidate: Candidate | None = None
    gates: Gates | None = None
    measurement: Measurement | None = None
    rollout: list[Rollout] = []
    written: list[str] = []


class BisectExtra(_Open):
    good: str | None = None
    bad: str | None = None
    gate: str | None = None
    first_bad: str | None = None
    last_good: str | None = None
    undecided_between: list[str] = []
    builds: list[str] = []
    resumed: list[Any] = []


class StepRow(_Open):
    """A line of ``steps.jsonl``: :class:`rigctl.upgrade.bisect.Step` as written."""

    version: str
    label: str
    build: str
    plan: str
    build_s: float
    verdict: str
    gate: GateRow
    runs: list[str] = []


def _checked(model: type[BaseModel], data: Any, origin: str) -> None:
    try:
        model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(error_line(exc, origin)) from None


def checked_extra(run: StoredRun) -> dict[str, Any]:
    """The record's ``extra``, checked against its kind's shape; ConfigError naming ``run.json`` and the key."""
    model = UpgradeExtra if run.record.kind == "upgrade" else BisectExtra
    _checked(model, run.record.extra, f"{run.path / 'run.json'}: extra")
    return run.record.extra


def checked_steps(path: Path) -> list[dict[str, Any]]:
    """A bisect's steps file, each line checked; ConfigError naming the file, the line and the key."""
    rows = read_jsonl(path) if path.is_file() else []
    for number, row in enumerate(rows, 1):
        _checked(StepRow, row, f"{path}:{number}")
    return rows
