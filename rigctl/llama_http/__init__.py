"""The llama-server HTTP client (or any OpenAI-compatible endpoint's), sync and async.

:mod:`.client` holds the clients, their settings and the one retry loop both share; :mod:`.api` the typed
answers, their pure parsers and the request bodies. Callers import what they need from here::

    from rigctl.llama_http import Endpoint, ServerClient
"""

from rigctl.llama_http.api import DEFAULT_SEED, Props
from rigctl.llama_http.client import NO_RETRY, AsyncServerClient, Endpoint, Retry, ServerClient, Timeouts

__all__ = ["DEFAULT_SEED", "NO_RETRY", "AsyncServerClient", "Endpoint", "Props", "Retry", "ServerClient", "Timeouts"]
