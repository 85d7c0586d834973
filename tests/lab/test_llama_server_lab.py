"""roles/llama_server and rigctl.fleet.servers on the lab rigs: units, idempotence, targeted restarts, crash and
reboot recovery, a failed rollout's rollback, the API key.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from labrigs_support import wait_healthy

from rigctl.errors import DeployError
from rigctl.fleet.deploy import run_playbook
from rigctl.fleet.servers import list_servers, restart, unit_states
from rigctl.forward import server_endpoint
from rigctl.inventory import Inventory
from rigctl.llama_http import Endpoint, ServerClient
from rigctl.ssh import SshClient, SshTarget

ROLE = Path(__file__).resolve().parents[2] / "roles" / "llama_server"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


# ----------------------------------------------------------------------------------------------- lab helpers


def _remote(inv: Inventory, host: str, cmd: str, timeout: float = 60.0) -> str:
    with SshClient(SshTarget.from_host(inv.host(host))) as ssh:
        return ssh.run(cmd, timeout=timeout, check=True).stdout


def _pids(inv: Inventory, host: str, names: list[str]) -> dict[str, int]:
    return {name: state.main_pid for name, state in unit_states(inv.host(host), names).items()}


def _ask(inv: Inventory, host: str, server: str, api_key: str | None = None, port: int | None = None) -> str:
    """A greedy answer of instance ``server`` (or whatever listens on ``port``) on ``host``."""
    endpoint = Endpoint(f"http://{inv.host(host).address}:{port}", api_key) if port else \
        server_endpoint(inv.host(host), inv.host(host).server(server))
    with ServerClient(endpoint) as client:
        return client.chat(QUESTION, max_tokens=16).content


def _expected_build(inv: Inventory) -> str:
    pin = next(iter(inv.hosts.values())).llama_cpp.version  # b11434
    return f"b{pin.removeprefix('b')}-{pin}"


# ----------------------------------------------------------------------------------------------- lab


@pytest.mark.lab
def test_units_serve_the_pinned_build_and_answer(lab_served: Inventory) -> None:
    rows = [r for r in list_servers(lab_served) if r.enabled]
    assert {(r.host, r.name) for r in rows} >= {("desktop", "smollm2"), ("laptop", "smollm2")}
    for row in rows:
        assert row.state == "active" and row.main_pid > 0, row
        assert row.healthy and row.health == "ok", row
        assert row.build == _expected_build(lab_served), row
        assert row.model == f"/var/lib/rigctl/models/{row.artifact}.gguf", row
    for host in ("desktop", "laptop"):
        assert _ask(lab_served, host, "smollm2").strip()
        hardening = _remote(lab_served, host, "systemctl show -p ProtectSystem,PrivateDevices,NoNewPrivileges,User,"
                                              "DevicePolicy llama-server@smollm2.service").split()
        assert sorted(hardening) == ["DevicePolicy=closed", "NoNewPrivileges=yes", "PrivateDevices=no",
                                     "ProtectSystem=strict", "User=llama"]


@pytest.mark.lab
def test_operator_restarts_beyond_the_start_limit_burst(lab_served: Inventory) -> None:
    """systemd's StartLimitBurst counts every start; restarts an operator asks for must not trip it."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    burst = int(lab_served.host("desktop").vars.get("llama_server_start_limit_burst",
                                                    defaults["llama_server_start_limit_burst"]))
    pids = set()
    for _ in range(burst + 2):
        status = restart(lab_served, "desktop", "smollm2")
        assert status.state == "active" and status.healthy, status
        pids.add(status.main_pid)
    assert len(pids) == burst + 2  # every restart was a real one


@pytest.mark.lab
def test_second_provision_restarts_nothing(lab_served: Inventory) -> None:
    before = {h: _pids(lab_served, h, ["smollm2"]) for h in ("desktop", "laptop")}
    result = run_playbook(lab_served, "site.yml", tags=["llama_server"])
    result.raise_for_failures()
    assert {h: o.changed for h, o in result.hosts.items()} == {"desktop": 0, "laptop": 0}
    assert {h: _pids(lab_served, h, ["smollm2"]) for h in ("desktop", "laptop")} == before


def _extravars(inv: Inventory, lab_b: dict[str, Any], api_key: str) -> dict[str, Any]:
    """The lab's servers plus instance smollm2-b (profile lab-b) and an API key: test-only, as extra
    vars, so the shared inventory never changes."""
    v = inv.host("desktop").vars
    profiles = {**v["llama_server_profiles"], "lab-b": {"extends": "lab", **lab_b}}
    instances = {**v["llama_server_instances"],
                 "smollm2-b": {"artifact": "smollm2-135m-q4_1", "profile": "lab-b", "port": 8095}}
    return {"llama_server_profiles": profiles, "llama_server_instances": instances, "llama_server_api_key": api_key}


