"""Faults on the lab rigs (issues 16 and 28): a tampered model without a pin, a full disk, two checkouts
driving the same rigs, a controller SIGKILLed mid-play, a link that drops mid-provision, a failed rollout of a
profile others extend.

Each fault is made for real (a tmpfs that fills up, a veth downed in the rig's namespace, a second rigctl
process) and undone afterwards; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from benchlab import RIGCTL, cli_env, rigctl, served_inventory
from process_support import descendants, still_running

from rigctl import jobs
from rigctl.bench.matrix import bench_job_spec, load_run_samples, parse_spec
from rigctl.errors import DeployError
from rigctl.fleet.deploy import run_playbook
from rigctl.forward import server_endpoint
from rigctl.inventory import Inventory
from rigctl.lab.rigs import Lab
from rigctl.results.store import ResultsStore
from rigctl.ssh import SshClient, SshTarget

#: The play's watchdog: it outlives the controller on purpose, to stop the rest.
WATCHDOG = "rigctl.fleet.tether"
REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "inventory" / "lab"
A, B = "a" * 64, "b" * 64


# ----------------------------------------------------------------------------------------------- lab


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Inventory:
    return served_inventory(request)


def _remote(inventory: Inventory, host: str, cmd: str, check: bool = True) -> str:
    with SshClient(SshTarget.from_host(inventory.host(host))) as ssh:
        return ssh.run(cmd, timeout=120, check=check).stdout


def _rig_pid(inventory: Inventory, rig: str) -> int:
    """The rig's PID 1 as the controller sees it (for nsenter into its mount namespace)."""
    lab = Lab.from_inventory(inventory)
    nspawn = int(lab._paths(lab.rig(rig)).nspawn_pid.read_text().split()[0])
    children = Path(f"/proc/{nspawn}/task/{nspawn}/children").read_text().split()
    return int(children[0])


