"""A loopback stand-in for an sshd that never answers: what a client does while connections hang in their
handshake, counted on a real socket."""

from __future__ import annotations

import socket
import threading
import time


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
