"""Hosts whose stand-in GPU replays a recorded real nvidia-smi (rigctl/lab/captures/nvidia-smi/): a 2-GPU
host on an R610 driver (whose header reads `KMD Version`/`CUDA UMD Version`), a server of five mixed GPUs and
a unified-memory DGX Spark (memory `Not Supported`, `[N/A]` in queries) are enrolled with `hosts add` as a
new user would; the mixed host then serves an instance pinned to GPU 1 and benches with a cool-down that
watches every card the cell uses. Works on a copy of the lab inventory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from labrigs_support import REPO, lab_unavailable_reason
from ruamel.yaml import YAML

from rigctl.inventory import Inventory
from rigctl.lab.rigs import Lab

pytestmark = pytest.mark.lab

#: Two RTX 5090s (power caps 575 W and 600 W, GPU 1 drives a display) on driver 610.57.04.
DUO = "duo"
#: A DGX Spark: one GB10 sharing the machine's memory, driver 580.126.09.
SPARK = "spark"
#: RTX 2060, 3060, 3060, 3060 Ti, 3070 (bus order), driver 560.35.03: CUDA's fastest-first order is another.
MIXED = "mixed"
RIGS = {DUO: {"address": "10.213.{{ rigctl_lab_slot }}.14", "capture": "r610-2x-rtx5090"},
        SPARK: {"address": "10.213.{{ rigctl_lab_slot }}.15", "capture": "gb10-unified-memory"},
        MIXED: {"address": "10.213.{{ rigctl_lab_slot }}.16", "capture": "mixed-5-gpu"}}


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Lab]]:
    """A copy of the lab inventory whose lab has two more rigs, not enrolled, each replaying a capture; up."""
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    inv = tmp_path_factory.mktemp("captures") / "lab"
    shutil.copytree(REPO / "inventory" / "lab", inv)
    yaml = YAML()
    lab_vars = inv / "group_vars" / "all" / "lab.yml"
    data = yaml.load(lab_vars.read_text())
    data["rigctl_lab"]["unenrolled"] = RIGS
    with lab_vars.open("w") as f:
        yaml.dump(data, f)
    lab = Lab.from_inventory(Inventory.load(inv))
    lab.up()
    try:
        yield inv, lab
    finally:
        for name in RIGS:
            lab.remove(name)


def rigctl(inv: Path, *args: str, stdin: str = "", timeout: float = 900,
           results: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RIGCTL_PROJECT": str(REPO),
           "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           **({"RIGCTL_RESULTS": str(results)} if results else {})}
    # A session of its own: no controlling terminal, so the password prompt reads stdin as a script's would.
    return subprocess.run([sys.executable, "-m", "rigctl.cli", "-i", str(inv), *args], input=stdin, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True)


def enrol(inv: Path, lab: Lab, name: str) -> subprocess.CompletedProcess[str]:
    """`hosts add` as the rig's owner would run it: the fingerprint its console shows, its root password."""
    shown = lab.guest_run(name, ["ssh-keygen", "-lf", "/etc/ssh/ssh_host_ed25519_key.pub"]).split()[1]
    return rigctl(inv, "hosts", "add", name, lab.rig(name).address, "--ask-pass", "--fingerprint", shown,
                  "--group", "lab", stdin=lab.root_password(name) + "\n")


def test_the_stand_ins_print_the_recorded_tables(captured: tuple[Path, Lab]) -> None:
    _, lab = captured
    duo = lab.guest_run(DUO, ["nvidia-smi"]).splitlines()
    assert "KMD Version: 610.57.04     CUDA UMD Version: 13.3" in duo[2]
    assert [line.split("|")[1].split()[:4] for line in duo if "RTX 5090" in line] == [
        ["0", "NVIDIA", "GeForce", "RTX"], ["1", "NVIDIA", "GeForce", "RTX"]]
    spark = lab.guest_run(SPARK, ["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,memory.free",
                                  "--format=csv,noheader,nounits"])
    assert spark.strip() == "0, NVIDIA GB10, [N/A], [N/A], [N/A]"


