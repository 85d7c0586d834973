"""rigctl's own SSH: commands and SFTP transfers on the rigs, over paramiko.

Hosts come from the inventory (:class:`rigctl.inventory.Host`), so this layer connects exactly where
Ansible does: ``ansible_host``/``ansible_port``/``ansible_user``/``ansible_ssh_private_key_file``,
checking host keys against the inventory's ``rigctl_known_hosts`` file. Checking is always strict: a
host whose key is missing from that file or differs from it is refused, and the file is never
written. A login that is not root (an enrolled host's fleet user) runs every command and SFTP session as root
through ``sudo -n`` (:mod:`rigctl.become`), as Ansible's ``become`` does; a root login runs them as they are.

Every wait is bounded: TCP connect, SSH banner, authentication, channel open, each command and each
transfer. Only transient connect failures (refused, timed out, no route) are retried, with
exponential backoff and jitter; host key and authentication failures fail at once.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import re
import secrets
import select
import shlex
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Self

import paramiko

from rigctl.become import ROOT, SFTP_SERVER_COMMAND, SUDO_CHECK, as_root
from rigctl.connections import current as current_connections
from rigctl.connections import on_each_host
from rigctl.errors import ConnectError, HostKeyError, RemoteCommandError, RigctlError, SudoRefusedError, TransferError
from rigctl.inventory import Host
from rigctl.inventory.keys import SHA256

log = logging.getLogger(__name__)

# paramiko logs every failed handshake as an ERROR with a traceback; rigctl reports the same failure
# as a one-line error of its own. Left alone unless the application has configured paramiko itself.
_paramiko_log = logging.getLogger("paramiko")
if not _paramiko_log.handlers and _paramiko_log.level == logging.NOTSET:
    _paramiko_log.addHandler(logging.NullHandler())
    _paramiko_log.propagate = False

SSH_PORT = 22
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_CHANNEL_TIMEOUT = 10.0
DEFAULT_RETRIES = 3
_CHUNK = 1 << 20
_POLL = 0.05
_TAIL_CHARS = 4000
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: OpenSSH's sshd drops new connections, at random and then all of them, while 10 are not yet authenticated
#: (MaxStartups 10:30:100): this process opens at most this many at once to one sshd (address and port), so
#: that many inventory names for one machine, or many commands to one host at once, never trip it.
MAX_HANDSHAKES_PER_SSHD = 8
_TRANSIENT_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH,
     errno.EHOSTDOWN, errno.ENETDOWN}
)


@dataclass(frozen=True)
class CommandResult:
    host: str
    cmd: str
    rc: int
    stdout: str
    stderr: str
    duration: float  # seconds

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def check(self) -> Self:
        """This result, or RemoteCommandError if the command exited non-zero."""
        if not self.ok:
            raise RemoteCommandError(self.host, self.cmd, self.rc, _tail(self.stdout, self.stderr))
        return self


@dataclass(frozen=True)
class Transfer:
    """A file moved by :meth:`SshClient.get` or :meth:`SshClient.put`, at its destination."""

    host: str
    path: str  # the destination: local for get, remote for put
    size: int
    sha256: str


@dataclass(frozen=True)
class SshTarget:
    """Where and as whom to connect, and which known_hosts file vouches for the host."""

    name: str
    address: str
    port: int
    user: str
    key_file: Path | None
    known_hosts: Path
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT

    @classmethod
    def from_host(cls, host: Host) -> SshTarget:
        timeout = host.vars.get("ansible_ssh_timeout")  # Ansible's own connect timeout, 10 s unset
        return cls(
            name=host.name,
            address=host.address,
            port=host.port,
            user=host.user,
            key_file=host.key_file,
            known_hosts=host.known_hosts,
            connect_timeout=float(timeout) if timeout is not None else DEFAULT_CONNECT_TIMEOUT,
        )

    @property
    def sudo(self) -> bool:
        """Whether commands and transfers go through ``sudo -n``: the login user is not root."""
        return self.user != ROOT

    def known_hosts_names(self) -> list[str]:
        """known_hosts names for this target, the address first (what OpenSSH looks up), then the name."""
        names = [known_hosts_name(self.address, self.port)]
        if self.name != self.address:
            names.append(known_hosts_name(self.name, self.port))
        return names


def known_hosts_name(host: str, port: int) -> str:
    """The name known_hosts files list ``host`` under: ``host`` on port 22, else ``[host]:port``."""
    return host if port == SSH_PORT else f"[{host}]:{port}"


def backoff_delays(retries: int, *, base: float, cap: float, rng: random.Random) -> list[float]:
    """Sleeps before each retry: exponential from ``base``, capped at ``cap``, each drawn from
    [d/2, d] so that clients failing together do not retry in lockstep."""
    delays = []
    for attempt in range(retries):
        ceiling = min(cap, base * 2**attempt)
        delays.append(rng.uniform(ceiling / 2, ceiling))
    return delays


class _UnknownHostKey(paramiko.SSHException):
    def __init__(self, key: paramiko.PKey):
        super().__init__("host key not in known_hosts")
        self.key = key


class _RejectUnknown(paramiko.RejectPolicy):
    """paramiko's RejectPolicy, keeping the refused key so the error can show its fingerprint."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise _UnknownHostKey(key)


