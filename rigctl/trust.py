"""The trust boundary: what a rig, a file or a server sends is data, never a path or a secret's destination.

* Paths named by someone else (a rig's run listing, a record's raw-file path, an MCP argument) are
  checked with :func:`relative_path` (relative, no ``..``, nothing odd) and placed with :func:`inside`
  (resolved, symlinks included, and still under its root).
* Secrets (API keys, tokens) are replaced by ``***`` wherever text leaves rigctl: :func:`redact` for a
  known value, :func:`redact_argv` for a command line kept in a record, :class:`RedactingFilter` for log
  lines, :func:`is_secret_name` for a setting's name.
* A token goes only to its own origin, scheme, host and port exactly (:func:`same_origin`); a redirect
  to any other origin loses it.
* Text a host reports (its GPU's name, its OS) is kept only when it can be nothing but text
  (:func:`data_text_problem`): printable, bounded, and without the markers that would make Ansible
  template it. Text from outside is shown with its unprintable characters escaped (:func:`printable`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from rigctl.errors import TrustError

# Which names hold a secret, and a command line masked, have one home shared with the host (its stamp masks a
# server's argv before it leaves the host); the token's origin rule one shared with the models role.
from rigctl.hostside.masking import MASK as MASK
from rigctl.hostside.masking import is_secret_name as is_secret_name
from rigctl.hostside.masking import mask_argv
from rigctl.hostside.token_origin import same_origin as same_origin

#: What opens a Jinja expression, statement or comment: text carrying one runs as code wherever Ansible
#: templates it (every inventory string not tagged !unsafe).
TEMPLATE_MARKERS = ("{{", "{%", "{#")
# Shorter values are not redacted by value: masking every "k" of a log line hides nothing and ruins it.
_MIN_SECRET = 4


def relative_path(value: object, what: str) -> PurePosixPath:
    """``value`` as a relative POSIX path that stays below the directory it is joined to; TrustError
    naming ``what`` otherwise (absolute, ``..``, empty, a NUL or a backslash)."""
    if not isinstance(value, str) or not value or "\0" in value or "\\" in value:
        raise TrustError(f"{what}: {value!r} is not a relative path")
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts or path.parts in ((), (".",)):
        raise TrustError(f"{what}: {value!r} leaves its directory")
    return path


def inside(root: Path, relative: str | PurePosixPath, what: str) -> Path:
    """``root / relative`` resolved (symlinks followed); TrustError unless it is still under ``root``."""
    return contained(root, root / relative_path(str(relative), what), what)


def contained(root: Path, path: Path, what: str) -> Path:
    """``path`` resolved (symlinks followed); TrustError unless it is ``root`` or under it."""
    resolved, base = path.resolve(), root.resolve()
    if resolved != base and not resolved.is_relative_to(base):
        raise TrustError(f"{what}: {path} resolves to {resolved}, outside {base}")
    return resolved


def data_text_problem(text: str, max_length: int) -> str | None:
    """Why ``text`` from outside cannot be kept as data, or None when it can: it must be printable (no
    control character, terminal escape or line break), at most ``max_length`` characters, and free of
    :data:`TEMPLATE_MARKERS`."""
    if len(text) > max_length:
        return f"{len(text)} characters, more than {max_length}"
    odd = next((ch for ch in text if not ch.isprintable()), None)
    if odd is not None:
        return f"unprintable character {odd!r} in {text!r}"
    marker = next((m for m in TEMPLATE_MARKERS if m in text), None)
    if marker is not None:
        return f"template marker {marker!r} in {text!r}: a host's text is data, never a template"
    return None


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` with every unprintable character (a terminal escape, a carriage return, a line break unless
    ``lines``) written as its Python escape (``\\x1b``, ``\\n``, ``\\u202e``): what a terminal may be sent."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or (lines and ch == "\n") else ch.encode("unicode_escape").decode()
                   for ch in text)


def secret_forms(secret: str) -> set[str]:
    """Every way ``secret`` may appear in a message: as it is, without the whitespace around it, and
    escaped as Python's repr of it as text or as bytes (an HTTP library's header error) or JSON writes it."""
    forms = {secret, secret.strip(), repr(secret)[1:-1], repr(secret.encode())[2:-1], json.dumps(secret)[1:-1]}
    return {form for form in forms if len(form) >= _MIN_SECRET}


def mask_secret_values(value: Any) -> Any:
    """``value`` with whatever a secret-named key holds, at any depth, replaced by ``***``: what a message
    may quote of a mapping (a model source with its ``token``)."""
    if isinstance(value, Mapping):
        return {key: MASK if is_secret_name(str(key)) else mask_secret_values(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [mask_secret_values(item) for item in value]
    return value


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every occurrence of each secret, in any of its :func:`secret_forms`, replaced by ``***``."""
    forms = {form for secret in secrets if secret for form in secret_forms(secret)}
    for form in sorted(forms, key=len, reverse=True):  # the longest first: a form may hold another
        text = text.replace(form, MASK)
    return text


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line as a record keeps it: the value of every secret option (``--api-key K``,
    ``--hf-token=K``, ``-hft K``: the host's rule, :func:`rigctl.hostside.masking.mask_argv`) replaced by
    ``***``, and any registered secret masked wherever it appears."""
    return mask_argv(argv, lambda arg: redact(arg, _registered()))


_lock = threading.Lock()
_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Mask ``value`` in every log line of this process (:class:`RedactingFilter`) and in
    :func:`redact_argv` from now on."""
    if value and len(value) >= _MIN_SECRET:
        with _lock:
            _secrets.add(value)


def mask_registered(text: str) -> str:
    """``text`` with every registered secret masked (for an error line)."""
    return redact(text, _registered())


def _registered() -> list[str]:
    with _lock:
        return list(_secrets)


class RedactingFilter(logging.Filter):
    """Masks every registered secret in a log record's message (installed on rigctl's log handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = _registered()
        if secrets:
            message = record.getMessage()
            masked = redact(message, secrets)
            if masked != message:
                record.msg, record.args = masked, None
        return True
