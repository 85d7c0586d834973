"""Where a bearer token may go: only to its own origin (scheme, host and port exactly), redirects included. The
one rule for the Hugging Face token, used by the controller's dataset downloads (through
:mod:`rigctl.trust`) and the models role's fetch module (as ``ansible.module_utils.token_origin``). Standard
library only.
"""

from __future__ import annotations

import os
import urllib.parse
import urllib.request
from typing import Any

_DEFAULT_PORTS = {"http": 80, "https": 443}
DEFAULT_HF_ENDPOINT = "https://huggingface.co"


def hf_endpoint() -> str:
    """The Hugging Face endpoint the controller talks to (``HF_ENDPOINT``, a mirror's, else the hub), and so the
    one origin its token goes to."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT).rstrip("/")


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``url``, the port filled in for http and https."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme, 0)


def same_origin(url: str, base: str) -> bool:
    """Whether ``url`` is on exactly the scheme, host and port of ``base`` (a prefix is not enough:
    ``http://127.0.0.1:1810`` is not the origin of ``http://127.0.0.1:18100/x``)."""
    target = origin(url)
    return bool(target[1]) and target == origin(base)


def bearer_header(token: str | None, url: str, token_origin: str) -> dict[str, str]:
    """The ``Authorization`` header for a request to ``url``: the token when ``url`` is on ``token_origin``'s
    origin, nothing otherwise (or without a token)."""
    return {"Authorization": f"Bearer {token}"} if token and same_origin(url, token_origin) else {}


class OriginBoundRedirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirect handling, the ``Authorization`` header dropped from every hop that leaves
    ``token_origin``'s origin (a redirect to a CDN or anywhere else never carries the token)."""

    def __init__(self, token_origin: str):
        self.token_origin = token_origin

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and not same_origin(newurl, self.token_origin):
            new.remove_header("Authorization")
            new.unredirected_hdrs.pop("Authorization", None)
        return new
