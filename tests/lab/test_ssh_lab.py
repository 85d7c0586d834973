"""rigctl.ssh against the lab rigs' real sshd."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from labkeys import RESTORE_HOST_KEYS, ROTATE_HOST_KEYS

from rigctl.errors import ConnectError, HostKeyError, RemoteCommandError, TransferError
from rigctl.inventory import Inventory
from rigctl.ssh import (
    CommandResult,
    SshClient,
    SshTarget,
    known_hosts_name,
    run_on_hosts,
)

lab = pytest.mark.lab




# --- the lab rigs -------------------------------------------------------------------------------------


@pytest.fixture
def desktop(lab_up: Inventory) -> SshTarget:
    return SshTarget.from_host(lab_up.host("desktop"))


@pytest.fixture
def rig(desktop: SshTarget) -> Iterator[SshClient]:
    with SshClient(desktop) as client:
        yield client


@pytest.fixture
def rig_tmp(rig: SshClient) -> Iterator[str]:
    path = rig.run("mktemp -d /tmp/rigctl-test-ssh.XXXXXX", timeout=10).stdout.strip()
    yield path
    rig.run(f"rm -rf -- {shlex.quote(path)}", timeout=10)


def _ssh_keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


@lab
def test_run_on_hosts_reaches_each_rig(lab_up: Inventory) -> None:
    started = time.monotonic()
    outcomes = run_on_hosts(lab_up.select(), "sleep 1; hostname; id -un", timeout=20, max_workers=4)
    assert time.monotonic() - started < 1.9  # both at once, not one after the other
    assert list(outcomes) == ["desktop", "laptop"]
    for name, outcome in outcomes.items():
        assert isinstance(outcome, CommandResult), outcome
        assert (outcome.host, outcome.rc) == (name, 0)
        assert outcome.stdout.split() == [name, "root"]


@lab
def test_run_on_hosts_keeps_other_hosts_results(lab_up: Inventory) -> None:
    desktop, laptop = lab_up.host("desktop"), lab_up.host("laptop")
    unreachable = dataclasses.replace(laptop, vars={**laptop.vars, "ansible_port": 1})
    outcomes = run_on_hosts([unreachable, desktop], "hostname", timeout=20, max_workers=2, retries=1)
    assert isinstance(outcomes["laptop"], ConnectError)
    assert str(outcomes["laptop"]) == "laptop: cannot connect: connection refused (after 2 attempts)"
    assert isinstance(outcomes["desktop"], CommandResult) and outcomes["desktop"].stdout == "desktop\n"

    outcomes = run_on_hosts([desktop, laptop], 'test "$(hostname)" = desktop', timeout=20)
    assert isinstance(outcomes["desktop"], CommandResult) and outcomes["desktop"].ok
    failure = outcomes["laptop"]
    assert isinstance(failure, RemoteCommandError) and (failure.host, failure.rc) == ("laptop", 1)


@lab
def test_failing_command_result_and_check(rig: SshClient) -> None:
    result = rig.run("echo out; echo err >&2; sleep 0.3; exit 3", timeout=10, check=False)
    assert (result.host, result.rc, result.ok) == ("desktop", 3, False)
    assert (result.stdout, result.stderr) == ("out\n", "err\n")
    assert 0.3 <= result.duration < 5
    with pytest.raises(RemoteCommandError) as info:
        rig.run("echo out; echo 'no such model' >&2; exit 4", timeout=10)
    assert (info.value.host, info.value.rc) == ("desktop", 4)
    assert str(info.value) == "desktop: `echo out; echo 'no such model' >&2; exit 4` exited 4: no such model"


@lab
def test_env_and_input_reach_the_command(rig: SshClient) -> None:
    value = "it's $HOME; `x` \"q\""
    result = rig.run('printf %s "$RIGCTL_T"; echo; wc -c', timeout=10, input="é" * 10, env={"RIGCTL_T": value})
    assert result.stdout == f"{value}\n20\n"
    # Far more input than the command reads: the rest is dropped once it exits, not an error.
    partial = rig.run("head -c 10; exit 5", timeout=30, input=b"x" * (20 << 20), check=False)
    assert (partial.rc, partial.stdout) == (5, "x" * 10)
    with pytest.raises(ValueError, match="invalid environment variable name"):
        rig.run("true", timeout=10, env={"A;B": "x"})


@lab
def test_small_packets_go_out_at_once(rig: SshClient) -> None:
    """Nagle's algorithm off: a command's last small packet would otherwise wait for the rig's delayed ACK."""
    rig.run("true", timeout=10)
    assert rig.transport().sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@lab
