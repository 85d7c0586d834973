"""The llama-server HTTP client (or any OpenAI-compatible endpoint's), sync and async.

:mod:`.client` holds the clients, their settings and the one retry loop both share; callers import what they
need from here::

    from rigctl.llama_http import Endpoint, ServerClient
"""

from rigctl.llama_http.client import (
    DEFAULT_SEED,
    NO_RETRY,
    AsyncServerClient,
    Endpoint,
    Props,
    Retry,
    ServerClient,
    Timeouts,
)

__all__ = ["DEFAULT_SEED", "NO_RETRY", "AsyncServerClient", "Endpoint", "Props", "Retry", "ServerClient", "Timeouts"]