@pytest.mark.lab
def test_targeted_restart_failed_rollout_and_api_key(lab_served: Inventory) -> None:
    inv, key = lab_served, "lab-key-5f1d"
    try:
        # A second instance and an API key: every instance restarts (the key is theirs too).
        run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"],
                     extravars=_extravars(inv, {}, key)).raise_for_failures()
        base = f"http://{inv.host('desktop').address}"
        import httpx

        assert httpx.get(f"{base}:8080/health", timeout=10).status_code == 200
        assert httpx.get(f"{base}:8080/props", timeout=10).status_code == 401
        assert httpx.get(f"{base}:8080/props", timeout=10,
                         headers={"Authorization": f"Bearer {key}"}).status_code == 200
        key_file = _remote(inv, "desktop", "stat -c '%U %a' /etc/llama-server/api-key").strip()
        assert key_file == "root 640"

        # One profile flag changes: only its instance restarts.
        before = _pids(inv, "desktop", ["smollm2", "smollm2-b"])
        run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"],
                     extravars=_extravars(inv, {"ctx_size": 1024}, key)).raise_for_failures()
        after = _pids(inv, "desktop", ["smollm2", "smollm2-b"])
        assert after["smollm2"] == before["smollm2"]
        assert after["smollm2-b"] not in (0, before["smollm2-b"])
        answer = _ask(inv, "desktop", "smollm2-b", key, port=8095)

        # A broken flag: the rollout fails naming the instance with its journal, the previous
        # configuration is back and answers the same.
        with pytest.raises(DeployError) as failed:
            run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"],
                         extravars=_extravars(inv, {"ctx_size": 1024, "extra_args": ["--no-such-flag"]}, key)
                         ).raise_for_failures()
        message = str(failed.value)
        assert "llama-server@smollm2-b failed its rollout" in message
        assert "previous configuration restored and serving" in message
        assert "invalid argument: --no-such-flag" in message  # from the journal tail
        args = _remote(inv, "desktop", "cat /etc/llama-server/smollm2-b.args")
        assert "-c 1024" in args and "--no-such-flag" not in args
        assert _ask(inv, "desktop", "smollm2-b", key, port=8095) == answer
        assert _pids(inv, "desktop", ["smollm2"])["smollm2"] == before["smollm2"]
    finally:
        # The inventory as it is: smollm2-b goes away, the key file holds the inventory's key again.
        run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"]).raise_for_failures()
    key_file = ["api-key"] if inv.host("desktop").vars.get("llama_server_api_key") else []
    assert _remote(inv, "desktop", "ls /etc/llama-server").split() == sorted(
        [*key_file, *(f"{s.name}.{ext}" for s in inv.host("desktop").servers for ext in ("args", "bin", "env"))])
    assert unit_states(inv.host("desktop"), ["smollm2-b"])["smollm2-b"].active_state == "inactive"
    wait_healthy(inv)


@pytest.mark.lab
def test_systemd_restarts_a_killed_server(lab_served: Inventory) -> None:
    old = _pids(lab_served, "laptop", ["smollm2"])["smollm2"]
    _remote(lab_served, "laptop", f"kill -9 {old}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = unit_states(lab_served.host("laptop"), ["smollm2"])["smollm2"]
        if state.active_state == "active" and state.main_pid not in (0, old):
            break
        time.sleep(0.5)
    assert state.main_pid not in (0, old) and state.n_restarts >= 1, state
    wait_healthy(lab_served, timeout=60)
    assert _ask(lab_served, "laptop", "smollm2").strip()


@pytest.mark.lab
def test_servers_come_back_after_a_reboot(lab_served: Inventory) -> None:
    from rigctl.errors import RigctlError

    # PID 1's start time (in ticks since the machine booted) changes when the rig's systemd restarts.
    boot = "cut -d' ' -f22 /proc/1/stat"
    boot_id = _remote(lab_served, "laptop", boot).strip()
    with SshClient(SshTarget.from_host(lab_served.host("laptop"))) as ssh:
        ssh.run("systemctl reboot", timeout=30, check=False)
    deadline = time.monotonic() + 180
    new_boot = boot_id
    while time.monotonic() < deadline and new_boot == boot_id:
        time.sleep(2)
        try:
            new_boot = _remote(lab_served, "laptop", boot, timeout=10).strip()
        except RigctlError:
            continue
    assert new_boot != boot_id, "the laptop rig did not come back from its reboot"
    wait_healthy(lab_served, timeout=180)
    row = next(r for r in list_servers(lab_served, "laptop") if r.name == "smollm2")
    assert row.state == "active" and row.healthy and row.build == _expected_build(lab_served)


@pytest.mark.lab
def test_a_busy_server_stops_within_its_stop_timeout(lab_served: Inventory) -> None:
    """llama-server keeps generating after SIGTERM; the unit gives it llama_server_stop_timeout_sec, then kills
    it: a stop (or a restart, a rollout) never waits longer for one busy server."""
    import threading

    import httpx

    host = lab_served.host("laptop")
    endpoint = server_endpoint(host, host.server("smollm2"))
    outcome: list[str] = []

    def generate() -> None:
        try:
            reply = httpx.post(f"{endpoint.url}/completion", headers=endpoint.headers(), timeout=300,
                               json={"prompt": "Once upon a time", "n_predict": 1900, "ignore_eos": True})
            outcome.append(f"HTTP {reply.status_code}")
        except httpx.HTTPError as exc:
            outcome.append(type(exc).__name__)

    busy = threading.Thread(target=generate)
    busy.start()
    timeout = int(_remote(lab_served, "laptop", "systemctl show -p TimeoutStopUSec --value llama-server@smollm2")
                  .strip().removesuffix("s"))
    assert timeout == 5  # llama_server_stop_timeout_sec's default
    time.sleep(2)  # generating now
    try:
        started = time.monotonic()
        _remote(lab_served, "laptop", "systemctl stop llama-server@smollm2", timeout=120)
        took = time.monotonic() - started
    finally:
        _remote(lab_served, "laptop", "systemctl start llama-server@smollm2", timeout=120)
        busy.join(timeout=300)
    print(f"a busy llama-server stopped in {took:.1f} s (TimeoutStopSec={timeout})")
    assert outcome and not outcome[0].startswith("HTTP"), outcome  # cut off mid-generation: it was busy
    assert took < timeout + 3
    wait_healthy(lab_served)
