"""Loopback sshds for unit tests: one that never answers (what a client does while connections hang in their
handshake, counted on a real socket), and a real SSH server that forwards (:class:`ForwardingSshd`)."""

from __future__ import annotations

import select
import socket
import threading
import time
from pathlib import Path

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


class MuteSshd:
    """A loopback listener that accepts TCP and never sends a banner, counting what it accepted; :meth:`hang_up`
    closes every connection, now and from then on."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.hung_up = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.append(conn)
            if self.hung_up.is_set():
                conn.close()

    def hang_up(self) -> None:
        self.hung_up.set()
        for conn in list(self.accepted):
            conn.close()

    def close(self) -> None:
        self.hang_up()
        self.listener.close()


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class ForwardingSshd:
    """A real SSH server on loopback (paramiko's server side, over real sockets): public-key login with one key,
    and ``direct-tcpip`` channels to whatever address the client names, as OpenSSH's sshd forwards with
    ``AllowTcpForwarding yes``; with ``allow_forwarding=False`` it refuses them as OpenSSH does with ``no``
    (administratively prohibited), and a target that refuses the connection is answered "connect failed", as
    OpenSSH answers it. Host and client keys are made in ``directory``; :attr:`logins` counts connections."""

    def __init__(self, directory: Path, *, allow_forwarding: bool = True) -> None:
        self.allow_forwarding = allow_forwarding
        self.host_key = paramiko.Ed25519Key.from_private_key_file(str(_ed25519(directory / "host_key")))
        self.client_key_file = _ed25519(directory / "client_key")
        self.client_key = paramiko.Ed25519Key.from_private_key_file(str(self.client_key_file))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.known_hosts = directory / "known_hosts"
        key = f"{self.host_key.get_name()} {self.host_key.get_base64()}"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {key}\n")
        self.transports: list[paramiko.Transport] = []
        self._targets: dict[int, socket.socket] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def logins(self) -> int:
        return len(self.transports)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            transport = paramiko.Transport(conn)
            transport.add_server_key(self.host_key)
            transport.start_server(server=_Interface(self))
            self.transports.append(transport)
            threading.Thread(target=self._channels, args=(transport,), daemon=True).start()

    def _channels(self, transport: paramiko.Transport) -> None:
        while transport.is_active():
            chan = transport.accept(0.2)
            if chan is not None:
                target = self._targets.pop(chan.get_id())
                threading.Thread(target=_pump, args=(chan, target), daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for transport in self.transports:
            transport.close()


class _Interface(paramiko.ServerInterface):
    def __init__(self, sshd: ForwardingSshd) -> None:
        self.sshd = sshd

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        matches = key.asbytes() == self.sshd.client_key.asbytes()
        return paramiko.AUTH_SUCCESSFUL if matches else paramiko.AUTH_FAILED

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED  # no sessions: forwarding only

    def check_channel_direct_tcpip_request(self, chanid: int, origin: tuple[str, int],
                                           destination: tuple[str, int]) -> int:
        if not self.sshd.allow_forwarding:
            return paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED
        try:
            self.sshd._targets[chanid] = socket.create_connection(destination, timeout=5)
        except OSError:
            return paramiko.OPEN_FAILED_CONNECT_FAILED
        return paramiko.OPEN_SUCCEEDED


def _pump(chan: paramiko.Channel, target: socket.socket) -> None:
    try:
        while True:
            readable, _, _ = select.select([chan, target], [], [], 0.5)
            for source, sink in ((chan, target), (target, chan)):
                if source in readable:
                    data = source.recv(65536)
                    if not data:
                        return
                    sink.sendall(data)
    except (OSError, EOFError):
        return
    finally:
        chan.close()
        target.close()


def _ed25519(path: Path) -> Path:
    """A new Ed25519 private key in OpenSSH's format at ``path``."""
    key = Ed25519PrivateKey.generate()
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return path
