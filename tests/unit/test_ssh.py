"""rigctl.ssh without rigs: bare sockets on loopback for connect failures, host-key handling."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from loopback_sshd import MuteSshd, wait_for

import rigctl
from rigctl.errors import ConnectError, RemoteCommandError
from rigctl.inventory import Inventory
from rigctl.ssh import (
    MAX_HANDSHAKES_PER_SSHD,
    CommandResult,
    SshClient,
    SshTarget,
    backoff_delays,
    known_hosts_name,
)

# --- pure helpers -------------------------------------------------------------------------------


def test_known_hosts_name_uses_bracket_form_off_port_22() -> None:
    assert known_hosts_name("10.213.0.11", 22) == "10.213.0.11"
    assert known_hosts_name("10.213.0.11", 2222) == "[10.213.0.11]:2222"
    assert known_hosts_name("desktop", 2222) == "[desktop]:2222"


def test_target_looks_up_address_then_name() -> None:
    target = SshTarget("desktop", "10.213.0.11", 2222, "root", None, Path("/kh"))
    assert target.known_hosts_names() == ["[10.213.0.11]:2222", "[desktop]:2222"]
    by_name = dataclasses.replace(target, address="desktop", port=22)
    assert by_name.known_hosts_names() == ["desktop"]


def test_target_from_inventory_host(lab_inventory: Inventory) -> None:
    # The unit tests' lab inventory is slot 0's (tests/unit/conftest.py), the default lab.
    lab_dir = Path("/var/lib/rigctl/lab")
    target = SshTarget.from_host(lab_inventory.host("laptop"))
    assert (target.name, target.address, target.port, target.user) == ("laptop", "10.213.0.12", 22, "root")
    assert target.key_file == lab_dir / "id_ed25519"
    assert target.known_hosts == lab_dir / "known_hosts"


def test_backoff_grows_exponentially_with_jitter_and_cap() -> None:
    delays = backoff_delays(6, base=0.5, cap=4.0, rng=random.Random(7))
    ceilings = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert len(delays) == 6
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling
    assert len(set(delays)) == 6  # jittered, not a fixed schedule
    assert delays == backoff_delays(6, base=0.5, cap=4.0, rng=random.Random(7))
    assert backoff_delays(0, base=0.5, cap=4.0, rng=random.Random(7)) == []


def test_command_result_check() -> None:
    ok = CommandResult("desktop", "true", 0, "", "", 0.1)
    assert ok.ok and ok.check() is ok
    failed = CommandResult("desktop", "make", 2, "building\n", "cc: error: boom\nmake: *** failed\n", 1.0)
    with pytest.raises(RemoteCommandError) as info:
        failed.check()
    assert (info.value.host, info.value.rc) == ("desktop", 2)
    assert str(info.value) == "desktop: `make` exited 2: make: *** failed"
    quiet = CommandResult("laptop", "grep x f", 1, "last stdout line\n", "", 0.1)
    with pytest.raises(RemoteCommandError, match=r"^laptop: `grep x f` exited 1: last stdout line$"):
        quiet.check()


def test_a_failed_commands_error_is_one_short_line() -> None:
    """A shipped host-side module's command line carries its whole source: an error (and the exporter's log of a
    host going down) names the module instead; any other long command is cut short."""
    from rigctl.hostside import ship

    shipped = ship.python_command("fleet_state", '{"timeout": 5}')
    assert len(shipped) > 2000
    assert str(RemoteCommandError("alias007", shipped, None)) == \
        "alias007: `python3 -c <rigctl.hostside.fleet_state>` timed out"
    error = RemoteCommandError("desktop", "echo " + "x" * 300, 1, "boom")
    assert str(error) == f"desktop: `echo {'x' * 155} ...` exited 1: boom" and error.cmd.endswith("x" * 300)
    assert str(RemoteCommandError("desktop", "set -e\nmake", 2)) == "desktop: `set -e ...` exited 2"
    cut_off = RemoteCommandError("laptop", shipped, None, '{"fact": "' + "f" * 5000)
    assert str(cut_off) == f'laptop: `python3 -c <rigctl.hostside.fleet_state>` timed out: {{"fact": "{"f" * 150} ...'


# --- connect failures on loopback (no lab) ----------------------------------------------------------


def _loopback_target(port: int, tmp_path: Path, key_file: Path | None = None) -> SshTarget:
    return SshTarget("loop", "127.0.0.1", port, "root", key_file, tmp_path / "known_hosts")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refused_is_retried_with_backoff_then_fails(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rigctl.ssh")
    client = SshClient(_loopback_target(_free_port(), tmp_path), retries=2, backoff_base=0.1)
    started = time.monotonic()
    with pytest.raises(ConnectError, match=r"^loop: cannot connect: connection refused \(after 3 attempts\)$"):
        client.connect()
    elapsed = time.monotonic() - started
    retries = [r for r in caplog.records if r.name == "rigctl.ssh" and "retry" in r.getMessage()]
    assert len(retries) == 2
    assert 0.1 <= elapsed < 2  # slept 0.05-0.1 then 0.1-0.2 between attempts


def test_silent_server_times_out(tmp_path: Path) -> None:
    with socket.socket() as server:  # accepts TCP (backlog), never sends an SSH banner
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        client = SshClient(
            _loopback_target(server.getsockname()[1], tmp_path), connect_timeout=0.3, retries=1, backoff_base=0.1
        )
        started = time.monotonic()
        with pytest.raises(ConnectError, match=r"banner.*timed out.*after 2 attempts"):
            client.connect()
        assert time.monotonic() - started < 3


_SILENT_SERVER_SCRIPT = """
import logging, socket, sys
from pathlib import Path
from rigctl.errors import ConnectError
from rigctl.ssh import SshClient, SshTarget
logging.basicConfig(level=logging.WARNING)  # as an application would
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(8)
target = SshTarget("loop", "127.0.0.1", server.getsockname()[1], "root", None, Path(sys.argv[1]))
try:
    SshClient(target, connect_timeout=0.3, retries=0).connect()
