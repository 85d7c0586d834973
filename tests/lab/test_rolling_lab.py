"""Rolling rollouts on a lab of three rigs of its own: `rigctl provision --serial 1` goes rig by rig, a failure in
the second batch stops the third, and the report names the batch; batches of two reach every rig."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from labrigs_support import TEST_PREFIX, own_lab_up

from rigctl.fleet.deploy import run_playbook
from rigctl.inventory import Inventory
from rigctl.lab.rigs import Lab

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.lab
DESKTOP, LAPTOP, THIRD = (TEST_PREFIX + name for name in ("desktop", "laptop", "rig3"))
#: What the gpu_host role leaves on a host it configured.
FACT = "/etc/ansible/facts.d/gpu_host.fact"


@pytest.fixture(scope="module")
def three_rigs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with own_lab_up(tmp_path_factory.mktemp("rolling"), rigs=3) as run:
        yield run.inventory


def _has_fact(inventory: Path, host: str) -> bool:
    lab = Lab.from_inventory(Inventory.load(inventory))
    done = subprocess.run(lab.ssh_argv(host, f"test -e {FACT}"), capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, check=False)
    return done.returncode == 0


def test_a_failure_in_the_second_batch_stops_the_third(three_rigs: Path) -> None:
    assert [h for h in Inventory.load(three_rigs).hosts] == [DESKTOP, LAPTOP, THIRD]
    # The laptop's inventory pins a CUDA version that is no version: its gpu_host preflight fails.
    host_vars = three_rigs / "host_vars" / f"{LAPTOP}.yml"
    sound = host_vars.read_text()
    host_vars.write_text(sound + "gpu_host_cuda: true\ngpu_host_cuda_version: thirteen\n")
    try:
        env = {**os.environ, "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
        done = subprocess.run([sys.executable, "-m", "rigctl.cli", "-i", str(three_rigs), "provision", "--serial", "1",
                               "--tags", "gpu_host"], cwd=REPO, capture_output=True, text=True, timeout=1200, env=env,
                              check=False)
    finally:
        host_vars.write_text(sound)
    assert done.returncode != 0, done.stdout
    error = done.stderr.strip().splitlines()[-1]
    assert re.match(rf"^error: batch 2 of the rollout \({LAPTOP}\) stopped it; {LAPTOP} failed at '(gpu_host : )?"
                    rf"Assert the pinned CUDA version is major.minor': .*; not run: {THIRD}$", error), error
    assert f"batch 2 ({LAPTOP}) failed and stopped the rollout; not run: {THIRD}" in done.stdout
    table = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:]]
             for line in done.stdout.splitlines() if line.count("│") > 3 and TEST_PREFIX in line}
    assert table[DESKTOP][0] == "1" and table[LAPTOP][0] == "2" and table[THIRD][0] == "not run"
    # What the rigs say: the first batch was configured, the third never touched.
    assert _has_fact(three_rigs, DESKTOP) and not _has_fact(three_rigs, LAPTOP) and not _has_fact(three_rigs, THIRD)


def test_batches_of_two_reach_every_rig_in_turn(three_rigs: Path) -> None:
    inventory_dir = three_rigs
    # From the inventory this time (in a file Ansible has listed already: its vars plugin keeps the listing).
    group_vars = inventory_dir / "group_vars" / "all" / "lab.yml"
    sound = group_vars.read_text()
    group_vars.write_text(sound + yaml.safe_dump({"rigctl_serial": 2}))
    try:
        from rigctl.fleet.deploy import rollout_serial

        inventory = Inventory.load(inventory_dir)
        serial = rollout_serial(inventory.select(None))
        result = run_playbook(inventory, "site.yml", tags=["gpu_host"], serial=serial, timeout=1200)
    finally:
        group_vars.write_text(sound)
    assert serial == [2]
    assert result.succeeded, result.failures()
    assert result.batches == [[DESKTOP, LAPTOP], [THIRD]] and result.stopped_batch is None
    assert _has_fact(inventory_dir, THIRD)
