"""A server's endpoint as the controller reaches it (:func:`server_endpoint`, the one home), and the SSH forward
that reaches a server listening on its host's loopback only (:class:`Forward`).

A llama-server bound to 127.0.0.1 (the reference rigs' are: no API key crosses the network) answers nobody but
its own host. Every controller-side measurement (evals, load curves, server sweeps, drafter races, upgrade
gates, runtime checks, health probes, MCP tools) takes its endpoint from :func:`server_endpoint`: a server that
listens on a routable address is asked at ``http://ansible_host:port``; one that listens on loopback through a
:class:`Forward`, what ``ssh -L`` does: a listener on this machine's 127.0.0.1 whose every connection is a
``direct-tcpip`` channel of the host's own SSH connection (:func:`rigctl.ssh.session`, strict host keys) to the
server's address and port as the host sees them. One forward per server address per command: the command's
connections scope (:func:`rigctl.connections.connections`) keeps it and closes it on exit, before the
connection it runs over. The endpoint's ``url`` stays the server's own (``http://127.0.0.1:8080``, what a record
names); its ``via`` is the forward's local URL, which only this command can use.

A host that refuses forwarding (``AllowTcpForwarding no``) is found when the forward opens, before anything is
asked: one channel is opened and closed at once, and a refusal is a :class:`rigctl.errors.ForwardError` naming
the host and the address. A server that is not listening (yet) is not an error there: each connection to it is
closed as it comes, which the HTTP client retries as it retries a refused connection.
"""

from __future__ import annotations

import ipaddress
import logging
import select
import socket
import threading
from contextlib import nullcontext, suppress
from types import TracebackType
from typing import Self

import paramiko
from paramiko.common import OPEN_FAILED_CONNECT_FAILED

from rigctl.connections import current
from rigctl.errors import ConnectError, ForwardError, RigctlError
from rigctl.inventory import Host, Server
from rigctl.llama_http import Endpoint
from rigctl.ssh import SshClient, session

log = logging.getLogger(__name__)