@pytest.mark.lab
@pytest.mark.timeout(300)
def test_tampered_model_without_a_pin_fails_verify(served: Inventory) -> None:
    path = "/var/lib/rigctl/models/smollm2-135m-q4_0.gguf"
    _remote(served, "desktop", f"cp -p {path} {path}.orig && printf x >> {path}")
    try:
        done = subprocess.run([*RIGCTL, "-i", str(LAB), "models", "verify", "-l", "desktop"], capture_output=True,
                              text=True, timeout=240, env=cli_env(Path(tempfile.gettempdir())), cwd=REPO)
    finally:
        _remote(served, "desktop", f"mv {path}.orig {path}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"desktop: smollm2-135m-q4_0: no pin, and {path} has" in done.stderr, done.stderr
    assert "1 problems" in done.stderr


@pytest.mark.lab
@pytest.mark.timeout(600)
def test_full_disk_mid_bench_fails_the_cell_and_seals_the_reason(served: Inventory, tmp_path: Path) -> None:
    lab = Lab.from_inventory(served)
    host = served.host("desktop")
    results = f"{jobs.RESULTS_DIR}/desktop"
    pid = _rig_pid(served, "desktop")
    nsenter = ["nsenter", "-t", str(pid), "-m", "--"]
    subprocess.run([*nsenter, "mkdir", "-p", results], check=True, timeout=30)
    subprocess.run([*nsenter, "mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", results], check=True, timeout=30)
    lab.set_gpu("desktop", temperature=85, temperature_sequence=[])  # the job waits here while the disk fills
    try:
        spec = parse_spec({"hosts": ["desktop"], "models": ["smollm2-135m-q4_1"],
                           "matrix": {"p": [16], "n": [4], "r": 1, "t": [1]},
                           "cooldown": {"threshold_c": 40, "timeout_s": 300, "poll_s": 0.5}}, "test")
        job = jobs.start(host, bench_job_spec(host, spec))
        deadline = time.monotonic() + 120
        while "cooling down" not in (jobs.status(host, job.id).message or ""):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        _remote(served, "desktop", f"dd if=/dev/zero of={results}/filler bs=64k 2>/dev/null; true")
        lab.set_gpu("desktop", temperature=35, temperature_sequence=[])
        deadline = time.monotonic() + 300
        while not (info := jobs.status(host, job.id)).finished:
            assert time.monotonic() < deadline, info
            time.sleep(1)
        record = json.loads(_remote(served, "desktop", f"cat {results}/{job.id}/run.json"))
        cells = [json.loads(line) for line in _remote(served, "desktop", f"cat {results}/{job.id}/cells.jsonl",
                                                      check=False).splitlines() if line.strip()]
        _remote(served, "desktop", f"rm -f {results}/filler")
        pulled = rigctl("pull", "desktop", results=tmp_path, timeout=120)
    finally:
        lab.set_gpu("desktop", temperature=35, temperature_sequence=[])
        # The rig's own umount: the controller's, entered into the rig's mount namespace, fails there with
        # ENOENT and left the 4 MiB disk under every later job's results.
        _remote(served, "desktop", f"umount -l {results}", check=False)
    assert f" {results} " not in _remote(served, "desktop", "cat /proc/self/mounts")
    assert record["status"] == "failed", record
    assert "disk full" in record["extra"]["error"], record["extra"]
    assert not cells or cells[-1].get("error") or cells[-1]["rc"] != 0, cells
    assert "Traceback" not in pulled.stdout + pulled.stderr
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    run = ResultsStore(tmp_path).find(f"desktop/{job.id}")
    assert run.record.status == "failed"
    if cells:  # the disk may fill before the first cell is written: then there is no cell to count
        assert load_run_samples(run) == []


def _link(inventory: Inventory, rig: str, state: str) -> None:
    lab = Lab.from_inventory(inventory)
    namespace = lab._tag(lab.rig(rig))
    subprocess.run(["ip", "-n", namespace, "link", "set", "eth0", state], check=True, timeout=30)


@pytest.mark.lab
@pytest.mark.timeout(900)
def test_a_link_dropped_mid_provision_fails_that_host_within_the_ssh_timeouts(served: Inventory,
                                                                             tmp_path: Path) -> None:
    env = {**cli_env(tmp_path), "RIGCTL_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen([*RIGCTL, "-i", str(LAB), "provision"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    dropped = None
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if dropped is None and line.startswith("TASK") and len([x for x in lines if x.startswith("TASK")]) >= 8:
                _link(served, "laptop", "down")
                dropped = time.monotonic()
        proc.wait(timeout=600)
        ended = time.monotonic()
    finally:
        _link(served, "laptop", "up")
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert dropped is not None, output
    print(f"laptop's link dropped: the play ended {ended - dropped:.0f} s later")
    assert proc.returncode == 1, output
    assert "laptop" in output and "unreachable" in output, output[-3000:]
    # Keepalives 5 s x 3 and a 10 s connect timeout: the play is not held for minutes by one dead link.
    assert ended - dropped < 120, (ended - dropped, output[-3000:])
    assert "Traceback" not in output


INSTANCES = ("smollm2", "smollm2-q4_0", "smollm2-q4_0-draft")  # profiles lab, lab-spec (extends lab), lab-draft


def _files(inv: Inventory) -> dict[str, tuple[str, str, str]]:
    """Each lab instance's arguments file, environment file and binary link on the desktop rig."""
    out = _remote(inv, "desktop", "for n in " + " ".join(INSTANCES) + "; do cat /etc/llama-server/$n.args; "
                  "echo @@; cat /etc/llama-server/$n.env; echo @@; readlink /etc/llama-server/$n.bin; echo @@@; done")
    return {name: tuple(part.strip() for part in block.split("@@")) for name, block in  # type: ignore[misc]
            zip(INSTANCES, out.split("@@@")[:-1], strict=True)}


@pytest.mark.lab
@pytest.mark.timeout(900)
def test_failed_rollout_of_a_profile_restores_every_instance_it_changed(served: Inventory) -> None:
    """Profile ``lab`` gets a bad flag (and one instance a new GPU pin, so its environment file changes too): the
    rollout of smollm2 fails, and every instance whose files that step changed — lab-spec and lab-draft extend
    lab, enabled or not — is back to its previous arguments, environment file and binary. Then a step whose
    failure comes second: the instance rolled out before it goes back to its previous flags and is restarted."""
    inv = served
    v = inv.host("desktop").vars
    profiles, instances = v["llama_server_profiles"], v["llama_server_instances"]

    def extravars(lab: dict[str, Any], spec: dict[str, Any] | None = None, pin: bool = False) -> dict[str, Any]:
        changed = {**instances, "smollm2-q4_0": {**instances["smollm2-q4_0"], "enabled": True}}
        if pin:
            changed["smollm2-q4_0-draft"] = {**instances["smollm2-q4_0-draft"], "gpu": 0}
        return {"llama_server_profiles": {**profiles, "lab": {**profiles["lab"], **lab},
                                          "lab-spec": {**profiles["lab-spec"], **(spec or {})}},
                "llama_server_instances": changed}

    def provision(extra: dict[str, Any]) -> None:
        run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"], extravars=extra).raise_for_failures()

    try:
        provision(extravars({"ctx_size": 1024}))
        good = _files(inv)
        assert all("-c 1024" in good[name][0] for name in INSTANCES), good
        with pytest.raises(DeployError) as failed:
            provision(extravars({"ctx_size": 1024, "extra_args": ["--no-such-flag"]}, pin=True))
        message = str(failed.value)
        assert "llama-server@smollm2 failed its rollout" in message, message
        assert "previous configuration restored and serving" in message, message
        assert ("the other instances this run changed are back to their previous files: smollm2-q4_0, "
                "smollm2-q4_0-draft") in message, message
        assert _files(inv) == good
        assert "CUDA_VISIBLE_DEVICES" not in good["smollm2-q4_0-draft"][1]

        # lab changes fine (smollm2 rolls out first), lab-spec breaks (smollm2-q4_0 fails second).
        pid = _pids(inv, ["smollm2"])["smollm2"]
        with pytest.raises(DeployError) as failed:
            provision(extravars({"ctx_size": 1536}, spec={"extra_args": ["--no-such-flag"]}))
        message = str(failed.value)
        assert "llama-server@smollm2-q4_0 failed its rollout" in message, message
        assert "(restarted: smollm2)" in message, message
        assert _files(inv) == good
        assert _pids(inv, ["smollm2"])["smollm2"] not in (0, pid)  # rolled out, then back on its old flags
        desktop = inv.host("desktop")
        props = httpx.get(f"http://{desktop.address}:8080/props", timeout=30,
                          headers=server_endpoint(desktop, desktop.server("smollm2")).headers()).json()
        assert props["default_generation_settings"]["n_ctx"] == 1024, props["default_generation_settings"]
    finally:
        run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"]).raise_for_failures()
    assert all("-c 1024" not in args for args, _, _ in _files(inv).values())


def _pids(inv: Inventory, names: list[str]) -> dict[str, int]:
    from rigctl.fleet.servers import unit_states

    return {name: state.main_pid for name, state in unit_states(inv.host("desktop"), names).items()}


@pytest.mark.lab
@pytest.mark.timeout(900)
def test_two_checkouts_one_play_per_host_and_a_killed_holder_frees_it(served: Inventory, tmp_path: Path) -> None:
    """Two checkouts with copies of the lab inventory, each with its own controller cache (as two users or two
    machines): while the first's play holds the rigs, the second is refused on each rig naming the first's
    holder. The first's rigctl is then SIGKILLed alone (not its group): its play is gone within seconds, the
    rigs' locks with its connections, and the second runs, reporting the stale lock it took over."""
    copies = []
    for name in ("checkout-a", "checkout-b"):
        copy = tmp_path / name / "lab"
        shutil.copytree(LAB, copy)
        copies.append(copy)

    def env(name: str) -> dict[str, str]:
        return {**cli_env(tmp_path), "RIGCTL_CACHE_DIR": str(tmp_path / f"cache-{name}")}

    argv = [*RIGCTL, "-i", str(copies[0]), "provision", "--tags", "llama_server"]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env("a"),
                             cwd=REPO)
    frozen: dict[int, str] = {}
    try:
        assert first.stdout is not None
        lines = []
        for line in first.stdout:  # the lock is taken on both rigs once the next task starts
            lines.append(line)
            if line.startswith("TASK Gather the facts the roles read"):
                break
        else:
            raise AssertionError("".join(lines))
        # Hold the first play where it is (SIGSTOP), its connections open; its watchdog stays awake.
        frozen = descendants(first.pid, but=WATCHDOG)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        holder_file = json.loads(_remote(served, "desktop", "cat /run/rigctl/play.json"))
        assert holder_file["pid"] == first.pid and holder_file["command"].startswith("rigctl -i ")

        second = subprocess.run([*RIGCTL, "-i", str(copies[1]), "provision", "--tags", "llama_server"],
                                capture_output=True, text=True, env=env("b"), cwd=REPO, timeout=300)
        assert second.returncode == 1, second.stdout + second.stderr
        for rig in ("desktop", "laptop"):
            holder = (rf"pid {first.pid} on {re.escape(getpass.getuser())}@{re.escape(socket.gethostname())}"
                      rf"(?: \(\S+\))? \(`rigctl -i {re.escape(str(copies[0]))} provision --tags llama_server`, "
                      rf"since [0-9T:-]+Z\)")
            assert re.search(rf"{rig}: refused: {holder} is running a play against this host",
                             second.stdout + second.stderr), (rig, second.stdout + second.stderr)
        assert "TASK Gather the facts the roles read" not in second.stdout

        killed = time.monotonic()
        os.kill(first.pid, signal.SIGKILL)  # the controller alone: an OOM kill, a closed lid
        first.wait(timeout=30)
        while still_running(frozen):
            assert time.monotonic() - killed < 30, still_running(frozen)
            time.sleep(0.1)
        gone = time.monotonic() - killed
        print(f"the SIGKILLed provision's {len(frozen)} processes were gone {gone:.1f} s after the kill")
        assert gone < 15
    finally:
        for pid in still_running(frozen):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if first.poll() is None:
            first.kill()
    freed = time.monotonic()
    while _remote(served, "desktop", "flock -n /run/rigctl/play.lock true && echo free || echo held",
                  check=False).strip() != "free":
        assert time.monotonic() - freed < 30
        time.sleep(0.2)
    print(f"the rig's play lock was free {time.monotonic() - killed:.1f} s after the kill")

    third = subprocess.run([*RIGCTL, "-i", str(copies[1]), "provision", "--tags", "llama_server"],
                           capture_output=True, text=True, env=env("b"), cwd=REPO, timeout=600)
    assert third.returncode == 0, third.stdout + third.stderr
    assert f"took over the play lock left by pid {first.pid} on" in third.stdout, third.stdout
    # Freed at its end: no holder record, the last play's record with its outcome.
    assert _remote(served, "desktop", "ls /run/rigctl").split() == ["last.json", "play.lock"]
    assert json.loads(_remote(served, "desktop", "cat /run/rigctl/last.json"))["outcome"] == "ok"


@pytest.mark.lab
@pytest.mark.timeout(300)
def test_a_failed_play_frees_its_hosts_saying_so_and_the_next_takes_over_nothing(served: Inventory) -> None:
    """A play that fails on a rig (its servers' settings are not a mapping) releases the rig's lock in the
    block's ``always``, leaving its record with outcome ``failed``; the next play names the failure and takes
    nothing over. The lock directory is root's, 0700."""
    messages: list[str] = []

    def provision(extravars: dict[str, Any] | None = None) -> Any:
        return run_playbook(served, "site.yml", limit="desktop", tags=["llama_server"], extravars=extravars,
                            on_event=lambda event: messages.append(event.message))

    failed = provision({"llama_server_profiles": "not a mapping"})
    assert not failed.hosts["desktop"].succeeded
    assert "play lock" not in (failed.hosts["desktop"].failure or ""), failed.hosts["desktop"]
    assert _remote(served, "desktop", "ls /run/rigctl").split() == ["last.json", "play.lock"]
    last = json.loads(_remote(served, "desktop", "cat /run/rigctl/last.json"))
    assert last["outcome"] == "failed", last
    assert _remote(served, "desktop", "stat -c '%U %a' /run/rigctl").split() == ["root", "700"]

    messages.clear()
    provision().raise_for_failures()
    said = "\n".join(messages)
    assert "took over" not in said, said
    assert "play lock taken; the last play, pid " in said and "ended by failure here" in said, said
    assert json.loads(_remote(served, "desktop", "cat /run/rigctl/last.json"))["outcome"] == "ok"


@pytest.mark.lab
@pytest.mark.timeout(300)
def test_an_unreachable_host_costs_only_its_own_row(served: Inventory, tmp_path: Path) -> None:
    """`build status` and `jobs` with one rig unreachable (nothing listens on its SSH port): a row (or a line)
    per host, the host named once, exit 1."""
    copy = tmp_path / "lab"
    shutil.copytree(LAB, copy)
    host_vars = copy / "host_vars" / "laptop.yml"
    host_vars.write_text(host_vars.read_text() + "ansible_port: 2222\n")
    env = cli_env(tmp_path)
    status = subprocess.run([*RIGCTL, "-i", str(copy), "build", "status"], capture_output=True, text=True,
                            timeout=240, env=env, cwd=REPO)
    assert status.returncode == 1, status.stdout + status.stderr
    rows = {line.split("│")[1].strip(): line for line in status.stdout.splitlines() if line.startswith("│ ")
            and line.split("│")[1].strip() in ("desktop", "laptop")}
    assert set(rows) == {"desktop", "laptop"}, status.stdout
    assert "b11434" in rows["desktop"] and "unreadable" in rows["laptop"], status.stdout
    assert "Traceback" not in status.stderr
    listed = subprocess.run([*RIGCTL, "-i", str(copy), "jobs"], capture_output=True, text=True, timeout=240,
                            env=env, cwd=REPO)
    assert listed.returncode == 1, listed.stdout + listed.stderr
    assert "laptop: cannot connect" in listed.stderr and "laptop: laptop:" not in listed.stderr, listed.stderr