def test_timeout_stops_waiting_and_keeps_the_connection(rig: SshClient) -> None:
    started = time.monotonic()
    with pytest.raises(RemoteCommandError) as info:
        rig.run("echo started; sleep 30", timeout=1)
    elapsed = time.monotonic() - started
    assert (info.value.host, info.value.rc) == ("desktop", None)
    assert str(info.value) == "desktop: `echo started; sleep 30` timed out: started"
    assert 1 <= elapsed < 2.5
    assert rig.run("echo still here", timeout=10).stdout == "still here\n"


@lab
def test_large_output_on_both_streams_does_not_hang(rig: SshClient) -> None:
    # Both streams at once, each far past the SSH window, interleaved.
    cmd = "for i in $(seq 64); do head -c 131072 /dev/zero | tr '\\0' o; head -c 65536 /dev/zero | tr '\\0' e >&2; done"
    started = time.monotonic()
    result = rig.run(cmd, timeout=60)
    assert (len(result.stdout), len(result.stderr)) == (8 << 20, 4 << 20)
    assert set(result.stdout) == {"o"} and set(result.stderr) == {"e"}
    payload = os.urandom(3 << 20)
    echoed = rig.run("base64 -w 76", timeout=60, input=payload)  # writes back while we still send
    assert echoed.stdout.replace("\n", "") == base64.b64encode(payload).decode()
    assert time.monotonic() - started < 30


@lab
def test_put_get_round_trip_with_sha256(rig: SshClient, rig_tmp: str, tmp_path: Path) -> None:
    data = os.urandom(5 << 20)
    local = tmp_path / "model.gguf"
    local.write_bytes(data)
    local.chmod(0o640)
    digest = hashlib.sha256(data).hexdigest()
    remote = f"{rig_tmp}/models/model.gguf"
    rig.run(f"mkdir {rig_tmp}/models", timeout=10)

    sent = rig.put(local, remote, timeout=60)
    assert (sent.host, sent.path, sent.size, sent.sha256) == ("desktop", remote, len(data), digest)
    assert rig.sha256(remote, timeout=30) == digest
    assert rig.run(f"stat -c %a {remote}; ls -A {rig_tmp}/models", timeout=10).stdout == "640\nmodel.gguf\n"

    got = rig.get(remote, tmp_path / "pulled" / "copy.gguf", timeout=60, sha256=digest.upper())
    assert (got.path, got.size, got.sha256) == (str(tmp_path / "pulled" / "copy.gguf"), len(data), digest)
    assert Path(got.path).read_bytes() == data
    assert os.listdir(tmp_path / "pulled") == ["copy.gguf"]


@lab
def test_get_refuses_wrong_sha256_and_leaves_no_file(rig: SshClient, rig_tmp: str, tmp_path: Path) -> None:
    remote = f"{rig_tmp}/result.json"
    rig.run(f"echo '{{\"tok_s\": 41.5}}' > {remote}", timeout=10)
    wrong = "0" * 64
    with pytest.raises(TransferError) as info:
        rig.get(remote, tmp_path / "result.json", timeout=30, sha256=wrong)
    assert (info.value.host, info.value.path) == ("desktop", remote)
    assert str(info.value).startswith(f"desktop: {remote}: sha256 is ")
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(TransferError, match=rf"^desktop: {rig_tmp}/absent: no such file$"):
        rig.get(f"{rig_tmp}/absent", tmp_path / "absent", timeout=30)
    assert list(tmp_path.iterdir()) == []