except ConnectError as exc:
    print(exc)
"""


def test_paramiko_failure_logging_stays_off_the_console(tmp_path: Path) -> None:
    # paramiko logs a failed handshake as an ERROR with a traceback; rigctl's one-line error is enough.
    repo = Path(rigctl.__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", _SILENT_SERVER_SCRIPT, str(tmp_path / "known_hosts")],
        capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert proc.stdout.startswith("loop: cannot connect: Error reading SSH protocol banner")
    assert proc.stderr == ""


def test_missing_private_key_fails_before_connecting(tmp_path: Path) -> None:
    client = SshClient(_loopback_target(_free_port(), tmp_path, key_file=tmp_path / "nope"), retries=5)
    started = time.monotonic()
    with pytest.raises(ConnectError, match=r"private key .*/nope: no such file"):
        client.connect()
    assert time.monotonic() - started < 0.5


# --- the lab rigs -------------------------------------------------------------------------------------




def test_at_most_eight_handshakes_at_once_to_one_sshd(tmp_path: Path) -> None:
    """sshd drops new connections while 10 are unauthenticated (MaxStartups): many inventory names for one
    machine are set up 8 at a time, the others wait for a slot; another sshd is not held up by them."""
    crowded, other = MuteSshd(), MuteSshd()
    errors: list[str] = []

    def connect(port: int) -> None:
        try:
            SshClient(_loopback_target(port, tmp_path), connect_timeout=20, retries=0).connect()
        except ConnectError as exc:
            errors.append(str(exc))

    try:
        threads = [threading.Thread(target=connect, args=(crowded.port,)) for _ in range(12)]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: len(crowded.accepted) >= MAX_HANDSHAKES_PER_SSHD)
        time.sleep(0.5)
        assert len(crowded.accepted) == MAX_HANDSHAKES_PER_SSHD == 8
        elsewhere = threading.Thread(target=connect, args=(other.port,))
        elsewhere.start()
        assert wait_for(lambda: len(other.accepted) == 1)
        crowded.hang_up()  # the first eight fail at once; the four waiting get their turn
        other.hang_up()
        for thread in [*threads, elsewhere]:
            thread.join(timeout=30)
        assert len(crowded.accepted) == 12
        assert len(errors) == 13 and all(e.startswith("loop: cannot connect: ") for e in errors), errors
    finally:
        crowded.close()
        other.close()


def test_waiting_for_a_handshake_slot_is_bounded_by_the_connect_timeout(tmp_path: Path) -> None:
    crowded = MuteSshd()
    holders = [threading.Thread(target=lambda: _quietly(SshClient(_loopback_target(crowded.port, tmp_path),
                                                                  connect_timeout=20, retries=0).connect))
               for _ in range(MAX_HANDSHAKES_PER_SSHD)]
    try:
        for thread in holders:
            thread.start()
        assert wait_for(lambda: len(crowded.accepted) == MAX_HANDSHAKES_PER_SSHD)
        started = time.monotonic()
        with pytest.raises(ConnectError, match=r"^loop: cannot connect: timed out waiting for one of the 8 SSH "
                                               r"handshakes in progress to \[127\.0\.0\.1\]:\d+ \(after 1 attempts\)$"):
            SshClient(_loopback_target(crowded.port, tmp_path), connect_timeout=0.3, retries=0).connect()
        assert 0.3 <= time.monotonic() - started < 3
        assert len(crowded.accepted) == MAX_HANDSHAKES_PER_SSHD
    finally:
        crowded.close()
        for thread in holders:
            thread.join(timeout=30)


def _quietly(work) -> None:
    with contextlib.suppress(ConnectError):
        work()
