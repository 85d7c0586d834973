"""A server's endpoint as the controller reaches it (rigctl/forward.py): asked directly when it listens on a
routable address, through the host's SSH connection when it listens on loopback only — against a real SSH server
on loopback (tests/loopback_sshd.py) forwarding to a real local HTTP server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from loopback_sshd import ForwardingSshd, wait_for

from rigctl.connections import connections
from rigctl.errors import ForwardError, RigctlError
from rigctl.forward import listens_on_loopback, server_endpoint
from rigctl.inventory import Host
from rigctl.llama_http import ServerClient

RIGCTL = [str(Path(sys.executable).parent / "rigctl")]


class Stand:
    """A loopback HTTP server answering ``/health`` (and ``/slow``, after a pause), counting requests and the
    most it served at once."""

    def __init__(self, port: int = 0) -> None:
        stand = self
        self.requests = 0
        self.in_flight = self.most_at_once = 0
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                with stand.lock:
                    stand.requests += 1
                    stand.in_flight += 1
                    stand.most_at_once = max(stand.most_at_once, stand.in_flight)
                try:
                    if self.path == "/slow":
                        time.sleep(0.3)
                    body = json.dumps({"status": "ok"}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                finally:
                    with stand.lock:
                        stand.in_flight -= 1

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def stand() -> Iterator[Stand]:
    server = Stand()
    yield server
    server.close()


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[ForwardingSshd]:
    server = ForwardingSshd(tmp_path)
    yield server
    server.close()


def host_vars(sshd: ForwardingSshd, port: int, bind: str) -> dict[str, Any]:
    return {"ansible_port": sshd.port, "ansible_ssh_private_key_file": str(sshd.client_key_file),
            "rigctl_known_hosts": str(sshd.known_hosts), "llama_server_api_key": "k",
            "llama_server_profiles": {"p": {"host": bind}},
            "llama_server_instances": {"s": {"artifact": "a", "profile": "p", "port": port}}}


def rig(sshd: ForwardingSshd, port: int, bind: str = "127.0.0.1") -> Host:
    return Host("rig", "127.0.0.1", "root", ("all",), host_vars(sshd, port, bind))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_which_binds_answer_their_own_host_only() -> None:
    assert all(map(listens_on_loopback, ["127.0.0.1", "127.0.0.53", "::1", "localhost"]))
    assert not any(map(listens_on_loopback, ["0.0.0.0", "::", "10.213.0.11", "fe80::1", "rig.example", ""]))


def test_a_server_on_a_routable_address_is_asked_there_without_ssh(sshd: ForwardingSshd) -> None:
    host = Host("rig", "10.0.0.7", "root", ("all",), host_vars(sshd, 8081, "0.0.0.0"))
    endpoint = server_endpoint(host, host.server("s"))  # no command scope needed: nothing is opened
    assert (endpoint.url, endpoint.via, endpoint.api_key, endpoint.label) == ("http://10.0.0.7:8081", None, "k",
                                                                              "rig/s")
    probe = server_endpoint(host, host.server("s"), port=8281, label="rig/probe")
    assert (probe.url, probe.label) == ("http://10.0.0.7:8281", "rig/probe")
    assert sshd.logins == 0


def test_a_loopback_server_outside_a_command_scope_is_refused(sshd: ForwardingSshd, stand: Stand) -> None:
    host = rig(sshd, stand.port)
    with pytest.raises(RigctlError, match=rf"^rig/s: listens on 127\.0\.0\.1:{stand.port} of its host only"):
        server_endpoint(host, host.server("s"))
    assert sshd.logins == 0


def test_a_loopback_server_is_asked_through_the_hosts_ssh_connection_one_forward_per_command(
        sshd: ForwardingSshd, stand: Stand) -> None:
    host = rig(sshd, stand.port)
    with connections():
        endpoint = server_endpoint(host, host.server("s"))
        # The record's URL is the server's own on its host; the client dials the forward.
        assert endpoint.url == f"http://127.0.0.1:{stand.port}" and endpoint.label == "rig/s"
        assert endpoint.via and endpoint.via.startswith("http://127.0.0.1:") and endpoint.via != endpoint.url
        with ServerClient(endpoint) as client:
            assert client.health().ok
        assert stand.requests == 1
        again = server_endpoint(host, host.server("s"))
        assert again.via == endpoint.via  # the same forward
        probe = server_endpoint(host, host.server("s"), port=free_port(), label="rig/probe")
        assert probe.via != endpoint.via  # another address, another forward
        assert sshd.logins == 1  # all over the host's one connection
        local_port = int(endpoint.via.rsplit(":", 1)[1])
    # Closed with the command: the local listener, and the connection it ran over.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", local_port), timeout=5).close()
    assert wait_for(lambda: not sshd.transports[0].is_active())
    assert wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("rigctl-forward")])


def test_concurrent_requests_each_get_a_channel(sshd: ForwardingSshd, stand: Stand) -> None:
    host = rig(sshd, stand.port)

    async def eight(base: str) -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            replies = await asyncio.gather(*(client.get("/slow") for _ in range(8)))
        return [r.status_code for r in replies]

    with connections():
        endpoint = server_endpoint(host, host.server("s"))
        assert asyncio.run(eight(endpoint.dial_url)) == [200] * 8
    assert stand.requests == 8 and stand.most_at_once > 1  # served side by side, not one channel in turn


def test_a_server_that_comes_up_later_is_reached_through_the_same_forward(sshd: ForwardingSshd) -> None:
    port = free_port()
    host = rig(sshd, port)
    with connections():
        endpoint = server_endpoint(host, host.server("s"))  # nothing listens yet: not an error
        with ServerClient(endpoint) as client:
            down = client.health()
            assert not down.ok
            later = Stand(port)
            try:
                assert client.health().ok and later.requests == 1
            finally:
                later.close()


def test_a_host_that_refuses_forwarding_is_one_error_naming_host_and_address(tmp_path: Path, stand: Stand) -> None:
    sshd = ForwardingSshd(tmp_path, allow_forwarding=False)
    try:
        host = rig(sshd, stand.port)
        with connections(), pytest.raises(ForwardError) as refused:
            server_endpoint(host, host.server("s"))
        assert str(refused.value) == (f"rig: cannot forward to 127.0.0.1:{stand.port} over SSH: the host refused "
                                      "the channel (administratively prohibited: its sshd's AllowTcpForwarding?)")
        assert stand.requests == 0

        # The CLI: one error line, exit 1, and no run started.
        inventory = tmp_path / "inventory"
        (inventory / "host_vars").mkdir(parents=True)
        (inventory / "hosts.yml").write_text(yaml.safe_dump(
            {"all": {"hosts": {"rig": {"ansible_host": "127.0.0.1", "ansible_user": "root"}}}}))
        (inventory / "host_vars" / "rig.yml").write_text(yaml.safe_dump(host_vars(sshd, stand.port, "127.0.0.1")))
        results = tmp_path / "results"
        done = subprocess.run([*RIGCTL, "-i", str(inventory), "bench", "server", "rig", "s", "--prompt-lengths",
                               "16"], capture_output=True, text=True, timeout=120, check=False,
                              env={**os.environ, "RIGCTL_RESULTS": str(results)})
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stderr.splitlines() == [f"error: {refused.value}"], done.stderr
        assert not list(results.rglob("run.json")) and stand.requests == 0
    finally:
        sshd.close()
