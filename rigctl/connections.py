"""The connections of one command: a scope in which every SSH session to a host is the same connection.

:func:`connections` opens the scope (the CLI opens one per command; :func:`rigctl.analysis.campaign.run_campaign`
one per run); :func:`rigctl.ssh.session` hands out the scope's connection to a host, made on first use,
and the scope closes them all when it ends. Outside a scope every session is a connection of its own.
Stdlib only, and apart from :mod:`rigctl.ssh`: opening a scope must not cost paramiko's import (most of a
second) to commands that never connect.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from rigctl.inventory import Host


class Closable(Protocol):
    def close(self) -> None: ...


_C = TypeVar("_C", bound=Closable)


class Connections:
    """One connection per host name, made by the caller's factory on first use, closed together by :meth:`close`."""

    def __init__(self) -> None:
        self._clients: dict[str, Closable] = {}
        self._lock = threading.Lock()  # the threads of one command (one per host) share the scope

    def client(self, host: Host, make: Callable[[Host], _C]) -> _C:
        with self._lock:
            client = self._clients.get(host.name)
            if client is None:
                client = self._clients[host.name] = make(host)
            return client  # type: ignore[return-value]

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


_current: contextvars.ContextVar[Connections | None] = contextvars.ContextVar("rigctl_connections", default=None)


def current() -> Connections | None:
    """The scope open in this context (threads started by :func:`rigctl.ssh.on_each_host` share it), or None."""
    return _current.get()


@contextmanager
def connections() -> Iterator[Connections]:
    """Open a scope; inside a scope already open, that one (closed by whoever opened it)."""
    pool = _current.get()
    if pool is not None:
        yield pool
        return
    pool = Connections()
    token = _current.set(pool)
    try:
        yield pool
    finally:
        _current.reset(token)
        pool.close()
