"""Faults on the lab rigs (issue 16, class 8): a tampered model without a pin, a full disk, two provisions
at once, a link that drops mid-provision, a failed rollout next to disabled instances.

Each fault is made for real (a tmpfs that fills up, a veth downed in the rig's namespace, a second rigctl
process) and undone afterwards; every wait is bounded. The tests that need no rig come first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from benchlab import RIGCTL, cli_env, rigctl, served_inventory
from handmade_runs import bench_record, bench_run

from rigctl import jobs
from rigctl.bench import bench_job_spec, load_run_samples, parse_spec
from rigctl.deploy import run_playbook
from rigctl.deploy_lock import inventory_lock
from rigctl.errors import ConfigError, DeployError
from rigctl.exporter import ModelFact
from rigctl.inventory import Inventory
from rigctl.lab import Lab
from rigctl.models import ArtifactStatus, Manifest
from rigctl.results import ResultsStore
from rigctl.ssh import SshClient, SshTarget

REPO = Path(__file__).resolve().parent.parent
LAB = REPO / "inventory" / "lab"
A, B = "a" * 64, "b" * 64


# ----------------------------------------------------------------------------------------------- no rig


def _manifest(sha: str) -> Manifest:
    return Manifest("m", "desktop", "/m.gguf", 1, sha, 1, {}, {}, {}, "", 0.0, {})


def test_verify_and_the_exporter_use_one_rule_manifest_hash_when_no_pin() -> None:
    tampered = ArtifactStatus("desktop", "m", "/m.gguf", _manifest(A), actual_sha256=B, pin=None)
    assert tampered.status == "mismatch"
    assert tampered.describe() == (f"desktop: m: no pin, and /m.gguf has {B} but its manifest records {A} "
                                   "(changed since the models role made it)")
    assert ModelFact("m", "/m.gguf", True, B, None, A, 1).drift is True
    intact = ArtifactStatus("desktop", "m", "/m.gguf", _manifest(A), actual_sha256=A, pin=None)
    assert intact.status == "unpinned" and ModelFact("m", "/m.gguf", True, A, None, A, 1).drift is False
    pinned = ArtifactStatus("desktop", "m", "/m.gguf", _manifest(A), actual_sha256=B, pin=B)
    assert pinned.status == "ok" and ModelFact("m", "/m.gguf", True, B, B, A, 1).drift is False


def test_second_provision_is_refused_naming_the_holder(tmp_path: Path) -> None:
    env = {**os.environ, "RIGCTL_CACHE_DIR": str(tmp_path), "RIGCTL_LAB_SLOT": os.environ.get("RIGCTL_LAB_SLOT", "3")}
    os.environ["RIGCTL_CACHE_DIR"] = str(tmp_path)
    try:
        with inventory_lock(LAB, command="rigctl provision --tags llama_server"):
            started = time.monotonic()
            done = subprocess.run([*RIGCTL, "-i", str(LAB), "provision"], capture_output=True, text=True,
                                  timeout=60, env=env, cwd=REPO)
            refused_in = time.monotonic() - started
    finally:
        del os.environ["RIGCTL_CACHE_DIR"]
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: inventory {LAB}: refused: pid {os.getpid()} (`rigctl provision --tags llama_server`, since "
        f"{done.stderr.split('since ')[1].split(')')[0]}) is running a playbook against it; wait for it to finish"]
    assert "TASK" not in done.stdout and refused_in < 30  # refused before Ansible started
    # Released with the block (and by the kernel if its holder dies): the next run may take it.
    os.environ["RIGCTL_CACHE_DIR"] = str(tmp_path)
    try:
        with inventory_lock(LAB, command="again"):
            pass
    finally:
        del os.environ["RIGCTL_CACHE_DIR"]


def test_a_cell_without_results_is_not_a_successful_cell(tmp_path: Path) -> None:
    run_dir = bench_run(tmp_path, "desktop", "bench-1", [("m", [bench_record((512, 0), [10.0, 11.0])])])
    raw = next((run_dir / "llama-bench").glob("*.json"))
    raw.write_text("")
    run = ResultsStore(tmp_path).find("desktop/bench-1")
    with pytest.raises(ConfigError, match=r"empty \(0 bytes\): llama-bench wrote no results"):
        load_run_samples(run)
    raw.write_text("[]")
    with pytest.raises(ConfigError, match="an empty array: llama-bench wrote no results"):
        load_run_samples(run)
    # What the bench task writes now for such a cell: marked with its error, left out of every summary.
    cells = run_dir / "cells.jsonl"
    cells.write_text(json.dumps({**json.loads(cells.read_text()), "error": "llama-bench exited 0 but wrote no "
                                                                            "results"}) + "\n")
    assert load_run_samples(run) == []


@pytest.fixture
def small_disk() -> Any:
    """A 2 MiB tmpfs: a real file system that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = Path(tempfile.mkdtemp(prefix="rigctl-full-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True, timeout=30)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False, timeout=30)
        mount.rmdir()


def test_models_artifact_on_a_full_disk_says_the_disk_is_full(small_disk: Path, tmp_path: Path) -> None:
    """The models role's own module (as Ansible runs it) copying a 4 MiB artifact onto a 2 MiB disk."""
    source = tmp_path / "in.gguf"
    source.write_bytes(b"GGUF" + os.urandom(4 << 20))
    args = {"name": "big", "path": str(small_disk / "big.gguf"), "kind": "copy", "input": str(source),
            "host": "controller"}
    (tmp_path / "ansible.cfg").write_text("[defaults]\n")  # Ansible's own defaults, not the project's
    ansible = str(Path(sys.executable).parent / "ansible")
    done = subprocess.run(
        [ansible, "localhost", "-c", "local", "-M", str(REPO / "roles/models/library"), "-m", "models_artifact",
         "-a", json.dumps(args)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg"), "ANSIBLE_LOCALHOST_WARNING": "0"})
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "controller: big: copying" in out and "No space left on device" in out, out
    assert "disk full:" in out and f"free on the file system of {small_disk}" in out, out
    assert "Traceback" not in out
    assert list(small_disk.iterdir()) == []  # the partial file is gone


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