def test_hosts_add_enrols_the_r610_two_gpu_host_with_its_facts(captured: tuple[Path, Lab]) -> None:
    inv, lab = captured
    added = enrol(inv, lab, DUO)
    assert added.returncode == 0, added.stdout + added.stderr
    host = Inventory.load(inv).hosts[DUO]
    gpu = {"name": "NVIDIA GeForce RTX 5090", "vram_mib": 32607, "compute_capability": "12.0"}
    assert host.vars["gpu_host_gpu"] == gpu
    assert host.vars["gpu_host_gpus"] == [{"index": 0, **gpu}, {"index": 1, **gpu}]
    assert host.vars["llama_cpp_cuda_architectures"] == "120"
    facts = host.vars["rigctl_host_facts"]
    # The R610 header's versions: the driver's own and the CUDA its user-mode driver supports.
    assert facts["driver_version"] == "610.57.04" and facts["cuda_version"] == "13.3"
    check = rigctl(inv, "inventory", "check")
    assert check.returncode == 0 and ", 0 errors" in check.stdout, check.stdout + check.stderr


def test_hosts_add_enrols_the_mixed_host_with_every_card(captured: tuple[Path, Lab]) -> None:
    inv, lab = captured
    added = enrol(inv, lab, MIXED)
    assert added.returncode == 0, added.stdout + added.stderr
    host = Inventory.load(inv).hosts[MIXED]
    assert [(g["index"], g["name"], g["vram_mib"], g["compute_capability"]) for g in host.vars["gpu_host_gpus"]] == [
        (0, "NVIDIA GeForce RTX 2060", 6144, "7.5"), (1, "NVIDIA GeForce RTX 3060", 12288, "8.6"),
        (2, "NVIDIA GeForce RTX 3060", 12288, "8.6"), (3, "NVIDIA GeForce RTX 3060 Ti", 8192, "8.6"),
        (4, "NVIDIA GeForce RTX 3070", 8192, "8.6")]
    assert host.vars["llama_cpp_cuda_architectures"] == "75;86"
    facts = host.vars["rigctl_host_facts"]
    assert facts["driver_version"] == "560.35.03" and facts["cuda_version"] == "12.6"


def test_hosts_add_enrols_the_unified_memory_host(captured: tuple[Path, Lab]) -> None:
    """A GB10 reports no memory of its own ([N/A]): a working host, enrolled, its GPU marked unified memory
    with the memory the platform offers it (the host's), not a number made up."""
    inv, lab = captured
    added = enrol(inv, lab, SPARK)
    assert added.returncode == 0, added.stdout + added.stderr
    host = Inventory.load(inv).hosts[SPARK]
    facts = host.vars["rigctl_host_facts"]
    assert host.vars["gpu_host_gpu"] == {"name": "NVIDIA GB10", "vram_mib": facts["memory_mib"],
                                         "compute_capability": "12.1", "unified_memory": True}
    assert facts["driver_version"] == "580.126.09" and facts["cuda_version"] == "13.0"


@pytest.fixture(scope="module")
def mixed_serving(captured: tuple[Path, Lab]) -> tuple[Path, Lab]:
    """The mixed host enrolled and provisioned with SmolLM2 as instance ``smollm2``, pinned to GPU 1."""
    inv, lab = captured
    if MIXED not in Inventory.load(inv).hosts:
        added = enrol(inv, lab, MIXED)
        assert added.returncode == 0, added.stdout + added.stderr
    vars_file = inv / "host_vars" / f"{MIXED}.yml"
    vars_file.write_text(vars_file.read_text() + "llama_server_instances:\n  smollm2:\n"
                         "    artifact: smollm2-135m-q4_1\n    profile: lab\n    port: 8080\n    gpu: 1\n")
    provisioned = rigctl(inv, "provision", "--limit", MIXED, timeout=1800)
    assert provisioned.returncode == 0, provisioned.stdout[-4000:] + provisioned.stderr
    return inv, lab


