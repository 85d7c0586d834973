"""The connections of one command: a scope in which every SSH session to a host is the same connection.

:func:`connections` opens the scope (the CLI opens one per command; :func:`rigctl.analysis.campaign.run_campaign`
one per run); :func:`rigctl.ssh.session` hands out the scope's connection to a host, made on first use,
and the scope closes them all when it ends. Outside a scope every session is a connection of its own.
Stdlib only, and apart from :mod:`rigctl.ssh`: opening a scope must not cost paramiko's import (most of a
second) to commands that never connect.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol, TypeVar

from rigctl.errors import RigctlError, one_line

if TYPE_CHECKING:
    from rigctl.inventory import Host


log = logging.getLogger(__name__)


class Closable(Protocol):
    def close(self) -> None: ...


_C = TypeVar("_C", bound=Closable)


class Connections:
    """One connection per host name, made by the caller's factory on first use, and what the command keeps
    open over them (:mod:`rigctl.forward`'s forwards, one per server); closed together by :meth:`close`."""

    def __init__(self) -> None:
        self._kept: dict[Hashable, Closable] = {}
        self._lock = threading.Lock()  # the threads of one command (one per host) share the scope

    def client(self, host: Host, make: Callable[[Host], _C]) -> _C:
        return self.keep(("connection", host.name), lambda: make(host))

    def keep(self, key: Hashable, make: Callable[[], _C]) -> _C:
        """What the scope holds under ``key``, made by ``make`` on first use and closed with the scope."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is None:
                kept = self._kept[key] = make()
            return kept  # type: ignore[return-value]

    def close(self) -> None:
        """Close what the scope holds, newest first: a forward before the connection it runs over."""
        with self._lock:
            kept, self._kept = list(self._kept.values()), {}
        for closable in reversed(kept):
            closable.close()


_current: contextvars.ContextVar[Connections | None] = contextvars.ContextVar("rigctl_connections", default=None)


def current() -> Connections | None:
    """The scope open in this context (threads started by :func:`on_each_host` share it), or None."""
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


_T = TypeVar("_T")


def on_each_host(hosts: Iterable[Host], work: Callable[[Host], _T], *, max_workers: int = 8,
                 thread_name_prefix: str = "rigctl-hosts") -> dict[str, _T | RigctlError]:
    """``work(host)`` on every host at once; per host name (in the order of ``hosts``) its result or the
    RigctlError it raised, so one host failing never costs the others' results. Any other exception (what
    a host's answer provokes) becomes that host's RigctlError, one line naming the host. The threads share
    the caller's :func:`rigctl.connections.connections` scope."""
    hosts = list(hosts)
    if not hosts:
        return {}

    def one(host: Host) -> _T | RigctlError:
        try:
            return work(host)
        except RigctlError as exc:
            log.debug("%s", exc)
            return exc
        except Exception as exc:  # a host's answer can provoke anything: it stops only that host
            log.debug("%s", host.name, exc_info=True)
            return RigctlError(f"{host.name}: {one_line(exc)}")

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(hosts))),
                            thread_name_prefix=thread_name_prefix) as pool:
        # A context per thread: the scope's Connections is shared, a context cannot be entered twice at once.
        futures = [pool.submit(contextvars.copy_context().run, one, host) for host in hosts]
        return {host.name: future.result() for host, future in zip(hosts, futures, strict=True)}