class _HandshakeSlots:
    """At most ``per_sshd`` connections being set up (TCP, banner, key exchange, authentication) at once to one
    address and port, across every client of this process."""

    def __init__(self, per_sshd: int):
        self.per_sshd = per_sshd
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, int], threading.BoundedSemaphore] = {}

    @contextmanager
    def slot(self, address: str, port: int, timeout: float) -> Iterator[None]:
        """Hold one of the sshd's slots; TimeoutError (transient, as a slow handshake) after ``timeout``."""
        with self._lock:
            slots = self._slots.setdefault((address, port), threading.BoundedSemaphore(self.per_sshd))
        if not slots.acquire(timeout=timeout):
            raise TimeoutError(f"timed out waiting for one of the {self.per_sshd} SSH handshakes in progress "
                               f"to {known_hosts_name(address, port)}")
        try:
            yield
        finally:
            slots.release()


_HANDSHAKES = _HandshakeSlots(MAX_HANDSHAKES_PER_SSHD)


class SshClient:
    """One SSH connection to one host; a context manager. Connects on first use, waiting up to its connect timeout
    for one of the :data:`MAX_HANDSHAKES_PER_SSHD` handshake slots of its sshd (then its own timeout starts)."""

    def __init__(
        self,
        target: SshTarget,
        *,
        connect_timeout: float | None = None,
        channel_timeout: float = DEFAULT_CHANNEL_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        backoff_base: float = 0.5,
        backoff_cap: float = 8.0,
    ):
        self.target = target
        self.connect_timeout = connect_timeout if connect_timeout is not None else target.connect_timeout
        self.channel_timeout = channel_timeout
        self.retries = retries
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self._rng = random.Random()
        self._client: paramiko.SSHClient | None = None
        # Threads of one command may share a client (one host's connection): one of them connects.
        self._connect_lock = threading.Lock()

    @classmethod
    def for_host(cls, host: Host, *, connect_timeout: float | None = None,
                 channel_timeout: float = DEFAULT_CHANNEL_TIMEOUT, retries: int = DEFAULT_RETRIES) -> SshClient:
        """A client for an inventory host, as Ansible reaches it (not connected yet)."""
        return cls(SshTarget.from_host(host), connect_timeout=connect_timeout, channel_timeout=channel_timeout,
                   retries=retries)

    def __enter__(self) -> Self:
        self.connect()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def host(self) -> str:
        return self.target.name

    @property
    def connected(self) -> bool:
        transport = self._client.get_transport() if self._client else None
        return transport is not None and transport.is_active()

    def connect(self) -> None:
        """Connect and authenticate, retrying transient failures; no-op while connected."""
        with self._connect_lock:
            self._connect()

    def _connect(self) -> None:
        if self.connected:
            return
        self.close()
        t = self.target
        if t.key_file is not None and not t.key_file.is_file():
            raise ConnectError(t.name, f"private key {t.key_file}: no such file")
        delays = backoff_delays(self.retries, base=self.backoff_base, cap=self.backoff_cap, rng=self._rng)
        attempts = len(delays) + 1
        for attempt in range(1, attempts + 1):
            try:
                self._client = self._connect_once()
                log.debug("%s: connected to %s@%s:%d", t.name, t.user, t.address, t.port)
                return
            except (OSError, EOFError, paramiko.SSHException) as exc:
                if not _is_transient(exc):
                    raise self._connect_error(exc) from None
                if attempt == attempts:
                    reason = f"{_describe(exc)} (after {attempts} attempts)"
                    raise ConnectError(t.name, reason) from None
                delay = delays[attempt - 1]
                log.info("%s: %s; retry %d/%d in %.1fs", t.name, _describe(exc), attempt, len(delays), delay)
                time.sleep(delay)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def run(
        self,
        cmd: str,
        *,
        timeout: float,
        check: bool = True,
        input: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        as_login: bool = False,
    ) -> CommandResult:
        """Run ``cmd`` with the login shell of the host, as root (see the module) unless ``as_login``; stdin gets
        ``input`` then EOF.

        Past ``timeout`` seconds the channel is closed and RemoteCommandError (rc None) raised; the
        remote process is not signalled and may run on.
        """
        transport = self.transport()
        data = input.encode() if isinstance(input, str) else (input or b"")
        started = time.monotonic()
        deadline = started + timeout
        sudo, sent = self.target.sudo and not as_login, _with_env(cmd, env or {})
        sent = as_root(sent) if sudo else sent
        chan = self._open_session(transport)
        log.debug("%s: run %s", self.host, cmd)
        try:
            if not self._request(chan, lambda: chan.exec_command(sent), deadline):
                raise RemoteCommandError(self.host, cmd, None)
            out, err, finished = _collect(chan, deadline, data)
            rc = chan.exit_status
        finally:
            chan.close()
        duration = time.monotonic() - started
        stdout, stderr = _decode(out), _decode(err)
        if not finished:
            raise RemoteCommandError(self.host, cmd, None, _tail(stdout, stderr))
        if rc == -1 and not transport.is_active():
            raise ConnectError(self.host, f"connection lost while running `{cmd}`")
        if rc != 0 and sudo and "sudo" in stderr:
            self._require_sudo()
        result = CommandResult(self.host, cmd, rc, stdout, stderr, duration)
        log.debug("%s: `%s` exited %d in %.2fs", self.host, cmd, result.rc, duration)
        return result.check() if check else result

    def sha256(self, remote_path: str, *, timeout: float = 120.0) -> str:
        """sha256 of a file on the host, by ``sha256sum`` there."""
        result = self.run(f"sha256sum -- {shlex.quote(remote_path)}", timeout=timeout)
        digest = result.stdout.split(maxsplit=1)[0] if result.stdout.strip() else ""
        if not SHA256.match(digest):
            raise RemoteCommandError(self.host, result.cmd, result.rc, f"unexpected output: {result.stdout!r}")
        return digest

    def get(
        self, remote: str, local: str | os.PathLike[str], *, timeout: float, sha256: str | None = None,
        mode: int = 0o644, max_bytes: int | None = None,
    ) -> Transfer:
        """Copy ``remote`` to ``local`` via a temporary file renamed into place once complete, matching ``sha256``
        and at most ``max_bytes`` (a linked device stops there), with ``mode``: the host's bits are never copied."""
        local_path = Path(local)
        local_path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        digest = hashlib.sha256()
        size = 0
        fd, tmp_name = tempfile.mkstemp(dir=local_path.parent, prefix=f".{local_path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, self._sftp_errors(remote, deadline), self._sftp() as sftp:
                with sftp.open(remote, "rb") as src:
                    os.fchmod(out.fileno(), mode)
                    src.prefetch(src.stat().st_size)
                    while chunk := _read(src, sftp, deadline, self.host, remote):
                        out.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        if max_bytes is not None and size > max_bytes:
                            raise TransferError(self.host, remote, f"more than the {max_bytes} bytes expected")
                out.flush()
                os.fsync(out.fileno())
            hexdigest = digest.hexdigest()
            if sha256 is not None and hexdigest != sha256.lower():
                raise TransferError(self.host, remote, f"sha256 is {hexdigest}, expected {sha256.lower()}")
            os.replace(tmp_name, local_path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        log.debug("%s: got %s -> %s (%d bytes)", self.host, remote, local_path, size)
        return Transfer(self.host, str(local_path), size, hexdigest)

    def put(self, local: str | os.PathLike[str], remote: str, *, timeout: float) -> Transfer:
        """Copy ``local`` to ``remote`` (keeping its mode) via a temporary file renamed into place once complete."""
        local_path = Path(local)
        deadline = time.monotonic() + timeout
        target = PurePosixPath(remote)
        tmp = str(target.with_name(f".{target.name}.{secrets.token_hex(4)}.part"))
        digest = hashlib.sha256()
        size = 0
        with open(local_path, "rb") as src, self._sftp_errors(remote, deadline), self._sftp() as sftp:
            try:
                with sftp.open(tmp, "wb") as dst:
                    dst.set_pipelined(True)
                    while chunk := src.read(_CHUNK):
                        _arm(sftp, deadline, self.host, remote)
                        dst.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                    _arm(sftp, deadline, self.host, remote)
                sftp.chmod(tmp, stat.S_IMODE(local_path.stat().st_mode))
                sftp.posix_rename(tmp, remote)
            except BaseException:
                _remove_quietly(sftp, tmp)
                raise
        log.debug("%s: put %s -> %s (%d bytes)", self.host, local_path, remote, size)
        return Transfer(self.host, remote, size, digest.hexdigest())

    def _require_sudo(self) -> None:
        """Nothing if sudo runs a command as root without a password, else SudoRefusedError."""
        check = self.run(SUDO_CHECK, timeout=self.channel_timeout, check=False, as_login=True)
        if not check.ok:
            said = _tail(check.stdout, check.stderr).strip().splitlines()
            raise SudoRefusedError(self.host, self.target.user, said[-1] if said else f"exit status {check.rc}")

    def transport(self) -> paramiko.Transport:
        """The connected transport (connecting first), where this connection's channels open."""
        self.connect()
        assert self._client is not None
        transport = self._client.get_transport()
        assert transport is not None
        return transport

    def _connect_once(self) -> paramiko.SSHClient:
        t = self.target
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(_RejectUnknown())
        self._load_known_hosts(client)
        with _HANDSHAKES.slot(t.address, t.port, self.connect_timeout):
            self._handshake(client)
        transport = client.get_transport()
        assert transport is not None
        transport.set_keepalive(30)  # long bench jobs are silent for minutes; keep NAT state alive
        return client

    def _handshake(self, client: paramiko.SSHClient) -> None:
        """Connect ``client``: TCP, banner, key exchange, host key check, authentication."""
        t = self.target
        sock = socket.create_connection((t.address, t.port), timeout=self.connect_timeout)
        # Each command is a few small packets each way: with Nagle's algorithm on, the last of them waits
        # for the host's delayed ACK (40 ms on Linux), which made every round trip ~50 ms instead of ~7.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            # The socket is ours so that paramiko's negotiation wait is bounded by the banner and
            # handshake timeouts, which fail with an exception, and not by its own, which does not.
            client.connect(
                t.address,
                port=t.port,
                username=t.user,
                key_filename=str(t.key_file) if t.key_file else None,
                # With an inventory key, that key alone, as Ansible passes it; without, what ssh would try.
                allow_agent=t.key_file is None,
                look_for_keys=t.key_file is None,
                sock=sock,
                banner_timeout=self.connect_timeout,
                auth_timeout=self.connect_timeout,
                channel_timeout=self.channel_timeout,
                transport_factory=self._new_transport,
            )
        except BaseException:
            client.close()
            sock.close()
            raise

    def _new_transport(self, sock: socket.socket, **kwargs: object) -> paramiko.Transport:
        transport = paramiko.Transport(sock, **kwargs)  # type: ignore[arg-type]
        transport.handshake_timeout = self.connect_timeout
        return transport

    def _load_known_hosts(self, client: paramiko.SSHClient) -> None:
        t = self.target
        if t.known_hosts.is_file():
            try:
                client.load_host_keys(str(t.known_hosts))
            except paramiko.hostkeys.InvalidHostKey as exc:
                raise HostKeyError(t.name, f"{t.known_hosts}: invalid key in line {exc.line!r}") from None
            except (OSError, ValueError) as exc:
                raise HostKeyError(t.name, f"cannot read {t.known_hosts}: {_describe(exc)}") from None
        # paramiko looks the host up by the address it dials; an entry under the inventory name
        # vouches for it too. The alias lives in memory only: the file is never saved.
        keys = client.get_host_keys()
        primary, *aliases = t.known_hosts_names()
        if keys.lookup(primary) is not None:
            return
        for alias in aliases:
            found = keys.lookup(alias)
            if found is not None:
                for keytype, key in found.items():
                    keys.add(primary, keytype, key)
                return

    def _connect_error(self, exc: BaseException) -> ConnectError:
        t = self.target
        if isinstance(exc, paramiko.BadHostKeyException):
            presented = exc.key
            return HostKeyError(
                t.name,
                f"the {presented.get_name()} key presented ({presented.fingerprint}) differs from "
                f"the one in {t.known_hosts}",
            )
        if isinstance(exc, _UnknownHostKey):
            missing = "" if t.known_hosts.exists() else ", which does not exist"
            return HostKeyError(
                t.name,
                f"no key for {' or '.join(t.known_hosts_names())} in {t.known_hosts}{missing} "
                f"(it presented {exc.key.get_name()} {exc.key.fingerprint})",
            )
        if isinstance(exc, paramiko.AuthenticationException):
            how = f"key {t.key_file}" if t.key_file else "the agent and default keys"
            return ConnectError(t.name, f"authentication as {t.user} with {how} failed: {exc}")
        return ConnectError(t.name, _describe(exc))

    def _open_session(self, transport: paramiko.Transport) -> paramiko.Channel:
        try:
            return transport.open_session(timeout=self.channel_timeout)
        except (OSError, paramiko.SSHException) as exc:
            raise ConnectError(self.host, f"cannot open a session: {_describe(exc)}") from None

    def _request(self, chan: paramiko.Channel, request: Callable[[], None], deadline: float) -> bool:
        """Send a channel request (exec, subsystem); False if no reply came by ``deadline``."""
        # paramiko waits for the reply without a timeout; closing the channel ends that wait.
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), chan.close)
        watchdog.daemon = True
        watchdog.start()
        try:
            request()
        except paramiko.SSHException as exc:
            if time.monotonic() >= deadline:
                return False
            raise ConnectError(self.host, f"channel request refused: {_describe(exc)}") from None
        finally:
            watchdog.cancel()
        return True

    @contextmanager
    def _sftp(self) -> Iterator[paramiko.SFTPClient]:
        chan = self._open_session(self.transport())
        what = "a root sftp-server" if self.target.sudo else "the SFTP subsystem request"
        request = ((lambda: chan.exec_command(as_root(SFTP_SERVER_COMMAND))) if self.target.sudo
                   else (lambda: chan.invoke_subsystem("sftp")))
        if not self._request(chan, request, time.monotonic() + self.channel_timeout):
            chan.close()
            raise ConnectError(self.host, f"no reply to {what}")
        chan.settimeout(self.channel_timeout)  # for the version exchange; transfers re-arm it
        try:
            sftp = paramiko.SFTPClient(chan)
        except (OSError, EOFError, paramiko.SSHException) as exc:
            said = _decode(chan.recv_stderr(_TAIL_CHARS)).strip().splitlines() if chan.recv_stderr_ready() else []
            chan.close()
            if self.target.sudo:
                self._require_sudo()
            raise ConnectError(self.host, f"cannot start {what}: {said[-1] if said else _describe(exc)}") from None
        try:
            yield sftp
        finally:
            sftp.close()

    @contextmanager
    def _sftp_errors(self, path: str, deadline: float) -> Iterator[None]:
        try:
            yield
        except TimeoutError:
            raise TransferError(self.host, path, "transfer timed out") from None
        except FileNotFoundError:
            raise TransferError(self.host, path, "no such file") from None
        except PermissionError:
            raise TransferError(self.host, path, "permission denied") from None
        except (OSError, paramiko.SSHException) as exc:
            if time.monotonic() >= deadline:
                raise TransferError(self.host, path, "transfer timed out") from None
            raise TransferError(self.host, path, _describe(exc)) from None


