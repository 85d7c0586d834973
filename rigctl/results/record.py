"""The run record (``run.json``) as the controller reads it: one typed shape for every run kind, with one
provenance stamp.

The shape is :mod:`rigctl.hostside.runrecord`'s (standard library only, so jobs build the same classes on
the host); this module re-exports it and adds what only the controller does: reading records from files and
hosts as untrusted input (:meth:`RunRecord.from_dict`: bounded JSON, every type checked) and reading older
records.

Records carry ``version`` (:data:`RECORD_VERSION`). Records written before it (version 1: no ``version``
key, ``server`` a dict of one of four shapes, ``gpu``/``llama_cpp``/``task`` free dicts) still load:
:func:`upgrade` maps them onto this shape, and keeps what has no place here under ``extra["v1"]``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rigctl.errors import ConfigError, RigctlError
from rigctl.hostside import runrecord
from rigctl.hostside.jobfiles import READ_LIMIT as RECORD_LIMIT
from rigctl.hostside.model_files import file_sha256
from rigctl.hostside.runrecord import (
    ANSWERS_FILE,
    CTX_FLAGS,
    PROVENANCE_FIELDS,
    RECORD_VERSION,
    RUN_FILE,
    RUN_ID,
    RUN_KINDS,
    Artifact,
    Gpu,
    LlamaCppBuild,
    Provenance,
    RawFile,
    RunKind,
    RunStatus,
    Server,
    Task,
    flag_value,
    new_run_id,
    utc_now,
)
from rigctl.inputs import error_line

log = logging.getLogger(__name__)

__all__ = ["ANSWERS_FILE", "CTX_FLAGS", "DEFERRED_DEPTH", "JSON_DEPTH", "PROVENANCE_FIELDS", "RECORD_VERSION",
           "RUN_FILE", "RUN_ID", "RUN_KINDS", "Artifact", "Gpu", "LlamaCppBuild", "Provenance", "RawFile",
           "RunKind", "RunRecord", "RunStatus", "Server", "Task", "check_json", "file_sha256", "flag_value",
           "new_run_id", "json_objects", "parse_json", "upgrade", "utc_now"]

#: Deepest nesting read from a record, a JSONL row or a host's answer: records nest a few levels, and what
#: walks them afterwards (pydantic, dataclasses.asdict, json.dumps, rich) recurses once or more per level.
JSON_DEPTH = 64
#: How deep a document whose parts are checked one by one may nest (a run listing holds its records two
#: levels down): far below where json.loads would recurse out of a thread's stack.
DEFERRED_DEPTH = 8 * JSON_DEPTH
#: Integers in them fit 64 bits (sizes, pids, seeds, counts): a longer one is no measurement, and float()
#: or arithmetic on it fails far from where it was read.
_INT_LOW, _INT_HIGH = -(2**63), 2**64 - 1


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
    if _LONG_DIGIT_RUN not in text.translate(_DIGITS_AS_NINES):
        # No integer literal can be past 64 bits: the C parser's own integers (a Python call per integer costs
        # a store's worth of records seconds).
        return json.loads(text)
    try:
        return json.loads(text, parse_int=_wide_kept if deferred else _int64)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # _int64's
        raise ConfigError(f"{origin}: {exc}") from None


def json_objects(lines: Sequence[str], origin: str | Path, *, error: type[RigctlError] = ConfigError,
                 torn_tail: bool = False) -> list[dict[str, Any]]:
    """JSON lines as objects (:func:`iter_json_objects`, all at once)."""
    return list(iter_json_objects(lines, origin, error=error, torn_tail=torn_tail))


def iter_json_objects(lines: Iterable[str], origin: str | Path, *, error: type[RigctlError] = ConfigError,
                      torn_tail: bool = False) -> Iterator[dict[str, Any]]:
    """JSON lines as objects, one at a time, each held to :func:`parse_json`'s bounds; blank lines are skipped.
    A bad line is ``error`` naming ``origin`` and the line, except a last line that is not JSON when
    ``torn_tail`` (a run stopped mid-write leaves one): it is left out with a warning. One line is read ahead,
    to know the last one."""
    numbered = enumerate(lines, 1)
    ahead = next(numbered, None)
    while ahead is not None:
        number, line = ahead
        ahead = next(numbered, None)
        if not line.strip():
            continue
        try:
            row = parse_json(line, f"{origin}:{number}")
        except json.JSONDecodeError as exc:
            if torn_tail and ahead is None:
                log.warning("%s: ignoring a torn last line", origin)
                return
            raise error(f"{origin}:{number}: not a JSON line ({exc.msg})") from None
        if not isinstance(row, dict):
            raise error(f"{origin}:{number}: a {type(row).__name__}, not a JSON object")
        yield row


#: What any integer literal past 64 bits contains: 19 digits in a row (shorter ones all fit; a run in a string
#: or a fraction only sends the text the slower way). Found by translating every digit to 9 and looking for a
#: run of nines, at C speed (a regular expression takes longer than the parse).
_DIGITS_AS_NINES = str.maketrans("012345678", "999999999")
_LONG_DIGIT_RUN = "9" * 19
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


class RunRecord(runrecord.RunRecord):
    """:class:`rigctl.hostside.runrecord.RunRecord`, read as the controller reads it: from files and hosts,
    checked, of any version."""

    @classmethod
    def from_dict(cls, data: Any, origin: str = "run record", *, bounded: bool = False) -> RunRecord:
        """``data`` (any version) checked against the record's types (ConfigError naming ``origin`` and the key).
        ``bounded``: ``data`` came from :func:`parse_json` (not deferred), which held it to the bounds already."""
        if not isinstance(data, dict):
            raise ConfigError(f"{origin}: a run record is a JSON object, not {type(data).__name__}")
        if not bounded:
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
            raise ConfigError(error_line(exc, origin)) from None

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        path = run_dir / RUN_FILE
        try:
            raw = _read_record(path)
        except FileNotFoundError:
            raise ConfigError(f"{run_dir}: no {RUN_FILE} (not a run directory)") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
        return cls.parse(raw, path)

    @classmethod
    def parse(cls, raw: bytes, path: Path) -> RunRecord:
        """The record in ``raw``, the bytes of ``path`` (a ``run.json`` read by the caller)."""
        try:
            data = parse_json(raw.decode("utf-8"), str(path))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data, str(path), bounded=True)


def _read_record(path: Path) -> bytes:
    """``run.json``'s bytes, checked on the open file rather than by path: not through a link (``O_NOFOLLOW``),
    a regular file (a FIFO would block, a device never end), at most :data:`RECORD_LIMIT` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path}: not a regular file")
        data = handle.read(RECORD_LIMIT + 1)
    if len(data) > RECORD_LIMIT:
        raise ConfigError(f"{path}: larger than {RECORD_LIMIT} bytes")
    return data


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