class _ReportedHere(logging.Filter):
    """paramiko logs every channel the host would not open as an ERROR ("Secsh channel 3 open FAILED"): a refusal is
    a ForwardError of this module's, a server not listening yet a retried connection; neither is paramiko's line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "open FAILED" not in str(record.msg)


logging.getLogger("paramiko.transport").addFilter(_ReportedHere())

#: Where a forward listens: this machine's loopback, so nothing else on the network can use it.
LOCAL_ADDRESS = "127.0.0.1"
#: Seconds to wait for the host to open a channel, and for a forward's threads to end when it closes.
CHANNEL_TIMEOUT = 10.0
#: Seconds between checks of whether the forward has closed, while a connection is quiet.
_POLL_S = 0.5
_CHUNK = 1 << 16


def listens_on_loopback(bind: str) -> bool:
    """Whether a server bound to ``bind`` answers its own host only."""
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class Forward:
    """A listener on ``127.0.0.1:<free port>`` forwarding each connection through ``ssh`` to ``address:port``
    as ``ssh``'s host sees it; a context manager (:meth:`open`, :meth:`close`)."""

    def __init__(self, ssh: SshClient, address: str, port: int, *, timeout: float = CHANNEL_TIMEOUT):
        self.ssh, self.address, self.port, self.timeout = ssh, address, port, timeout
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open: set[tuple[socket.socket, paramiko.Channel]] = set()
        self._acceptor: threading.Thread | None = None
        self._threads: list[threading.Thread] = []  # one per forwarded connection

    @property
    def target(self) -> str:
        """The forwarded address, as the host sees it."""
        return f"{_url_host(self.address)}:{self.port}"

    @property
    def local_port(self) -> int:
        if self._listener is None:
            raise RigctlError(f"{self.ssh.host}: the forward to {self.target} is not open")
        return int(self._listener.getsockname()[1])

    @property
    def url(self) -> str:
        """The forward's base URL on this machine."""
        return f"http://{LOCAL_ADDRESS}:{self.local_port}"

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> Self:
        """Check that the host forwards to the target (ForwardError when it refuses, ConnectError when it cannot
        be reached), then listen."""
        checked = self._channel((LOCAL_ADDRESS, 0))
        if checked is not None:
            checked.close()
        self._listener = socket.create_server((LOCAL_ADDRESS, 0), backlog=64)
        self._acceptor = threading.Thread(target=self._accept, args=(self._listener,), daemon=True,
                                          name=f"rigctl-forward-{self.ssh.host}-{self.port}")
        self._acceptor.start()
        log.debug("%s: forwarding %s to %s", self.ssh.host, self.url, self.target)
        return self

    def close(self) -> None:
        """Stop listening and close every forwarded connection; waits (bounded) for their threads."""
        self._closed.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            _shut(listener)  # wakes the accept loop, which close() alone does not
            listener.close()
        if self._acceptor is not None:
            self._acceptor.join(self.timeout)  # no connection is taken from now on
        with self._lock:
            pairs, self._open = list(self._open), set()
            threads = list(self._threads)
        for conn, chan in pairs:
            _shut(conn)
            chan.close()
        for thread in threads:
            thread.join(self.timeout)

    def _channel(self, origin: tuple[str, int]) -> paramiko.Channel | None:
        """A ``direct-tcpip`` channel to the target; None when nothing listens there. ForwardError when the host
        refuses to forward, ConnectError when it cannot be reached."""
        try:
            return self.ssh.transport().open_channel("direct-tcpip", (self.address, self.port), origin,
                                                     timeout=self.timeout)
        except paramiko.ChannelException as exc:
            if exc.code == OPEN_FAILED_CONNECT_FAILED:
                log.debug("%s: nothing listens on %s", self.ssh.host, self.target)
                return None
            raise ForwardError(self.ssh.host, self.target,
                               f"the host refused the channel ({exc.text.lower()}: its sshd's "
                               "AllowTcpForwarding?)") from None
        except ConnectError:
            raise
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise ForwardError(self.ssh.host, self.target, str(exc) or type(exc).__name__) from None

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                conn, origin = listener.accept()
            except OSError:
                return  # closed
            thread = threading.Thread(target=self._serve, args=(conn, origin), daemon=True,
                                      name=f"rigctl-forward-{self.ssh.host}-{self.port}-{origin[1]}")
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, conn: socket.socket, origin: tuple[str, int]) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # requests and replies are small packets
        if self._closed.is_set():  # taken as the forward closed: no channel (nor a new connection) for it
            conn.close()
            return
        try:
            chan = self._channel(origin)
        except RigctlError as exc:  # the connection dropped, or the host stopped forwarding: this request fails
            log.warning("%s", exc)
            chan = None
        if chan is None:
            conn.close()
            return
        with self._lock:
            if self._closed.is_set():
                conn.close()
                chan.close()
                return
            self._open.add((conn, chan))
        try:
            self._pump(conn, chan)
        finally:
            with self._lock:
                self._open.discard((conn, chan))
            conn.close()
            chan.close()

    def _pump(self, conn: socket.socket, chan: paramiko.Channel) -> None:
        """Bytes both ways until either side ends or the forward closes."""
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select([conn, chan], [], [], _POLL_S)
                for source, sink in ((conn, chan), (chan, conn)):
                    if source in readable:
                        data = source.recv(_CHUNK)
                        if not data:
                            return
                        sink.sendall(data)
        except (OSError, ValueError, EOFError, paramiko.SSHException) as exc:  # closed under it: the forward ends
            log.debug("%s: forwarded connection to %s ended: %s", self.ssh.host, self.target, exc)


def _shut(sock: socket.socket) -> None:
    with suppress(OSError):  # not connected, or already shut
        sock.shutdown(socket.SHUT_RDWR)


def server_endpoint(host: Host | SshClient, server: Server, *, port: int | None = None,
                    label: str | None = None) -> Endpoint:
    """Where the controller asks ``server`` (on ``port``: a probe of it beside it; ``label`` names the probe):
    its host's address when it listens on a routable one, else through a :class:`Forward` over the command's
    connection to ``host`` (or ``ssh``, that connection), kept by the command's connections scope (opened here on
    first use: ForwardError when the host refuses)."""
    port = server.port if port is None else port
    label = label or f"{server.host}/{server.name}"
    if not listens_on_loopback(server.bind):
        return Endpoint(f"http://{server.address}:{port}", server.api_key, label)
    scope = current()
    if scope is None:
        raise RigctlError(f"{label}: listens on {_url_host(server.bind)}:{port} of its host only; the controller "
                          "reaches it through a forward that a command's connections scope keeps "
                          "(rigctl.connections.connections())")
    with session(host) if isinstance(host, Host) else nullcontext(host) as ssh:
        if ssh.host != server.host:
            raise RigctlError(f"{label}: not reached through {ssh.host}'s connection")
        ssh.connect()  # outside the scope's lock: a slow host does not hold up the others
        forward = scope.keep(("forward", ssh.host, server.bind, port), lambda: Forward(ssh, server.bind, port).open())
    return Endpoint(f"http://{_url_host(server.bind)}:{port}", server.api_key, label, via=forward.url)
