"""Lab: a server that listens on its rig's loopback only is measured from the controller through the rig's SSH
connection (rigctl/forward.py): an eval, a server sweep, a load curve, a runtime check and the health probes of
`rigctl servers` and the MCP tools, each against ``smollm2-q4_0`` (profile ``lab-spec``: ``host: 127.0.0.1``);
the drafter race (its pair binds loopback too) is tests/lab/test_bench_lab.py's. A rig whose sshd refuses
forwarding (a second OpenSSH sshd on the rig with ``AllowTcpForwarding no``) fails the command with one
``error:`` line naming the host and the address, before a run starts."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from benchlab import REPO, RIGCTL, cli_env, served_inventory

from rigctl.connections import connections
from rigctl.fleet import servers
from rigctl.forward import server_endpoint
from rigctl.inventory import Host, Inventory
from rigctl.results.store import ResultsStore
from rigctl.ssh import SshClient, SshTarget

pytestmark = pytest.mark.lab

HOST = "desktop"
SERVER = "smollm2-q4_0"  # off by default; started for this module, stopped after
REFUSING_PORT = 2222  # the rig's second sshd, with AllowTcpForwarding no


@pytest.fixture(scope="module")
def lab(request: pytest.FixtureRequest) -> Inventory:
    return served_inventory(request)


@pytest.fixture(scope="module")
def loopback(lab: Inventory) -> Iterator[Host]:
    """The loopback-bound instance running (started, waited for through a forward, stopped after), inside one
    connections scope for the module, as a command has: the tests' own library calls use it."""
    host = lab.host(HOST)
    assert host.server(SERVER).bind == "127.0.0.1"
    with connections(), servers.running(host, [SERVER]):
        yield host


