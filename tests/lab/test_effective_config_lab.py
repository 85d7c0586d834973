"""The effective configuration is rigctl's (issue #36), on a real lab rig: a /etc/llama.cpp/config.ini and a
user-level one in the service's old home (``n-predict = 5``), and LLAMA_ARG_* variables from a systemd
drop-in, change nothing the rigctl-started server does, while the same binary started by hand stops every
reply at 5 tokens; provision refuses the file in one line; `hosts probe`, the exporter's metric and `rigctl
servers` show it; the stamp says no config file and no llama.cpp variable reached the server. Everything
planted is removed and the server restarted as it was (other lab tests share the rigs)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rigctl.forward import server_endpoint
from rigctl.inventory import Inventory

REPO = Path(__file__).resolve().parents[2]
RIGCTL = str(Path(sys.executable).parent / "rigctl")
SYSTEM_CONFIG = "/etc/llama.cpp/config.ini"
USER_CONFIG = "/var/lib/llama-server/.config/llama.cpp/config.ini"  # the unit's HOME before the fix
DROP_IN = "/etc/systemd/system/llama-server@smollm2.service.d/zz-effective-config-test.conf"
HAND_PORT = 18097
HAND_UNIT = "rigctl-test-hand-server"
PROMPT = "List the numbers from one to forty, separated by commas:"


def rigctl(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RIGCTL, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "250"})


#: Enough tokens to tell a reply cut at 5 (or 7) from one that goes on: reading stops there.
ENOUGH = 12


def predicted(url: str, headers: dict[str, str]) -> int:
    """Tokens the server generates for PROMPT at its own default length (no n_predict in the request: the
    server's -n, or a config file's n-predict, decides), up to :data:`ENOUGH` (then the stream is closed)."""
    import json

    body = {"prompt": PROMPT, "temperature": 0, "seed": 1, "stream": True}
    streamed = 0
    with httpx.stream("POST", f"{url}/completion", json=body, headers=headers, timeout=120) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("stop"):
                return int(chunk["timings"]["predicted_n"])
            streamed += 1
            if streamed >= ENOUGH:
                return streamed
    return streamed


@pytest.fixture
def planted(lab_served: Inventory):
    from rigctl.ssh import SshClient

    host = lab_served.host("desktop")
    ssh = SshClient.for_host(host)
    plant = (f"mkdir -p /etc/llama.cpp {shlex.quote(os.path.dirname(USER_CONFIG))} {os.path.dirname(DROP_IN)}"
             f" && printf 'n-predict = 5\\n' > {SYSTEM_CONFIG} && printf 'n-predict = 5\\n' > {USER_CONFIG}"
             f" && printf '[Service]\\nEnvironment=LLAMA_ARG_CTX_SIZE=64 LLAMA_ARG_N_PREDICT=7\\n' > {DROP_IN}"
             " && systemctl daemon-reload")
    ssh.run(plant, timeout=60, check=True)
    try:
        yield lab_served, host, ssh
    finally:
        ssh.run(f"rm -rf /etc/llama.cpp {os.path.dirname(USER_CONFIG)} {os.path.dirname(DROP_IN)}; "
                f"rmdir {os.path.dirname(os.path.dirname(USER_CONFIG))}; "
                f"systemctl stop {HAND_UNIT} 2>/dev/null; systemctl daemon-reload; "
                "systemctl restart llama-server@smollm2.service", timeout=120, check=False)
        ssh.close()


def test_a_planted_config_file_and_variables_change_nothing_rigctl_starts(planted) -> None:
    from rigctl.fleet.servers import deployed_argv
    from rigctl.fleet.state import FleetState, HostPlan
    from rigctl.results.stamp import collect_stamp, inventory_server
    from rigctl.services.exporter import Snapshot, exposition, metric_families

    inventory, host, ssh = planted
    server = host.server("smollm2")
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    restarted = rigctl("servers", "restart", "desktop", "smollm2")
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr

    # Without the fix: the same binary and flags started by hand, as root with root's HOME, no sandbox and
    # the drop-in's variable (a transient unit only so that it outlives this SSH command) read the config
    # file and stop every reply at 5 tokens.
    argv = [a if a != str(server.port) else str(HAND_PORT) for a in deployed_argv(ssh, server)]
    hand = shlex.join(["systemd-run", "--unit", HAND_UNIT, "--collect", "--quiet", "-p", "Environment=HOME=/root",
                       "-p", "Environment=LLAMA_ARG_CTX_SIZE=64", server.binary, *argv])
    ssh.run(hand, timeout=60, check=True)
    hand_url = f"http://{host.address}:{HAND_PORT}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{hand_url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    assert predicted(hand_url, headers) == 5
    hand_log = ssh.run(f"journalctl -o cat --no-pager -u {HAND_UNIT} | head -n 200", timeout=30).stdout
    assert f"using config file: {SYSTEM_CONFIG}" in hand_log
    ssh.run(f"systemctl stop {HAND_UNIT}", timeout=60, check=True)

    # With it: the unit's server replies at its own length, and its record says nothing else configured it.
    assert predicted(server_endpoint(host, server).url, headers) == ENOUGH
    stamp = collect_stamp(host, ssh, [inventory_server(host, "smollm2")])
    (stamped,) = stamp.servers
    assert stamped.argv and stamped.config_files == [] and stamped.environment == []
    # What the stamp read is the server's own journal: from its start to the request above, no config file.
    head = ssh.run(f"journalctl -o cat --no-pager _PID={stamped.pid} | head -n 400", timeout=30).stdout
    assert "processing task" in head and "using config file" not in head

    # Drift, said: provision refuses the host in one line naming it and the file; hosts probe, servers and the
    # exporter show it.
    refused = rigctl("provision", "--limit", "desktop", "--tags", "llama_cpp_build")
    assert refused.returncode != 0
    lines = [line for line in (refused.stdout + refused.stderr).splitlines()
             if f"desktop: {SYSTEM_CONFIG}: a llama.cpp config file" in line]
    assert lines, refused.stdout[-3000:] + refused.stderr[-2000:]
    probed = rigctl("hosts", "probe", "desktop")
    assert probed.returncode == 1 and f"llama.cpp config file {SYSTEM_CONFIG}" in probed.stdout, probed.stdout
    listing = rigctl("servers", "--limit", "desktop")
    assert "config file on" in listing.stdout and SYSTEM_CONFIG in listing.stdout, listing.stdout  # cells wrap
    from rigctl.fleet.servers import list_servers

    marked = {row.name: row.config_files for row in list_servers(inventory, "desktop") if row.state == "active"}
    assert marked == {"smollm2": (SYSTEM_CONFIG,)}
    state = FleetState(inventory, limit="desktop")
    try:
        hosts = state.read()
    finally:
        state.close()
    assert hosts["desktop"].config_files == (SYSTEM_CONFIG,)
    text = exposition(metric_families(Snapshot(time.time(), 0.0, hosts),
                                      {"desktop": HostPlan.from_host(host)})).decode()
    assert f'rigctl_llama_cpp_config_file{{host="desktop",path="{SYSTEM_CONFIG}"}} 1.0' in text