def test_an_instance_pinned_to_gpu_1_runs_in_pci_bus_order(mixed_serving: tuple[Path, Lab]) -> None:
    """CUDA numbers devices fastest first unless told otherwise; nvidia-smi numbers them by PCI bus. The pin
    names nvidia-smi's GPU 1 (the first RTX 3060; CUDA's default order puts the faster 3070 and 3060 Ti ahead
    of it), so the process must carry CUDA_DEVICE_ORDER=PCI_BUS_ID beside it."""
    _, lab = mixed_serving
    base = f"http://{lab.rig(MIXED).address}:8080"
    deadline = time.monotonic() + 120
    healthy = False
    while not healthy and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            healthy = httpx.get(f"{base}/health", timeout=5).status_code == 200
        if not healthy:
            time.sleep(1)
    assert healthy, f"{base}/health did not answer 200 within 120 s"
    pid = lab.guest_run(MIXED, ["systemctl", "show", "-p", "MainPID", "--value", "llama-server@smollm2"]).strip()
    environ = lab.guest_run(MIXED, ["cat", f"/proc/{pid}/environ"]).split("\0")
    assert "CUDA_VISIBLE_DEVICES=1" in environ and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in environ, environ


def bench_cell(inv: Path, results: Path, *spec_lines: str) -> dict:
    """One llama-bench cell of SmolLM2 on the mixed host (cool-down at 40 °C, 3 s at most): its cells.jsonl
    line, with the clock series it names read in as ``series``."""
    results.mkdir(parents=True, exist_ok=True)
    spec = results / "spec.yml"
    spec.write_text("".join(f"{line}\n" for line in spec_lines))
    done = rigctl(inv, "bench", "run", str(spec), "-H", MIXED, "-m", "smollm2-135m-q4_1", "-p", "16", "-n", "4",
                  "-r", "1", "-t", "1", "--rounds", "1", "--cooldown", "40", "--cooldown-poll", "0.5",
                  "--cooldown-timeout", "3", "--clock-sample", "600", "--wait", results=results, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    [cells_file] = list(results.rglob("cells.jsonl"))
    [cell] = [json.loads(line) for line in cells_file.read_text().splitlines()]
    cell["series"] = [json.loads(line) for line in (cells_file.parent / cell["clocks"]).read_text().splitlines()]
    return cell


def test_a_bench_cools_down_on_the_cards_its_cell_uses(mixed_serving: tuple[Path, Lab], tmp_path: Path) -> None:
    """GPU 0 (the RTX 2060) at 85 °C, the others cool. A cell pinned to GPU 1 (`gpus: [1]`) starts at once and
    reads GPU 1 alone; a cell on every GPU (no `gpus`) waits on GPU 0 and reads each card."""
    inv, lab = mixed_serving
    state = lab.gpu_state(MIXED)
    lab.set_gpu(MIXED, temperature=85, temperature_sequence=[],
                additional_gpus=[{**g, "temperature": 35} for g in state.additional_gpus])
    try:
        pinned = bench_cell(inv, tmp_path / "pinned", "gpus: [1]")
        every = bench_cell(inv, tmp_path / "every")
    finally:
        lab.set_gpu(MIXED, temperature=35)
    assert pinned["cooldown"]["readings"] == [35] and not pinned["cooldown"]["timed_out"], pinned["cooldown"]
    assert {r["gpu"] for r in pinned["series"]} == {1}, pinned["series"]
    wait = every["cooldown"]
    assert wait["timed_out"] and wait["waited_s"] >= 3 and set(wait["readings"]) == {85}, wait
    assert {r["gpu"] for r in every["series"]} == {0, 1, 2, 3, 4}, every["series"]


def test_a_fleet_user_without_passwordless_sudo_is_one_error(mixed_serving: tuple[Path, Lab]) -> None:
    """The enrolled host's fleet user is not root: rigctl acts as root through `sudo -n`. With its sudo rule
    gone, a command on the host is one error naming the host and what the user lacks; with it back, it works."""
    inv, lab = mixed_serving
    user = Inventory.load(inv).hosts[MIXED].user
    assert user != "root"
    rule = f"/etc/sudoers.d/rigctl-{user}"
    lab.guest_run(MIXED, ["mv", rule, "/root/sudoers-rule-aside"])
    try:
        refused = rigctl(inv, "jobs", MIXED, timeout=120)
    finally:
        lab.guest_run(MIXED, ["mv", "/root/sudoers-rule-aside", rule])
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert (f"{MIXED}: {user} logs in but cannot act as root: the fleet user needs passwordless sudo"
            in " ".join(refused.stderr.split())), refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr
    listed = rigctl(inv, "jobs", MIXED, timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr
