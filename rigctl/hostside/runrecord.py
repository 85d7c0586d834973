"""The run record (``run.json``): one typed shape for every run kind, with one provenance stamp. Standard
library only: jobs build and seal it on the host (:mod:`rigctl.hostside.jobrun`), the controller imports the
same classes (:mod:`rigctl.results.record` adds reading untrusted records and older versions).

A record is an outcome (id, kind, status, times, commands, raw files, the kind's ``extra``; a failed run's
error in ``extra["error"]``) plus a :class:`Provenance` — what ran, where: the host, its GPU, the llama.cpp
build (the host's fact), the artifacts (sha256 and manifest), every server with the argv *as deployed*
(read from the host, :mod:`rigctl.hostside.stamp`), the task or the matrix, seed, concurrency and rigctl's
version.

A new run kind is one more name in :data:`RUN_KINDS` (run ids, the record's ``kind`` and the pull's checks
follow from it); :func:`rigctl.results.run.open_run` gives it its run directory and seal.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import stat
import tempfile
import types
import typing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

RUN_FILE = "run.json"
ANSWERS_FILE = "answers.jsonl"
RECORD_VERSION = 2
#: Every kind of run rigctl records. Adding one here is all a new kind needs of the record.
RUN_KINDS = ("bench", "eval", "spec", "server-speed", "load", "kld", "upgrade", "bisect")
RunKind = Literal[RUN_KINDS]  # type: ignore[valid-type]
RunStatus = Literal["running", "done", "failed", "stopped", "lost"]
CTX_FLAGS = ("-c", "--ctx-size")
PARALLEL_FLAGS = ("-np", "--parallel")

# The shape new_run_id makes; a run id from anywhere else (a rig's listing, a record) must have it.
RUN_ID = re.compile(rf"^({'|'.join(map(re.escape, RUN_KINDS))})-[0-9]{{8}}T[0-9]{{6}}Z-[0-9a-f]{{4}}$")


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def new_run_id(kind: str) -> str:
    """Sortable by start time, unique without coordination: ``eval-20261130T051200Z-3f9a``."""
    return f"{kind}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(2)}"


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


def write_json_atomically(path: Path, data: Any) -> None:
    """``data`` as indented JSON, written to a temp name beside ``path`` and renamed: a reader sees the old
    file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    # The effective configuration besides argv: the config files llama.cpp said it applied ("using config file"
    # in its journal), the LLAMA_*-style variables of its environment (names; values masked), its chat
    # template's sha256 (/props). rigctl's sandbox leaves the first two empty.
    config_files: list[str] = field(default_factory=list)
    environment: list[str] = field(default_factory=list)
    chat_template_sha256: str | None = None

    @property
    def ctx_size(self) -> int | None:
        """``-c`` as deployed (the whole context, all slots)."""
        value = flag_value(self.argv, CTX_FLAGS)
        return int(value) if value and re.fullmatch(r"[0-9]+", value) else None

    def flag(self, *names: str) -> str | None:
        return flag_value(self.argv, names)

    def effective_differences(self) -> list[str]:
        """How what this server ran differs from its argv as deployed (the profile's flags), one line each:
        a config file it applied, a variable llama.cpp reads in its environment, a context per slot or a
        slot count in ``/props`` that its ``-c``/``-np`` cannot give (per slot: ``-c``, or ``-c`` / slots)."""
        found = [f"applied llama.cpp config file {path}" for path in self.config_files]
        found += [f"llama.cpp variable {name} in its environment" for name in self.environment]
        parallel = self.flag(*PARALLEL_FLAGS)
        slots = int(parallel) if parallel and re.fullmatch(r"[0-9]+", parallel) and int(parallel) > 0 else None
        if slots is not None and self.total_slots is not None and self.total_slots != slots:
            found.append(f"/props total_slots {self.total_slots}, the profile's -np {slots}")
        ctx = self.ctx_size
        if ctx and self.n_ctx is not None and self.n_ctx not in {ctx, ctx // (slots or self.total_slots or 1)}:
            found.append(f"/props n_ctx {self.n_ctx} per slot, the profile's -c {ctx}"
                         + (f" over {slots or self.total_slots} slots" if (slots or self.total_slots or 1) > 1 else ""))
        return found


@dataclass
class Task:
    name: str
    scorer: str | None = None
    file: str | None = None
    file_sha256: str | None = None
    dataset_sha256: dict[str, str] = field(default_factory=dict)
    questions: int | None = None
    request: dict[str, Any] | None = None  # which request produced the numbers (gsm8k: rigctl's or lm-eval's)
    instruments: dict[str, str] = field(default_factory=dict)  # releases whose scoring they reproduce


@dataclass
class Provenance:
    """The stamp every run kind carries. The controller states what the inventory says (host, GPU, server
    names, artifact paths, task, ...) and :func:`rigctl.hostside.stamp.complete` fills in what the host says
    (the argv as deployed, the GPU, the build, the manifests): in a job, in process; for a run the controller
    drives, shipped over SSH (:func:`rigctl.results.stamp.collect_stamp`)."""

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
    #: The commit of the checkout rigctl ran from ("-dirty" after it: with changes); "" for an installed one.
    rigctl_commit: str = ""


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
    rigctl_commit: str = ""
    commands: list[str] = field(default_factory=list)
    files: list[RawFile] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # the kind's own parameters and summary; "error"

    @classmethod
    def begin(cls, kind: RunKind, stamp: Provenance, **outcome: Any) -> typing.Self:
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

    @property
    def provenance(self) -> Provenance:
        """The record's stamp (its provenance fields, shared, not copied)."""
        return Provenance(**{name: getattr(self, name) for name in PROVENANCE_FIELDS})

    def restamp(self, stamp: Provenance) -> None:
        """Take ``stamp``'s provenance (the host's completed stamp arriving after the run began); the
        record's host directory stays."""
        for name in PROVENANCE_FIELDS:
            if name != "host":
                setattr(self, name, getattr(stamp, name))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_plain(cls, data: dict[str, Any]) -> typing.Self:
        """A record from JSON this code wrote (its own run.json, a job's first fields): nested values made
        the record's classes again, nothing checked. Untrusted records go through the controller's reader
        (:meth:`rigctl.results.record.RunRecord.from_dict`)."""
        return from_plain(cls, data)

    def save(self, run_dir: Path) -> Path:
        """Written to a temp name and renamed, so a reader never sees half a record."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / RUN_FILE
        write_json_atomically(path, self.to_dict())
        return path

    def seal(self, run_dir: Path, status: RunStatus = "done", error: str | None = None) -> None:
        """Record every raw file in the run directory with its hash, ``error`` (a failed run's reason),
        the end and ``status``, and save."""
        self.files = raw_files(run_dir)
        if error:
            self.extra["error"] = error
        self.status = status
        self.ended = utc_now()
        self.save(run_dir)


def raw_files(run_dir: Path) -> list[RawFile]:
    """Every regular file of the run but ``run.json`` and hidden ones, with its hash and size, in path order.
    The walk goes from directory fds and opens each file ``O_NOFOLLOW``: a link the run holds (to a file, a
    directory or a device outside it) is neither listed nor read, whoever seals the run (root seals a lost
    job's that an older rigctl ran unsandboxed)."""
    found: list[RawFile] = []
    if not run_dir.is_dir():  # nothing written yet
        return found
    for top, _dirs, names, dir_fd in os.fwalk(run_dir, follow_symlinks=False):
        for name in names:
            if name == RUN_FILE or name.startswith("."):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError:  # a link (ELOOP), or gone since the listing
                continue
            with os.fdopen(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                digest, size = hashlib.sha256(), 0
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
                    size += len(chunk)
            relative = os.path.relpath(os.path.join(top, name), run_dir)
            found.append(RawFile(path=relative, sha256=digest.hexdigest(), bytes=size))
    return sorted(found, key=lambda raw: raw.path.split("/"))


_T = typing.TypeVar("_T")


def from_plain(cls: type[_T], data: dict[str, Any]) -> _T:
    """The dataclass ``cls`` from its :func:`dataclasses.asdict` form (keys it lacks are left out)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: _plain(hints[k], v) for k, v in data.items() if k in names})


def _plain(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        classes = [a for a in args if dataclasses.is_dataclass(a)]
        return _plain(classes[0], value) if classes else value
    if origin is list and args and isinstance(value, list):
        return [_plain(args[0], v) for v in value]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return from_plain(hint, value)
    return value
