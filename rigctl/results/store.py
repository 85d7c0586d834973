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
from rigctl.hostside.runrecord import RUN_ID
from rigctl.inputs import utf8_lines
from rigctl.results.record import RUN_FILE, RunRecord, file_sha256, iter_json_objects

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

    def runs(self, host: str | None = None, kind: str | None = None,
             on_skip: Callable[[Path, ConfigError], None] | None = None) -> Iterator[StoredRun]:
        """Every stored run, oldest first; directories without a readable record are skipped with a warning
        (or handed to ``on_skip``, for a caller that reads the store again and again)."""
        for host_dir in self._host_dirs(host):
            for run_dir in sorted(p for p in host_dir.glob("*") if _real_dir(p)):
                record = _readable(run_dir, on_skip)
                if record is not None and (kind is None or record.kind == kind):
                    yield StoredRun(host=host_dir.name, path=run_dir, record=record)

    def _host_dirs(self, host: str | None) -> list[Path]:
        return [self.root / host] if host else sorted(p for p in self.root.glob("*") if _real_dir(p))

    def last(self, limit: int, host: str | None = None, kind: str | None = None) -> list[StoredRun]:
        """``list(self.runs(host, kind))[-limit:]``, reading only the records it returns (and unreadable ones
        on the way): the directories from the end, a run id naming another kind passed over unread."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        found: list[StoredRun] = []
        for host_dir in reversed(self._host_dirs(host)):
            for run_dir in sorted((p for p in host_dir.glob("*") if _real_dir(p)), reverse=True):
                if len(found) >= limit:
                    return found[::-1]
                if kind is not None and RUN_ID.match(run_dir.name) and not run_dir.name.startswith(f"{kind}-"):
                    continue
                record = _readable(run_dir)
                if record is not None and (kind is None or record.kind == kind):
                    found.append(StoredRun(host=host_dir.name, path=run_dir, record=record))
        return found[::-1]

    def find(self, ref: str) -> StoredRun:
        """A run by id, by ``host/id`` or by path to its directory."""
        path = Path(ref)
        if (path / RUN_FILE).is_file():
            record = RunRecord.load(path)
            return StoredRun(host=record.host, path=path, record=record)
        if path.is_dir():  # a host's directory or the store itself: read as a host/id it would list every sibling
            raise ConfigError(f"{ref}: not a run (a directory without {RUN_FILE})")
        host, _, run_id = ref.rpartition("/")
        if "/" in host:
            raise ConfigError(f"run {ref!r}: not found under {self.root} (a run is ID, HOST/ID or its directory)")
        # A run lives in the directory named by its id: look there first, loading one record per host rather
        # than every record of the store; only a directory not named by its record's id needs the scan.
        matches = self._named(host, run_id) or [run for run in self.runs(host or None) if run.id == run_id]
        if not matches:
            raise ConfigError(f"run {ref!r}: not found under {self.root}")
        if len(matches) > 1:
            where = ", ".join(f"{m.host}/{m.id}" for m in matches)
            raise ConfigError(f"run {ref!r} is ambiguous: {where}")
        return matches[0]

    def _named(self, host: str, run_id: str) -> list[StoredRun]:
        """The runs in ``<host>/<run_id>`` (every host's when ``host`` is empty) whose record has that id."""
        found = []
        for name in [host] if host else [p.name for p in self._host_dirs(None)]:
            try:
                run_dir = self.run_dir(name, run_id)
            except TrustError:
                return []
            record = _readable(run_dir) if _real_dir(run_dir) and (run_dir / RUN_FILE).is_file() else None
            if record is not None and record.id == run_id:
                found.append(StoredRun(host=name, path=run_dir, record=record))
        return found

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


def _real_dir(path: Path) -> bool:
    """A directory of the store itself: a link in it (to another tree, another run) is neither listed nor read;
    its run.json is then opened without following a link (:meth:`RunRecord.load`)."""
    return path.is_dir() and not path.is_symlink()


def _readable(run_dir: Path, on_skip: Callable[[Path, ConfigError], None] | None = None) -> RunRecord | None:
    """The run's record; None when it cannot be read (one bad run never hides the others), with a warning or
    handed to ``on_skip``."""
    try:
        return RunRecord.load(run_dir)
    except ConfigError as exc:
        if on_skip is None:
            log.warning("skipping %s: %s", run_dir, exc)
        else:
            on_skip(run_dir, exc)
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Objects of a JSONL file (:func:`iter_jsonl`, all at once)."""
    return list(iter_jsonl(path))


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Objects of a JSONL file, read line by line (a run's answers cost one line of memory, however many there
    are); a torn last line (a run stopped mid-write) is ignored, any other bad line (not UTF-8, not JSON, not
    an object) is a ConfigError naming the file and line."""
    return iter_json_objects(utf8_lines(path), path, torn_tail=True)


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
