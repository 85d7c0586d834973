"""The run record (``run.json``): one typed shape for every run kind, with one provenance stamp.

A record is an outcome (id, kind, status, times, commands, raw files, the kind's ``extra``) plus a
:class:`Provenance` — what ran, where: the host, its GPU, the llama.cpp build (the host's fact), the
artifacts (sha256 and manifest), every server with the argv *as deployed* (read from the host, see
:mod:`rigctl.hostside.stamp`), the task or the matrix, seed, concurrency and rigctl's version.

Records carry ``version`` (:data:`RECORD_VERSION`). Records written before it (version 1: no ``version``
key, ``server`` a dict of one of four shapes, ``gpu``/``llama_cpp``/``task`` free dicts) still load:
:func:`upgrade` maps them onto this shape, and keeps what has no place here under ``extra["v1"]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from rigctl.errors import ConfigError
from rigctl.files import write_atomically

RUN_FILE = "run.json"
ANSWERS_FILE = "answers.jsonl"
RECORD_VERSION = 2
RunKind = Literal["bench", "eval", "spec", "server-speed", "load", "upgrade", "bisect"]
RunStatus = Literal["running", "done", "failed", "stopped", "lost"]
CTX_FLAGS = ("-c", "--ctx-size")
_CHUNK = 1 << 20
#: Deepest nesting read from a record, a JSONL row or a host's answer: records nest a few levels, and what
#: walks them afterwards (pydantic, dataclasses.asdict, json.dumps, rich) recurses once or more per level.
JSON_DEPTH = 64
#: How deep a document whose parts are checked one by one may nest (a run listing holds its records two
#: levels down): far below where json.loads would recurse out of a thread's stack.
DEFERRED_DEPTH = 8 * JSON_DEPTH
#: Integers in them fit 64 bits (sizes, pids, seeds, counts): a longer one is no measurement, and float()
#: or arithmetic on it fails far from where it was read.
_INT_LOW, _INT_HIGH = -(2**63), 2**64 - 1


def rigctl_version() -> str:
    """This rigctl's version, as its records carry it ("" when not installed as a package)."""
    from importlib import metadata

    try:
        return metadata.version("rigctl")
    except metadata.PackageNotFoundError:
        return ""


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_run_id(kind: str) -> str:
    """Sortable by start time, unique without coordination: ``eval-20261130T051200Z-3f9a``."""
    return f"{kind}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(2)}"