@contextmanager
def session(host: Host, client: SshClient | None = None) -> Iterator[SshClient]:
    """A connection to ``host``: ``client`` when given, else the command's shared one (see
    :func:`rigctl.connections.connections`), both left open; outside a scope a new one, closed on exit."""
    if client is not None:
        yield client
        return
    pool = current_connections()
    if pool is not None:
        yield pool.client(host, SshClient.for_host)
        return
    with SshClient.for_host(host) as ssh:
        yield ssh


def run_on_hosts(
    hosts: Iterable[Host],
    cmd: str,
    *,
    timeout: float,
    max_workers: int = 8,
    check: bool = True,
    connect_timeout: float | None = None,
    retries: int = DEFAULT_RETRIES,
) -> dict[str, CommandResult | RigctlError]:
    """Run ``cmd`` on every host at once; per host name, its result or the RigctlError it raised.

    One host failing (unreachable, wrong key, command failed or timed out) never costs the others'
    results. The dict keeps the order of ``hosts``.
    """

    def one(host: Host) -> CommandResult:
        with SshClient.for_host(host, connect_timeout=connect_timeout, retries=retries) as client:
            return client.run(cmd, timeout=timeout, check=check)

    return on_each_host(hosts, one, max_workers=max_workers, thread_name_prefix="rigctl-ssh")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, paramiko.BadHostKeyException | paramiko.AuthenticationException | _UnknownHostKey):
        return False
    if isinstance(exc, TimeoutError | EOFError):
        return True
    if isinstance(exc, OSError):
        return exc.errno in _TRANSIENT_ERRNOS
    # A banner or key exchange cut short or timed out, as while sshd starts or restarts.
    return isinstance(exc.__context__, TimeoutError | EOFError | ConnectionError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return str(exc) if str(exc).startswith("timed out") else "timed out"
    if isinstance(exc, EOFError):
        return "connection closed during the SSH handshake"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    text = str(exc).strip()
    text = text.splitlines()[0] if text else type(exc).__name__
    return f"{text} (timed out)" if isinstance(exc.__context__, TimeoutError) else text


def _with_env(cmd: str, env: Mapping[str, str]) -> str:
    # sshd drops environment requests except AcceptEnv names, so variables travel in the command.
    if not env:
        return cmd
    for name in env:
        if not _ENV_NAME.match(name):
            raise ValueError(f"invalid environment variable name {name!r}")
    assignments = " ".join(f"{name}={shlex.quote(str(value))}" for name, value in env.items())
    return f"export {assignments}; {cmd}"


def _collect(chan: paramiko.Channel, deadline: float, stdin: bytes) -> tuple[bytes, bytes, bool]:
    """Feed ``stdin`` and read stdout and stderr together until EOF and exit status (finished) or
    the deadline (not finished).

    Interleaving all three keeps either side from blocking on a full window.
    """
    out, err = bytearray(), bytearray()
    pending = memoryview(stdin)
    if not pending:
        chan.shutdown_write()
    while True:
        busy = False
        if chan.recv_ready():
            out += chan.recv(_CHUNK)
            busy = True
        if chan.recv_stderr_ready():
            err += chan.recv_stderr(_CHUNK)
            busy = True
        if pending and chan.send_ready():
            try:
                pending = pending[chan.send(pending[:_CHUNK]) :]
            except OSError:
                pending = pending[:0]  # the command closed its stdin or exited; the rest has no reader
            busy = True
            if not pending and not chan.closed:
                chan.shutdown_write()
        drained = (chan.eof_received or chan.closed) and not chan.recv_ready() and not chan.recv_stderr_ready()
        if drained and chan.exit_status_ready():
            return bytes(out), bytes(err), True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return bytes(out), bytes(err), False
        if busy:
            continue
        if drained:
            chan.status_event.wait(min(remaining, _POLL))
        else:
            # The channel's fd wakes on stdout; stderr and send window are polled.
            select.select([chan], [], [], min(remaining, _POLL))


def _read(
    src: paramiko.SFTPFile, sftp: paramiko.SFTPClient, deadline: float, host: str, path: str
) -> bytes:
    _arm(sftp, deadline, host, path)
    return src.read(_CHUNK)


def _arm(sftp: paramiko.SFTPClient, deadline: float, host: str, path: str) -> None:
    # Bound the next SFTP round trip by what is left of the transfer's time.
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferError(host, path, "transfer timed out")
    channel = sftp.get_channel()
    assert channel is not None
    channel.settimeout(remaining)


def _remove_quietly(sftp: paramiko.SFTPClient, path: str) -> None:
    try:
        sftp.remove(path)
    except (OSError, paramiko.SSHException) as exc:
        log.debug("cannot remove %s: %s", path, exc)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _tail(stdout: str, stderr: str) -> str:
    text = stderr if stderr.strip() else stdout
    return text[-_TAIL_CHARS:]
