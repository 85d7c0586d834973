"""A provision killed between writing a server's files and restarting it (issue 42): the next provision
settles it, judging by what runs rather than by what it wrote itself, and `rigctl servers` says so in
between."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from benchlab import RIGCTL, cli_env, served_inventory
from process_support import descendants, still_running

from rigctl.fleet.deploy import run_playbook
from rigctl.fleet.servers import list_servers
from rigctl.forward import server_endpoint
from rigctl.inventory import Inventory
from rigctl.ssh import SshClient, SshTarget

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "inventory" / "lab"
#: The play's watchdog: it outlives the controller on purpose, to stop the rest.
WATCHDOG = "rigctl.fleet.tether"
#: The first task after every instance's files are written and before any restart.
AFTER_THE_FILES = "TASK Find instances the inventory no longer has"


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Inventory:
    return served_inventory(request)


def _remote(inventory: Inventory, host: str, cmd: str) -> str:
    with SshClient(SshTarget.from_host(inventory.host(host))) as ssh:
        return ssh.run(cmd, timeout=120, check=True).stdout


def _n_ctx(inventory: Inventory) -> int:
    server = inventory.host("desktop").server("smollm2")
    props = httpx.get(f"http://{inventory.host('desktop').address}:{server.port}/props", timeout=30,
                      headers=server_endpoint(inventory.host("desktop"), server).headers()).json()
    return int(props["default_generation_settings"]["n_ctx"])


def _with_ctx_size(dest: Path, ctx_size: int) -> Path:
    """A copy of the lab inventory whose profile ``lab`` has ``ctx_size``."""
    shutil.copytree(LAB, dest)
    servers_yml = dest / "group_vars" / "all" / "servers.yml"
    data = yaml.safe_load(servers_yml.read_text())
    data["llama_server_profiles"]["lab"]["ctx_size"] = ctx_size
    servers_yml.write_text(yaml.safe_dump(data))
    return dest


def _provision_killed_after_the_files(inventory: Path, env: dict[str, str]) -> str:
    """`rigctl provision` on desktop's servers, its controller SIGKILLed once the files are written (its play
    held still first, so that nothing after that task runs); returns what it printed."""
    argv = [*RIGCTL, "-i", str(inventory), "provision", "--limit", "desktop", "--tags", "llama_server"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    frozen: dict[int, str] = {}
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(AFTER_THE_FILES):
                frozen = descendants(proc.pid, but=WATCHDOG)
                for pid in frozen:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGSTOP)
                os.kill(proc.pid, signal.SIGKILL)  # the operator's kill -9
                break
        else:
            raise AssertionError("the play ended before writing the files:\n" + "".join(lines))
        proc.wait(timeout=30)
        killed = time.monotonic()
        while still_running(frozen):  # the watchdog ends the rest of the play
            assert time.monotonic() - killed < 60, still_running(frozen)
            time.sleep(0.2)
    finally:
        for pid in still_running(frozen):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return "".join(lines)


@pytest.mark.lab
@pytest.mark.timeout(900)
def test_a_provision_killed_before_the_restart_is_settled_by_the_next(served: Inventory, tmp_path: Path) -> None:
    changed = _with_ctx_size(tmp_path / "lab", 1024)
    env = {**cli_env(tmp_path), "RIGCTL_CACHE_DIR": str(tmp_path / "cache")}
    assert _n_ctx(served) == 2048
    try:
        output = _provision_killed_after_the_files(changed, env)
        assert "-c 1024" in _remote(served, "desktop", "cat /etc/llama-server/smollm2.args"), output
        assert _n_ctx(served) == 2048  # written, not applied

        rows = {row.name: row for row in list_servers(Inventory.load(changed), "desktop")}
        assert rows["smollm2"].pending_restart == ("arguments",), rows["smollm2"]
        assert rows["smollm2"].healthy
        shown = subprocess.run([*RIGCTL, "-i", str(changed), "servers", "--limit", "desktop"], capture_output=True,
                               text=True, env=env, cwd=REPO, timeout=120)
        smollm2_line = next(line for line in shown.stdout.splitlines() if " smollm2 " in line)
        assert "active pending restart" in smollm2_line, shown.stdout  # the table may wrap "(arguments)" below

        checked = subprocess.run([*RIGCTL, "-i", str(changed), "provision", "--limit", "desktop", "--tags",
                                  "llama_server", "--check"], capture_output=True, text=True, env=env, cwd=REPO,
                                 timeout=600)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "pending restart: smollm2 (arguments)" in checked.stdout, checked.stdout
        assert _n_ctx(served) == 2048  # a check changes nothing

        settled = subprocess.run([*RIGCTL, "-i", str(changed), "provision", "--limit", "desktop", "--tags",
                                  "llama_server"], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
        assert settled.returncode == 0, settled.stdout + settled.stderr
        assert _n_ctx(served) == 1024
        rows = {row.name: row for row in list_servers(Inventory.load(changed), "desktop")}
        assert rows["smollm2"].pending_restart == () and rows["smollm2"].healthy, rows["smollm2"]

        pid = rows["smollm2"].main_pid
        again = subprocess.run([*RIGCTL, "-i", str(changed), "provision", "--limit", "desktop", "--tags",
                                "llama_server"], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
        assert again.returncode == 0, again.stdout + again.stderr
        after = {row.name: row for row in list_servers(Inventory.load(changed), "desktop")}
        assert after["smollm2"].main_pid == pid  # settled: nothing restarted
    finally:
        run_playbook(served, "site.yml", limit="desktop", tags=["llama_server"]).raise_for_failures()
    assert _n_ctx(served) == 2048