# The shape new_run_id makes; a run id from anywhere else (a rig's listing, a record) must have it.
RUN_ID = re.compile(r"^(bench|eval|spec|server-speed|load)-[0-9]{8}T[0-9]{6}Z-[0-9a-f]{4}$")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last of ``names`` in ``argv`` (``-c 4096`` or ``--ctx-size=4096``), as llama.cpp's
    parser takes it."""
    value = None
    for i, arg in enumerate(argv):
        name, eq, rest = arg.partition("=")
        if arg in names and i + 1 < len(argv):
            value = argv[i + 1]
        elif eq and name in names:
            value = rest
    return value


def parse_json(text: str, origin: str, *, deferred: bool = False) -> Any:
    """``text`` as JSON nested at most :data:`JSON_DEPTH` levels, its integers 64-bit: json.JSONDecodeError
    when it is not JSON at all (callers say that in their own words), ConfigError naming ``origin`` when it
    is past a bound. The nesting is measured on the text before it is parsed, so the parser never recurses
    past it: no RecursionError is left for a thread to survive (in this repository's tests, on CPython
    3.11.7, one raised while a fan-out read hosts at once came with a SystemError from ast.parse in another
    host's thread).

    ``deferred``: for a document whose parts are each held to the bounds later (:func:`check_json`; a host's
    run listing, whose records :meth:`RunRecord.from_dict` checks, so one bad record is that run's refusal
    and not the host's): it may nest :data:`DEFERRED_DEPTH` levels, and an integer past 64 bits is kept as
    a :class:`WideInteger` for the check to refuse."""
    limit = DEFERRED_DEPTH if deferred else JSON_DEPTH
    if _nests_deeper(text, limit):
        raise ConfigError(f"{origin}: JSON nested deeper than {limit} levels")
    try:
        return json.loads(text, parse_int=_wide_kept if deferred else _int64)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # _int64's
        raise ConfigError(f"{origin}: {exc}") from None


#: A JSON string (escapes included), and what nests.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def _nests_deeper(text: str, limit: int) -> bool:
    """Whether ``text``'s arrays and objects nest deeper than ``limit``, strings skipped. After an
    unterminated string (a torn line) nothing is counted: json.loads refuses it there anyway."""
    if text.count("[") + text.count("{") <= limit:  # the common case, at C speed
        return False
    outside = _JSON_STRING.sub("", text)
    torn = outside.find('"')
    depth = 0
    for bracket in _JSON_BRACKET.findall(outside if torn < 0 else outside[:torn]):
        depth += 1 if bracket in "[{" else -1
        if depth > limit:
            return True
    return False


class WideInteger(str):
    """An integer literal past 64 bits in a deferred document: its text, for :func:`check_json` to refuse."""

    def refusal(self) -> str:
        if len(self.lstrip("-")) > 20:
            return f"an integer of {len(self.lstrip('-'))} digits (at most 64 bits are read)"
        return f"an integer of {int(self).bit_length()} bits (at most 64 are read)"


def _int64(digits: str) -> int:
    """A JSON integer literal, refused past 64 bits before Python converts it (a 5,001-digit one would
    exceed Python's own digit limit; a 30-digit one breaks float() far from here)."""
    value = _wide_kept(digits)
    if isinstance(value, WideInteger):
        raise ValueError(value.refusal())
    return value


def _wide_kept(digits: str) -> int | WideInteger:
    """A JSON integer literal as an int, or as a WideInteger past 64 bits (never converted when longer
    than any 64-bit integer)."""
    if len(digits.lstrip("-")) > 20:
        return WideInteger(digits)
    value = int(digits)
    return value if _INT_LOW <= value <= _INT_HIGH else WideInteger(digits)


def check_json(value: Any, origin: str) -> None:
    """ConfigError naming ``origin`` when ``value`` (as json.loads makes it) nests deeper than
    :data:`JSON_DEPTH` or holds an integer past 64 bits. Iterative: the check itself never recurses."""
    stack: list[tuple[Any, int]] = [([value], 0)]
    while stack:
        item, depth = stack.pop()
        if depth > JSON_DEPTH:
            raise ConfigError(f"{origin}: JSON nested deeper than {JSON_DEPTH} levels")
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
            elif isinstance(child, WideInteger):
                raise ConfigError(f"{origin}: {child.refusal()}")
            elif type(child) is int and not _INT_LOW <= child <= _INT_HIGH:
                raise ConfigError(f"{origin}: an integer of {child.bit_length()} bits (at most 64 are read)")


@dataclass
class RawFile:
    path: str  # relative to the run directory
    sha256: str
    bytes: int


@dataclass
class Gpu:
    name: str | None = None
    driver: str | None = None
    vram_mib: int | None = None
    compute_capability: str | None = None
    bandwidth_gbs: float | None = None  # the inventory's figure, for bandwidth bounds


@dataclass
class LlamaCppBuild:
    """The build ``current`` points to, as the llama_cpp role's fact says."""

    name: str = ""
    dir: str = ""
    commit: str = ""
    version: str = ""
    build_key: str = ""
    build_number: int = 0
    cuda: bool = False
    binaries: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.commit or self.version


@dataclass
class Artifact:
    name: str
    path: str | None = None
    sha256: str | None = None
    sha256_from: str | None = None  # "manifest", "hashed now", "cache (...)"
    bytes: int | None = None
    manifest: dict[str, Any] | None = None
    gguf: dict[str, Any] | None = None  # architecture and attention shape (bench)


@dataclass
class Server:
    """One llama-server a run talked to (or, for a bench, found running): inventory names, what its
    ``/props`` said, and its argv as deployed."""

    name: str | None = None  # the llama_server instance; None for a bare URL
    host: str | None = None
    unit: str | None = None  # llama-server@<name>.service, or the probe's transient unit
    argv: list[str] = field(default_factory=list)  # as deployed; secrets masked
    argv_from: str | None = None  # /proc/<pid>/cmdline it was read from; None: not read
    pid: int | None = None
    profile: str | None = None
    artifact: str | None = None
    port: int | None = None
    endpoint: str | None = None
    label: str | None = None
    build_info: str | None = None
    model_path: str | None = None
    n_ctx: int | None = None  # per slot, as /props says
    total_slots: int | None = None
    draft: dict[str, Any] | None = None  # the profile's spec block (drafting races)
    gpu: Gpu | None = None  # a fan-out's member on another host

    @property
    def ctx_size(self) -> int | None:
        """``-c`` as deployed (the whole context, all slots)."""
        value = flag_value(self.argv, CTX_FLAGS)
        return int(value) if value and value.isdigit() else None

    def flag(self, *names: str) -> str | None:
        return flag_value(self.argv, names)


@dataclass
class Task:
    name: str
    scorer: str | None = None
    file: str | None = None
    file_sha256: str | None = None
    dataset_sha256: dict[str, str] = field(default_factory=dict)
    questions: int | None = None


@dataclass
class Provenance:
    """The stamp every run kind carries: collected by :func:`rigctl.results.stamp.collect_stamp` (runs
    the controller drives) or by the job runtime on the host (:mod:`rigctl.hostside.jobrun`)."""

    host: str
    gpu: Gpu = field(default_factory=Gpu)
    llama_cpp: LlamaCppBuild = field(default_factory=LlamaCppBuild)
    artifacts: list[Artifact] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)
    task: Task | None = None
    matrix: dict[str, Any] | None = None  # bench parameters
    seed: int | None = None
    concurrency: int | None = None
    rigctl_version: str = ""


PROVENANCE_FIELDS = tuple(f.name for f in dataclasses.fields(Provenance))


@dataclass
class RunRecord:
    """Provenance of one run and its outcome: enough to tell whether two runs may be compared, and to redo one."""

    id: str
    kind: RunKind
    host: str
    started: str
    version: int = RECORD_VERSION
    ended: str | None = None
    status: RunStatus = "running"
    gpu: Gpu = field(default_factory=Gpu)
    llama_cpp: LlamaCppBuild = field(default_factory=LlamaCppBuild)
    artifacts: list[Artifact] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)
    task: Task | None = None
    matrix: dict[str, Any] | None = None
    seed: int | None = None
    concurrency: int | None = None
    rigctl_version: str = ""
    commands: list[str] = field(default_factory=list)
    files: list[RawFile] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # the kind's own parameters and summary

    @classmethod
    def begin(cls, kind: RunKind, stamp: Provenance, **outcome: Any) -> RunRecord:
        """A new record (status running) of ``kind`` with ``stamp``'s provenance; ``outcome``: the other
        fields (``host``: the results tree's host directory, when it is not the stamp's)."""
        fields = {name: getattr(stamp, name) for name in PROVENANCE_FIELDS}
        fields.update(outcome)
        fields.setdefault("id", new_run_id(kind))
        return cls(kind=kind, started=utc_now(), **fields)

    @property
    def server(self) -> Server | None:
        """The run's server (a fan-out's first, a race's baseline); None when it talked to none."""
        return self.servers[0] if self.servers else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, origin: str = "run record") -> RunRecord:
        """``data`` (any version) checked against the record's types (ConfigError naming ``origin`` and the key)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{origin}: a run record is a JSON object, not {type(data).__name__}")
        check_json(data, origin)  # a record from a host's listing is bounded as one read from a file
        data = upgrade(data, origin)
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
            data = parse_json(path.read_text(encoding="utf-8"), str(path))
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


# ----------------------------------------------------------------------------------------------- old records


def _known(cls: type, data: Any, left: dict[str, Any], where: str) -> dict[str, Any]:
    """The keys of ``data`` that ``cls`` has; the others go to ``left[where]``."""
    if not isinstance(data, dict):
        return data
    names = {f.name for f in dataclasses.fields(cls)}
    rest = {k: v for k, v in data.items() if k not in names}
    if rest:
        left[where] = rest
    return {k: v for k, v in data.items() if k in names}


def _v1_server(entry: Any, left: dict[str, Any], where: str) -> Any:
    if not isinstance(entry, dict):
        return entry
    entry = dict(entry)
    if "args" in entry:  # load runs kept their probe's argv (the one place v1 had an argv)
        entry["argv"] = entry.pop("args")
        entry["argv_from"] = "probe arguments (v1 record)"
    if "url" in entry:
        entry.setdefault("endpoint", entry.pop("url"))
    if "probe_port" in entry:
        entry["port"] = entry.pop("probe_port")
    if "spec" in entry:  # a race's contender
        entry["draft"] = entry.pop("spec")
    if isinstance(entry.get("gpu"), dict):
        entry["gpu"] = _known(Gpu, entry["gpu"], left, f"{where}.gpu")
    return _known(Server, entry, left, where)


def upgrade(data: dict[str, Any], origin: str = "run record") -> dict[str, Any]:
    """A record of any version as a dict of this version's shape (version 1: before ``version``)."""
    version = data.get("version", 1)
    if version == RECORD_VERSION:
        return data
    if version != 1:
        raise ConfigError(f"{origin}: record version {version!r} is not one this rigctl reads "
                          f"(1..{RECORD_VERSION})")
    out = {k: v for k, v in data.items() if k != "server"}
    out["version"] = RECORD_VERSION
    if not isinstance(data.get("extra") or {}, dict):
        raise ConfigError(f"{origin}: extra: a {type(data['extra']).__name__}, not a JSON object")
    extra = out["extra"] = dict(data.get("extra") or {})
    left: dict[str, Any] = {}
    for key, cls in (("gpu", Gpu), ("llama_cpp", LlamaCppBuild)):
        if data.get(key) is None:
            out.pop(key, None)
        else:
            out[key] = _known(cls, data[key], left, key)
    if isinstance(data.get("task"), dict):
        out["task"] = _known(Task, data["task"], left, "task")
    if isinstance(data.get("artifacts"), list):
        out["artifacts"] = [_known(Artifact, a, left, f"artifacts.{i}") for i, a in enumerate(data["artifacts"])]
    server = data.get("server")
    if isinstance(server, dict):
        server = dict(server)
        if "contenders" in server:  # spec: the baseline and its drafters
            extra.setdefault("baseline", server.pop("baseline", None))
            entries = server.pop("contenders") or []
        elif "fanout" in server:  # eval over several servers: each member, the first also at the top
            entries = server.pop("fanout") or []
        else:
            for key in ("slots", "slot_ctx"):  # load: the probe's shape, a parameter of the run
                if key in server:
                    extra.setdefault(key, server.pop(key))
            entries, server = [server], {}
        if not isinstance(entries, list):
            raise ConfigError(f"{origin}: server: its members are a {type(entries).__name__}, not a list")
        out["servers"] = [_v1_server(e, left, f"server.{i}") for i, e in enumerate(entries)]
        if server:
            left["server"] = server
    elif server is not None:
        out["servers"] = server  # not a mapping: the validator names it
    if left:
        extra["v1"] = left
    return out
