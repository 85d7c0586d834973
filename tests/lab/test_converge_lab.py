"""A provision killed between writing a server's files and restarting it (issue 42): the next provision
settles it, judging by what runs rather than by what it wrote itself, and `rigctl servers` says so in
between."""

from __future__ import annotations

import contextlib
import json
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
from labrigs_support import SECOND_BUILD_VARS
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
INSTALL_ROOT = "/opt/llama.cpp"
#: The quantised artifact of the lab's catalog: made with llama-quantize, so keyed on the build.
QUANTISED = "/var/lib/rigctl/models/smollm2-135m-q4_0.gguf"


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Inventory:
    return served_inventory(request)


def _remote(inventory: Inventory, host: str, cmd: str) -> str:
    with SshClient(SshTarget.from_host(inventory.host(host))) as ssh:
        return ssh.run(cmd, timeout=120, check=True).stdout


def _props(inventory: Inventory) -> dict:
    server = inventory.host("desktop").server("smollm2")
    return httpx.get(f"http://{inventory.host('desktop').address}:{server.port}/props", timeout=30,
                     headers=server_endpoint(inventory.host("desktop"), server).headers()).json()


def _n_ctx(inventory: Inventory) -> int:
    return int(_props(inventory)["default_generation_settings"]["n_ctx"])


def _with_ctx_size(dest: Path, ctx_size: int) -> Path:
    """A copy of the lab inventory whose profile ``lab`` has ``ctx_size``."""
    shutil.copytree(LAB, dest)
    servers_yml = dest / "group_vars" / "all" / "servers.yml"
    data = yaml.safe_load(servers_yml.read_text())
    data["llama_server_profiles"]["lab"]["ctx_size"] = ctx_size
    servers_yml.write_text(yaml.safe_dump(data))
    return dest


def _provision_killed_after_the_files(inventory: Path, env: dict[str, str], *options: str) -> str:
    """`rigctl provision --limit desktop OPTIONS`, its controller SIGKILLed once the servers' files are written
    (its play held still first, so that nothing after that task runs); returns what it printed."""
    argv = [*RIGCTL, "-i", str(inventory), "provision", "--limit", "desktop", *options]
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
        output = _provision_killed_after_the_files(changed, env, "--tags", "llama_server")
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


def _with_second_build(dest: Path) -> Path:
    """A copy of the lab inventory that pins the lab's second build (the same source, another stamp)."""
    shutil.copytree(LAB, dest)
    (dest / "group_vars" / "all" / "second_build.yml").write_text(yaml.safe_dump(SECOND_BUILD_VARS))
    return dest


def _current_build(inventory: Inventory) -> str:
    return _remote(inventory, "desktop", f"readlink {INSTALL_ROOT}/current").strip()


def _quantised_manifest(inventory: Inventory) -> dict:
    return json.loads(_remote(inventory, "desktop", f"cat {QUANTISED}.manifest.json"))


def _settled(inventory: Inventory, what: str) -> None:
    """One full provision of desktop that succeeds; then another that changes nothing (so the first left nothing
    to quantise again, no link to move, no server to restart)."""
    first = run_playbook(inventory, "site.yml", limit="desktop", timeout=1800)
    assert first.succeeded, (what, first.failures())
    again = run_playbook(inventory, "site.yml", limit="desktop", timeout=1800)
    assert again.succeeded and again.hosts["desktop"].changed == 0, (what, again.hosts["desktop"])


@pytest.mark.lab
@pytest.mark.timeout(3000)
def test_a_provision_killed_after_a_build_switch_is_settled_by_the_next(served: Inventory, tmp_path: Path) -> None:
    """The build switch of the issue: a provision to the second build killed after the servers' links point at it,
    before the restart. The server runs the old binary (`pending restart (binary)`); the next single provision
    serves the new build and quantises nothing again (the killed play's models role already judged its
    artifacts against the build that play made current). Switching back is one provision too, after which a
    provision changes nothing."""
    switched = _with_second_build(tmp_path / "lab")
    env = cli_env(tmp_path)
    original, original_info = _current_build(served), _props(served)["build_info"]
    stamp = SECOND_BUILD_VARS["llama_cpp_build_commit"]
    try:
        output = _provision_killed_after_the_files(switched, env)
        new = _current_build(served)
        assert new != original, output
        link = _remote(served, "desktop", "readlink -f /etc/llama-server/smollm2.bin").strip()
        assert link == f"{INSTALL_ROOT}/{new}/bin/llama-server", output
        assert _props(served)["build_info"] == original_info  # linked, not run
        # The killed play's models role quantised against the build that play made current, not the one its
        # facts said when it started.
        made = _quantised_manifest(served)
        assert made["llama_cpp"]["name"] == new, made["llama_cpp"]

        rows = {row.name: row for row in list_servers(Inventory.load(switched), "desktop")}
        assert rows["smollm2"].pending_restart == ("binary",), rows["smollm2"]
        shown = subprocess.run([*RIGCTL, "-i", str(switched), "servers", "--limit", "desktop"], capture_output=True,
                               text=True, env=env, cwd=REPO, timeout=120)
        smollm2_line = next(line for line in shown.stdout.splitlines() if " smollm2 " in line)
        assert "active pending restart" in smollm2_line, shown.stdout

        said: list[str] = []
        settled = run_playbook(Inventory.load(switched), "site.yml", limit="desktop", timeout=1800,
                               on_event=lambda event: said.append(f"{event.task}: {event.status}"))
        assert settled.succeeded, settled.failures()
        assert _props(served)["build_info"].endswith(f"-{stamp}"), _props(served)
        assert _quantised_manifest(served) == made, said  # not quantised again
        rows = {row.name: row for row in list_servers(Inventory.load(switched), "desktop")}
        assert rows["smollm2"].pending_restart == () and rows["smollm2"].healthy, rows["smollm2"]
        again = run_playbook(Inventory.load(switched), "site.yml", limit="desktop", timeout=1800)
        assert again.succeeded and again.hosts["desktop"].changed == 0, again.hosts["desktop"]

        # The upgrade back to the inventory's build, uninterrupted: one provision quantises against the build it
        # makes current, and the next has nothing left to do.
        _settled(served, "back to the inventory's build")
        assert _current_build(served) == original
        assert _props(served)["build_info"] == original_info
        assert _quantised_manifest(served)["llama_cpp"]["name"] == original
    finally:
        if _current_build(served) != original:
            run_playbook(served, "site.yml", limit="desktop", timeout=1800).raise_for_failures()
    assert _current_build(served) == original
