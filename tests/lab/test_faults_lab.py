"""Faults on the lab rigs (issue 16, class 8): a tampered model without a pin, a full disk, two provisions
at once, a link that drops mid-provision, a failed rollout next to disabled instances.

Each fault is made for real (a tmpfs that fills up, a veth downed in the rig's namespace, a second rigctl
process) and undone afterwards; every wait is bounded.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from benchlab import RIGCTL, cli_env, rigctl, served_inventory

from rigctl import jobs
from rigctl.bench.matrix import bench_job_spec, load_run_samples, parse_spec
from rigctl.errors import DeployError
from rigctl.fleet.deploy import run_playbook
from rigctl.inventory import Inventory
from rigctl.lab.rigs import Lab
from rigctl.results.store import ResultsStore
from rigctl.ssh import SshClient, SshTarget

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
        subprocess.run([*nsenter, "umount", "-l", results], check=False, timeout=30)
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


@pytest.mark.lab
@pytest.mark.timeout(900)
def test_failed_rollout_leaves_no_bad_flags_in_disabled_instances_of_its_profile(served: Inventory) -> None:
    inv = served
    v = inv.host("desktop").vars

    def extravars(extra: dict[str, Any]) -> dict[str, Any]:
        profiles = {**v["llama_server_profiles"], "lab-b": {"extends": "lab", **extra}}
        instances = {**v["llama_server_instances"],
                     "smollm2-b": {"artifact": "smollm2-135m-q4_1", "profile": "lab-b", "port": 8095},
                     "smollm2-b-off": {"artifact": "smollm2-135m-q4_1", "profile": "lab-b", "port": 8096,
                                       "enabled": False}}
        return {"llama_server_profiles": profiles, "llama_server_instances": instances}

    try:
        run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"],
                     extravars=extravars({"ctx_size": 1024})).raise_for_failures()
        good = _remote(inv, "desktop", "cat /etc/llama-server/smollm2-b-off.args")
        with pytest.raises(DeployError, match="llama-server@smollm2-b failed its rollout"):
            run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"],
                         extravars=extravars({"ctx_size": 1024, "extra_args": ["--no-such-flag"]})
                         ).raise_for_failures()
        assert "--no-such-flag" not in _remote(inv, "desktop", "cat /etc/llama-server/smollm2-b.args")
        assert _remote(inv, "desktop", "cat /etc/llama-server/smollm2-b-off.args") == good
    finally:
        run_playbook(inv, "site.yml", limit="desktop", tags=["llama_server"]).raise_for_failures()
    assert "smollm2-b-off.args" not in _remote(inv, "desktop", "ls /etc/llama-server").split()
