"""The controller's results store: ``<root>/<host>/<run id>/`` per run, a tolerant loader over it.

A directory whose record cannot be read is skipped with a warning (one bad run never hides the others);
records of every version load (:func:`rigctl.results.record.upgrade`). Host and run id are single path
names: nothing a record or a rig says can place a run outside the root.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rigctl.errors import ConfigError, TrustError
from rigctl.results.record import RUN_FILE, RunRecord, file_sha256, json_objects

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredRun:
    host: str
    path: Path
    record: RunRecord

    @property
    def id(self) -> str:
        return self.record.id


def default_results_root() -> Path:
    return Path(os.environ.get("RIGCTL_RESULTS") or "results")


class ResultsStore:
    """The controller's results tree: ``<root>/<host>/<run id>/``."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or default_results_root()).expanduser()

    def run_dir(self, host: str, run_id: str) -> Path:
        """``<root>/<host>/<run id>``; TrustError when either is not one plain path name."""
        for what, name in (("host", host), ("run id", run_id)):
            if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
                    or "\0" in name:
                raise TrustError(f"{what} {name!r}: not a plain name, refused as a results path")
        return self.root / host / run_id

    def runs(self, host: str | None = None, kind: str | None = None) -> Iterator[StoredRun]:
        """Every stored run, oldest first; directories without a readable record are skipped with a warning."""
        hosts = [self.root / host] if host else sorted(p for p in self.root.glob("*") if p.is_dir())
        for host_dir in hosts:
            for run_dir in sorted(p for p in host_dir.glob("*") if p.is_dir()):
                try:
                    record = RunRecord.load(run_dir)
                except ConfigError as exc:
                    log.warning("skipping %s: %s", run_dir, exc)
                    continue
                if kind is None or record.kind == kind:
                    yield StoredRun(host=host_dir.name, path=run_dir, record=record)

    def find(self, ref: str) -> StoredRun:
        """A run by id, by ``host/id`` or by path to its directory."""
        path = Path(ref)
        if (path / RUN_FILE).is_file():
            record = RunRecord.load(path)
            return StoredRun(host=record.host, path=path, record=record)
        host, _, run_id = ref.rpartition("/")
        matches = [run for run in self.runs(host or None) if run.id == run_id]
        if not matches:
            raise ConfigError(f"run {ref!r}: not found under {self.root}")
        if len(matches) > 1:
            where = ", ".join(f"{m.host}/{m.id}" for m in matches)
            raise ConfigError(f"run {ref!r} is ambiguous: {where}")
        return matches[0]

    def verify(self, run: StoredRun) -> list[str]:
        """Raw files missing or differing from the record's hashes (empty when all is well)."""
        problems = []
        for raw in run.record.files:
            path = run.path / raw.path
            if not path.is_file():
                problems.append(f"{run.host}/{run.id}: {raw.path} is missing")
            elif file_sha256(path) != raw.sha256:
                problems.append(f"{run.host}/{run.id}: {raw.path} does not match its sha256")
        return problems


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Objects of a JSONL file; a torn last line (a run stopped mid-write) is ignored, any other bad line
    (not JSON, not an object) is a ConfigError naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return json_objects(lines, path, torn_tail=True)


def run_file(run: StoredRun, kind: str, name: str) -> Path:
    """The raw file ``name`` of ``run``, which must be a ``kind`` run that has it (ConfigError naming the run)."""
    if run.record.kind != kind:
        raise ConfigError(f"{run.host}/{run.id}: a {run.record.kind} run, not a {kind} run")
    path = run.path / name
    if not path.is_file():
        raise ConfigError(f"{run.host}/{run.id}: no {name}")
    return path


_Row = TypeVar("_Row")


def read_rows(run: StoredRun, kind: str, name: str, row: Callable[..., _Row]) -> list[_Row]:
    """The JSON lines of ``run``'s raw file ``name`` (:func:`run_file`) as ``row(**line)`` each; a line that
    does not fit is a ConfigError naming the file."""
    path = run_file(run, kind, name)
    try:
        return [row(**line) for line in read_jsonl(path)]
    except TypeError as exc:
        raise ConfigError(f"{path}: not a {kind} run's {name}: {exc}") from None
