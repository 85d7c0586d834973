"""Run records and the results store.

Every bench and eval run writes one directory, on the host while a job runs and on the controller
after a pull, with the same layout::

    <results root>/<host>/<run id>/run.json      the run record (RunRecord below)
    <results root>/<host>/<run id>/<raw files>   llama-bench JSON, per-question JSONL, ...

``run.json`` lists every raw file with its sha256, so a pull can check what it copied and a
report can link every number to the file it came from. Eval runs write one JSON line per
question to ``answers.jsonl`` (see ``ANSWERS_FILE``) with at least the keys ``id``, ``set``,
``score`` (0/1 or a float) and ``cutoff``; scorers add their own keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from rigctl.errors import ConfigError
from rigctl.files import write_atomically

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
ANSWERS_FILE = "answers.jsonl"
RunKind = Literal["bench", "eval", "spec", "server-speed", "load"]
RunStatus = Literal["running", "done", "failed", "stopped", "lost"]
_CHUNK = 1 << 20


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_run_id(kind: str) -> str:
    """Sortable by start time, unique without coordination: ``eval-20261130T051200Z-3f9a``."""
    return f"{kind}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(2)}"


# The shape new_run_id makes; a run id from anywhere else (a rig's listing, a record) must have it.
RUN_ID = re.compile(r"^(bench|eval|spec|server-speed)-[0-9]{8}T[0-9]{6}Z-[0-9a-f]{4}$")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class RawFile:
    path: str  # relative to the run directory
    sha256: str
    bytes: int


@dataclass
class RunRecord:
    """Provenance of one run: enough to tell whether two runs may be compared, and to redo one."""

    id: str
    kind: RunKind
    host: str
    started: str
    ended: str | None = None
    status: RunStatus = "running"
    gpu: dict[str, Any] = field(default_factory=dict)  # name, driver, vram_mib, compute_capability
    llama_cpp: dict[str, Any] = field(default_factory=dict)  # commit, version, build_key (fact file)
    server: dict[str, Any] | None = None  # name, profile, endpoint, flags as run, build_info
    artifacts: list[dict[str, Any]] = field(default_factory=list)  # name, path, sha256, manifest
    task: dict[str, Any] | None = None  # name, file_sha256, dataset_sha256
    matrix: dict[str, Any] | None = None  # bench parameters
    seed: int | None = None
    concurrency: int | None = None
    commands: list[str] = field(default_factory=list)
    rigctl_version: str = ""
    files: list[RawFile] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, origin: str = "run record") -> RunRecord:
        """``data`` checked against the record's types (ConfigError naming ``origin`` and the key)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{origin}: a run record is a JSON object, not {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in set(data) - known)
        if unknown:
            raise ConfigError(f"{origin}: unknown keys: {', '.join(unknown)}")
        from pydantic import ValidationError

        try:
            return _record_adapter().validate_python(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ".".join(str(p) for p in err["loc"]) or "-"
            raise ConfigError(f"{origin}: {key}: {err['msg']}") from None

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        path = run_dir / RUN_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{run_dir}: no {RUN_FILE} (not a run directory)") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data, str(path))

    def save(self, run_dir: Path) -> Path:
        """Written to a temp name and renamed, so a reader never sees half a record."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / RUN_FILE
        write_atomically(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    def seal(self, run_dir: Path, status: RunStatus = "done") -> None:
        """Record every raw file in the run directory with its hash, mark the end and save."""
        self.files = [
            RawFile(path=str(p.relative_to(run_dir)), sha256=file_sha256(p), bytes=p.stat().st_size)
            for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != RUN_FILE and not p.name.startswith(".")
        ]
        self.status = status
        self.ended = utc_now()
        self.save(run_dir)


_RECORD_ADAPTER: Any = None


def _record_adapter() -> Any:
    global _RECORD_ADAPTER
    if _RECORD_ADAPTER is None:
        from pydantic import TypeAdapter

        _RECORD_ADAPTER = TypeAdapter(RunRecord)
    return _RECORD_ADAPTER


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
    rows: list[dict[str, Any]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                log.warning("%s: ignoring a torn last line", path)
                break
            raise ConfigError(f"{path}:{number}: not a JSON line") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{number}: a {type(row).__name__}, not a JSON object")
        rows.append(row)
    return rows
