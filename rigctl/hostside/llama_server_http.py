"""What rigctl knows of llama-server's HTTP API that the host side needs too. Standard library only.

:mod:`rigctl.llama_http` (the controller's httpx clients) and :mod:`rigctl.hostside.eval_task` (urllib, on
the host) share the retry policy and the reading of ``/props``:

* a connection error or a 5xx answer (503 while the model loads) is retried with exponential backoff
  and jitter; a 4xx answer or a read timeout is not, since retrying cannot change it;
* ``/props`` gives the build, the model path, the slots and the context size;
* an answer's body is read by :func:`decode_json`, which tells JSON that Python cannot hold apart from text
  that is no JSON at all;
* an error, whether the body of a 4xx/5xx answer or inside a 200 stream, is read by :func:`error_body`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RETRY_ATTEMPTS = 4
RETRY_BACKOFF = 0.5
RETRY_MAX_WAIT = 8.0


def attempts_within(wait_s: float, backoff: float = RETRY_BACKOFF, max_wait: float = RETRY_MAX_WAIT) -> int:
    """The fewest attempts whose waits between them (:func:`retry_wait` at its shortest) add up to ``wait_s``;
    never fewer than :data:`RETRY_ATTEMPTS`."""
    attempts, waited = 1, 0.0
    while waited < wait_s:
        waited += min(max_wait, backoff * 2 ** (attempts - 1)) * 0.75
        attempts += 1
    return max(RETRY_ATTEMPTS, attempts)


def retryable_status(status: int) -> bool:
    return status >= 500


def retry_wait(attempt: int, backoff: float = RETRY_BACKOFF, max_wait: float = RETRY_MAX_WAIT) -> float:
    """Seconds to wait after failed attempt ``attempt`` (0-based): ``backoff * 2**attempt``, capped, ±25 %."""
    return min(max_wait, backoff * 2**attempt) * (0.75 + random.random() / 2)


def props_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """``/props`` as build_info, model_path, total_slots, n_ctx (None when not reported), chat_template."""
    settings = data.get("default_generation_settings") or {}
    return {"build_info": str(data.get("build_info", "")), "model_path": str(data.get("model_path", "")),
            "total_slots": int(data.get("total_slots", 1)),
            "n_ctx": settings.get("n_ctx") if isinstance(settings, Mapping) else None,
            "chat_template": str(data.get("chat_template", ""))}


class UnreadableJSON(ValueError):
    """Well-formed JSON that Python cannot hold as it is: nesting past the recursion limit, an integer past
    the digit limit, or a string with a lone UTF-16 surrogate (which no UTF-8 text can carry, so no answers
    file could either)."""


def decode_json(data: bytes | str) -> Any:
    """An answer's body decoded. Text that is no JSON raises ``json.JSONDecodeError`` (or
    ``UnicodeDecodeError``); JSON that cannot be held raises :class:`UnreadableJSON` with the reason."""
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except RecursionError:
        raise UnreadableJSON("JSON nested too deep to read") from None
    except ValueError as exc:  # the only other: an integer past sys.get_int_max_str_digits()
        raise UnreadableJSON(f"a number too long to read ({exc})") from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise UnreadableJSON("a string with a lone UTF-16 surrogate, which UTF-8 cannot carry") from None
    except RecursionError:
        raise UnreadableJSON("JSON nested too deep to read") from None
    return value


@dataclass(frozen=True)
class ErrorBody:
    """What an error answer says. llama-server sends ``{"error": {"code", "message", "type", ...}}`` as the
    body of a 4xx/5xx answer and, inside a 200 stream, either ``data: {"error": {...}}`` (builds since the fix
    of September 2025) or an SSE ``error:`` field holding the inner object itself (builds before it)."""

    message: str
    type: str | None = None
    code: int | None = None

    def reason(self, limit: int = 300) -> str:
        """One line: the message, and the error's type where it names one."""
        first = self.message.strip().splitlines()[0][:limit] if self.message.strip() else "no message"
        return f"{first} ({self.type})" if self.type else first


def error_body(body: bytes | str) -> ErrorBody:
    """The one reader of llama-server's error answers (a body, or a stream's error payload): the JSON shapes
    above, ``{"error": "text"}``, or text that is no JSON (its first line)."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    try:
        data = decode_json(text)
    except ValueError:  # no JSON (or JSON Python cannot hold): the text is the message
        return ErrorBody(text.strip())
    error = data.get("error", data) if isinstance(data, Mapping) else data
    if not isinstance(error, Mapping):
        return ErrorBody(str(error) if error is not None else text.strip())
    code = error.get("code")
    return ErrorBody(message=str(error.get("message") or text.strip()),
                     type=str(error["type"]) if error.get("type") else None,
                     code=code if isinstance(code, int) and not isinstance(code, bool) else None)