def rigctl(results: Path, *args: str, inventory: Path | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = cli_env(results)
    if inventory is not None:
        env["RIGCTL_INVENTORY"] = str(inventory)
    return subprocess.run([*RIGCTL, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO,
                          check=False)


def test_the_instance_answers_its_rig_only(loopback: Host) -> None:
    port = loopback.server(SERVER).port
    with pytest.raises(httpx.ConnectError):  # nothing listens on the bridge: the port is closed from here
        httpx.get(f"http://{loopback.address}:{port}/health", timeout=5)
    endpoint = server_endpoint(loopback, loopback.server(SERVER))
    assert endpoint.url == f"http://127.0.0.1:{port}" and endpoint.via and endpoint.via != endpoint.url
    assert httpx.get(f"{endpoint.via}/health", timeout=10).json() == {"status": "ok"}


def test_eval_through_the_forward(loopback: Host, tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").write_text("".join(
        json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}) + "\n"
        for i in (2, 3)))
    task = tmp_path / "sums.yaml"
    task.write_text("name: sums\nscorer: gsm8k\ndataset: {path: data.jsonl}\nprompt: '{question}'\nmax_tokens: 8\n")
    done = rigctl(tmp_path, "eval", "run", "--host", HOST, "--server", SERVER, "--task", str(task))
    assert done.returncode == 0, done.stdout + done.stderr
    [run] = list(ResultsStore(tmp_path).runs(HOST, kind="eval"))
    answers = [json.loads(line) for line in (run.path / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 2 and all(a["finish_reason"] for a in answers), answers
    # The record names the server as its rig serves it, not the command's forward.
    assert run.record.server.endpoint == f"http://127.0.0.1:{loopback.server(SERVER).port}"
    assert run.record.server.label == f"{HOST}/{SERVER}" and run.record.server.build_info


def test_server_sweep_through_the_forward(loopback: Host, tmp_path: Path) -> None:
    done = rigctl(tmp_path, "bench", "server", HOST, SERVER, "--prompt-lengths", "16", "--max-tokens", "4",
                  "--ctx-sizes", "512")
    assert done.returncode == 0, done.stdout + done.stderr
    [run] = list(ResultsStore(tmp_path).runs(HOST, kind="server-speed"))
    [point] = [json.loads(line) for line in (run.path / "sweep.jsonl").read_text().splitlines()]
    assert point["prompt_tokens"] == 16 and point["ttft_s"] > 0 and point["predicted_n"] == 4
    [load] = [json.loads(line) for line in (run.path / "load.jsonl").read_text().splitlines()]
    assert load["load_s"] > 0  # a restart waited for through the forward
    assert [json.loads(line)["ctx_size"] for line in (run.path / "memory.jsonl").read_text().splitlines()] == [512]


def test_load_curve_through_the_forward(loopback: Host, tmp_path: Path) -> None:
    done = rigctl(tmp_path, "bench", "load", HOST, SERVER, "--concurrency", "1,2", "--requests", "4",
                  "--max-requests", "8", "--precision", "0.5", "--warmup", "1", "--max-tokens", "4",
                  "--slot-ctx", "128", "--level-timeout", "60")
    assert done.returncode == 0, done.stdout + done.stderr
    [run] = list(ResultsStore(tmp_path).runs(HOST, kind="load"))
    requests = [json.loads(line) for line in (run.path / "requests.jsonl").read_text().splitlines()]
    assert {r["level"] for r in requests} == {1, 2} and all(r["ok"] and r["tokens"] == 4 for r in requests)
    # The probe (port + 200) binds loopback as its instance does: it was asked through a forward of its own.
    assert run.record.server.endpoint == f"http://127.0.0.1:{loopback.server(SERVER).port + 200}"


def test_servers_and_the_mcp_health_probe_through_the_forward(lab: Inventory, loopback: Host) -> None:
    from rigctl.services.mcp_server import FleetTools, _tool

    with connections():  # a command's scope, as `rigctl servers` opens
        [row] = [r for r in servers.list_servers(lab, limit=HOST) if r.name == SERVER]
    assert row.state == "active" and row.healthy and row.health == "ok" and row.model, row
    health = _tool(FleetTools(lab).server_health)(HOST, SERVER)  # a tool call opens its own scope
    assert health["healthy"] and health["endpoint"] == f"http://127.0.0.1:{loopback.server(SERVER).port}"
    assert health["props"]["n_ctx"] > 0 and health["props"]["total_slots"] == 1


@pytest.mark.hf_checkout
def test_runtime_check_through_the_forward(loopback: Host, tmp_path: Path) -> None:
    from make_hf_checkout import cache_dir, make_checkout, tools_python

    cache = cache_dir()
    done = rigctl(tmp_path, "check", "template", "--hf", str(make_checkout(cache)), "--python",
                  str(tools_python(cache)), "--host", HOST, "--server", SERVER)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{HOST}/{SERVER}: " in done.stdout and "byte-identical" in done.stdout, done.stdout


@pytest.fixture
def refusing(lab: Inventory, tmp_path: Path) -> Iterator[Path]:
    """A copy of the lab inventory that reaches desktop through a second OpenSSH sshd on the rig, one that
    refuses forwarding (``AllowTcpForwarding no``), with a known_hosts that vouches for it on that port."""
    host = lab.host(HOST)
    unit = "rigctl-test-sshd-noforward"
    with SshClient(SshTarget.from_host(host)) as ssh:
        ssh.run(f"systemd-run --unit {unit} --collect /usr/sbin/sshd -D -e -p {REFUSING_PORT} "
                "-o AllowTcpForwarding=no -o PidFile=none", timeout=60, check=True)
        try:
            known = tmp_path / "known_hosts"
            keys = [line.split(None, 1)[1] for line in host.known_hosts.read_text().splitlines()
                    if host.address in line.split(None, 1)[0].split(",")]
            assert keys, host.known_hosts
            known.write_text("".join(f"[{host.address}]:{REFUSING_PORT} {key}\n" for key in keys))
            inventory = tmp_path / "inventory"
            shutil.copytree(REPO / "inventory" / "lab", inventory)
            with (inventory / "host_vars" / f"{HOST}.yml").open("a") as vars_file:
                vars_file.write(f"ansible_port: {REFUSING_PORT}\nrigctl_known_hosts: {known}\n")
            yield inventory
        finally:
            ssh.run(f"systemctl stop {unit}", timeout=60, check=False)


def test_a_rig_that_refuses_forwarding_is_one_error_line_before_the_run(refusing: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    port = Inventory.load(refusing).host(HOST).server(SERVER).port
    done = rigctl(results, "bench", "server", HOST, SERVER, "--prompt-lengths", "16", inventory=refusing,
                  timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"error: {HOST}: cannot forward to 127.0.0.1:{port} over SSH: the host refused the channel "
        "(administratively prohibited: its sshd's AllowTcpForwarding?)"], done.stderr
    assert not results.exists() or not list(results.rglob("run.json"))  # no run started