@lab
def test_different_key_in_known_hosts_is_refused(desktop: SshTarget, tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"{known_hosts_name(desktop.address, desktop.port)} {_ssh_keygen(tmp_path / 'k')}\n")
    client = SshClient(dataclasses.replace(desktop, known_hosts=known_hosts), retries=3, backoff_base=2)
    started = time.monotonic()
    with pytest.raises(HostKeyError) as info:
        client.run("touch /tmp/rigctl-must-not-exist", timeout=10)
    assert time.monotonic() - started < 1  # failed at once: never retried
    assert f"differs from the one in {known_hosts}" in str(info.value)
    assert str(info.value).startswith("desktop: host key rejected: ")
    assert not client.connected
    with SshClient(desktop) as trusted:
        assert trusted.run("test -e /tmp/rigctl-must-not-exist", timeout=10, check=False).rc == 1


@lab
def test_unknown_host_is_refused_and_never_added(desktop: SshTarget, tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("# nothing known\n")
    before = known_hosts.stat()
    client = SshClient(dataclasses.replace(desktop, known_hosts=known_hosts), retries=3, backoff_base=2)
    with pytest.raises(HostKeyError, match=re.escape(f"no key for {desktop.address} or desktop in {known_hosts} (")):
        client.connect()
    assert not client.connected
    assert known_hosts.read_text() == "# nothing known\n"
    assert known_hosts.stat().st_mtime_ns == before.st_mtime_ns
    assert sorted(os.listdir(tmp_path)) == ["known_hosts"]


@lab
def test_entry_under_the_inventory_name_vouches_for_the_host(desktop: SshTarget, tmp_path: Path) -> None:
    keys = [line.split()[1:3] for line in desktop.known_hosts.read_text().splitlines() if line.strip()]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("".join(f"desktop {kind} {blob}\n" for kind, blob in keys))
    with SshClient(dataclasses.replace(desktop, known_hosts=known_hosts)) as client:
        assert client.run("hostname", timeout=10).stdout == "desktop\n"


@lab
def test_changed_host_key_on_the_rig_is_refused(desktop: SshTarget) -> None:
    with SshClient(desktop) as old:  # this session survives sshd reloading
        fingerprints = old.run(
            "for k in $(sshd -T | awk '$1 == \"hostkey\" {print $2}'); do ssh-keygen -l -f $k.pub; done",
            timeout=10,
        ).stdout
        try:
            old.run(ROTATE_HOST_KEYS, timeout=30)
            new = old.run(
                "for k in $(sshd -T | awk '$1 == \"hostkey\" {print $2}'); do ssh-keygen -l -f $k.pub; done",
                timeout=10,
            ).stdout
            assert new != fingerprints
            fresh = SshClient(desktop, retries=5, backoff_base=0.2)  # sshd may refuse while it reloads
            with pytest.raises(HostKeyError) as info:
                fresh.connect()
            assert f"differs from the one in {desktop.known_hosts}" in str(info.value)
            presented = re.search(r"\((SHA256:[^)]+)\)", str(info.value))
            assert presented and presented[1] in new and presented[1] not in fingerprints
        finally:
            old.run(RESTORE_HOST_KEYS, timeout=30)
    with SshClient(desktop, retries=5, backoff_base=0.2) as restored:
        assert restored.run("hostname", timeout=10).stdout == "desktop\n"


@lab
def test_nothing_listening_on_rig_port_fails_after_bounded_retries(desktop: SshTarget) -> None:
    client = SshClient(dataclasses.replace(desktop, port=2), retries=2, backoff_base=0.2, connect_timeout=3)
    started = time.monotonic()
    with pytest.raises(ConnectError, match=r"^desktop: cannot connect: connection refused \(after 3 attempts\)$"):
        client.connect()
    assert 0.3 <= time.monotonic() - started < 5
