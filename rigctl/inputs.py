"""Reading input files at the boundary: text that must be UTF-8, and user files that must be a YAML (or JSON,
which YAML reads too) mapping, whose errors name file, line and column; and the one-line wording of what
pydantic found wrong in one (:func:`error_line`).

Each helper returns or raises with a message that names the file (and line), so every loader (task files,
campaigns, bench specs, prompt sets) reports a bad file the same way: one line, never a bare
UnicodeDecodeError or a multi-line YAML complaint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from rigctl.errors import ConfigError, RigctlError

if TYPE_CHECKING:
    from pydantic import ValidationError


def decode_utf8(raw: bytes, origin: str | Path, error: type[RigctlError] = ConfigError) -> str:
    """``raw`` as UTF-8 text; ``error`` naming the file, line and byte where it is not."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise error(f"{origin}:{line}: not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from None


def read_text(path: Path, what: str = "", error: type[RigctlError] = ConfigError) -> str:
    """The file's UTF-8 text; ``error`` naming it (prefixed ``what``) when it cannot be read or decoded."""
    label = f"{what} {path}" if what else str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"{label}: {exc.strerror or exc}") from None
    return decode_utf8(raw, label, error)


def utf8_lines(path: Path, what: str = "", error: type[RigctlError] = ConfigError) -> Iterator[str]:
    """The file's lines one at a time, each checked as UTF-8 (``error`` naming the file, line and byte where one
    is not, or that it cannot be read): a file of any length costs one line of memory. Lines end at ``\\n``
    only, as JSON Lines do: a U+2028 that a JSON string holds unescaped stays inside its line, where
    :meth:`str.splitlines` would cut it in two."""
    label = f"{what} {path}" if what else str(path)
    try:
        with path.open("rb") as handle:
            yield from utf8_handle_lines(handle, label, error)
    except OSError as exc:
        raise error(f"{label}: cannot read: {exc.strerror or exc}") from None


def utf8_handle_lines(handle: Iterable[bytes], label: str, error: type[RigctlError] = ConfigError) -> Iterator[str]:
    """:func:`utf8_lines` of a file the caller opened (``label`` names it in errors)."""
    offset = 0
    for number, raw in enumerate(handle, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{label}:{number}: not UTF-8 text (byte {offset + exc.start}: "
                        f"{raw[exc.start:exc.start + 1]!r})") from None
        offset += len(raw)
        yield line


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error as ``line L, column C: what is wrong`` (one line)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        if mark is not None:
            return f"line {mark.line + 1}, column {mark.column + 1}: {what}"
        return what
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def parse_yaml(text: str, origin: str | Path, error: type[RigctlError] = ConfigError) -> Any:
    """``text``, a user file's YAML, as Python; ``error`` naming ``origin`` (with line and column) when it is not
    YAML, or holds what Python cannot hold (an integer of more than 4,300 digits, nesting past the stack)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{origin}: not YAML: {yaml_problem(exc)}") from None
    except ValueError as exc:  # PyYAML's int() of a too long integer: "Exceeds the limit (4300 digits) ..."
        raise error(f"{origin}: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise error(f"{origin}: nested too deeply to read") from None


def parse_mapping(text: str, origin: str | Path, *, expected: str = "expected a mapping at the top",
                  empty: bool = False, error: type[RigctlError] = ConfigError) -> dict[Any, Any]:
    """``text``, a user file's YAML, as the mapping it must be (:func:`parse_yaml`), saying ``expected`` when it
    is YAML but no mapping. ``empty``: an empty file (or one of comments only) reads as ``{}``."""
    data = parse_yaml(text, origin, error)
    if data is None and empty:
        return {}
    if not isinstance(data, dict):
        raise error(f"{origin}: {expected}")
    return data


def read_mapping(path: Path, what: str, *, expected: str = "expected a mapping at the top", empty: bool = False,
                 error: type[RigctlError] = ConfigError) -> dict[Any, Any]:
    """The file at ``path`` as :func:`parse_mapping` reads it, named ``what`` (``campaign``, ``bench spec``) in
    every message."""
    return parse_mapping(read_text(path, what, error), f"{what} {path}", expected=expected, empty=empty, error=error)


def error_message(err: Mapping[str, Any]) -> str:
    """One pydantic error's message as rigctl words it: ``unknown key`` for a key the schema lacks, ``required
    but not set`` for one it needs, a validator's own text without pydantic's ``Value error,`` prefix."""
    if err["type"] == "extra_forbidden":
        return "unknown key"
    if err["type"] == "missing":
        return "required but not set"
    return str(err["msg"]).removeprefix("Value error, ")


def dotted(loc: Iterable[Any]) -> str:
    """A pydantic error's location as a key path: ``matrix.p.0``."""
    return ".".join(str(part) for part in loc)


def error_lines(exc: ValidationError, origin: str | Path, *, whole: str | None = "-",
                path: Callable[[Sequence[Any]], str] = dotted) -> list[str]:
    """Each error of ``exc`` as one line ``origin: key.path: message`` (:func:`error_message`); ``path`` makes
    the key path of a location, ``whole`` names an error of the whole value (a model's own check, of several
    keys), None leaves it out."""
    lines = []
    for err in exc.errors():
        where = path(err["loc"]) or whole
        lines.append(f"{origin}: {where + ': ' if where else ''}{error_message(err)}")
    return lines


def error_line(exc: ValidationError, origin: str | Path, *, whole: str | None = "-",
               path: Callable[[Sequence[Any]], str] = dotted) -> str:
    """The first of :func:`error_lines`: what a one-line error says."""
    return error_lines(exc, origin, whole=whole, path=path)[0]


def validated(model: Any, data: Any, origin: str | Path, error: type[RigctlError] = ConfigError) -> Any:
    """``data`` as the pydantic ``model`` (a class) validates it; ``error`` naming ``origin`` and the first bad
    key (``origin: matrix.p.0: Input should be a valid integer``) when it does not."""
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(error_line(exc, origin, whole=None)) from None
