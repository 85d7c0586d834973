"""Helpers the lab module's unit and lab tests share: a test inventory of their own slot, its rigs; whether
the lab can run here, a served lab's health, and a check-mode play's plan lines."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rigctl.inventory import Inventory
from rigctl.lab.config import RigSpec, write_lab_inventory
from rigctl.lab.gpu import GpuState
from rigctl.lab.rigs import Lab, RigStatus

REPO = Path(__file__).resolve().parents[1]


LAB_INVENTORY = REPO / "inventory" / "lab"


TEST_PREFIX = "lt-"


# The lab tests' own rigs live beside the slot labs (10.213.0-6, one per RIGCTL_LAB_SLOT) on subnets and
# bridges of their own, also per slot: two slots testing at once, or a test beside a developer's slot lab,
# never meet on an address or a bridge name.
SLOT_VARIABLE = "RIGCTL_LAB_SLOT"
LAB_SLOT = int(os.environ.get(SLOT_VARIABLE, "0") or "0")


TEST_NETWORK = f"10.213.{20 + LAB_SLOT}"


TEST_BRIDGE = f"rigctl-ltbr{LAB_SLOT}"


FAILING_NETWORK = f"10.213.{30 + LAB_SLOT}"


FAILING_BRIDGE = f"rigctl-lfbr{LAB_SLOT}"


def lab_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the lab rigs need root"
    for tool in ("systemd-nspawn", "debootstrap", "ip", "ssh-keygen", "ssh", "zstd"):
        if shutil.which(tool) is None:
            return f"the lab rigs need {tool}"
    return None


def rig(name: str, address: str) -> RigSpec:
    return RigSpec(
        name, address, 22, "root", GpuState(name="g", memory_total_mib=4096, compute_cap="7.5", uuid="GPU-x")
    )


def real_inventory(slot: int | None = None) -> Inventory:
    """inventory/lab as the lab tests' slot sees it, or as slot ``slot`` does: a unit test names its slot,
    so that it passes whatever RIGCTL_LAB_SLOT the shell has (the inventory reads it while loading)."""
    if slot is None:
        return Inventory.load(LAB_INVENTORY)
    before = os.environ.get(SLOT_VARIABLE)
    os.environ[SLOT_VARIABLE] = str(slot)
    try:
        return Inventory.load(LAB_INVENTORY)
    finally:
        if before is None:
            del os.environ[SLOT_VARIABLE]
        else:
            os.environ[SLOT_VARIABLE] = before


def make_test_inventory(
    dest: Path, lab_dir: Path, prefix: str = TEST_PREFIX, network: str = TEST_NETWORK, bridge: str = TEST_BRIDGE,
    rigs: int = 2,
) -> Path:
    """inventory/lab with ``rigs`` rigs (rigctl lab inventory's) renamed ``prefix + name`` on ``network``.0/24,
    lab in ``lab_dir``."""
    write_lab_inventory(LAB_INVENTORY, dest, rigs)

    def rename(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("hosts"), dict):
                node["hosts"] = {
                    prefix + name: {
                        **(spec or {}),
                        "ansible_host": f"{network}.{spec['ansible_host'].rsplit('.', 1)[1]}",
                    }
                    for name, spec in node["hosts"].items()
                }
            for value in node.values():
                rename(value)

    hosts = yaml.safe_load((dest / "hosts.yml").read_text())
    rename(hosts)
    (dest / "hosts.yml").write_text(yaml.safe_dump(hosts))
    for host_vars in (dest / "host_vars").glob("*.yml"):
        host_vars.rename(host_vars.with_name(prefix + host_vars.name))
    lab_yml = dest / "group_vars" / "all" / "lab.yml"
    settings = yaml.safe_load(lab_yml.read_text())
    settings["rigctl_lab"] = {"dir": str(lab_dir), "bridge": bridge, "bridge_address": f"{network}.1/24"}
    lab_yml.write_text(yaml.safe_dump(settings))
    return dest



@dataclasses.dataclass
class LabRun:
    """A test lab that is up: its inventory, the lab, and what its first ``up`` said of each rig."""

    inventory: Path
    lab: Lab
    first_up: list[RigStatus]


@contextlib.contextmanager
def own_lab_up(base: Path, rigs: int = 2) -> Iterator[LabRun]:
    """A lab of the tests' own (:func:`make_test_inventory`'s ``rigs`` rigs, inventory and lab directory under
    ``base``), up for the block and down after it whatever happens; the test is skipped where no lab can run."""
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    inventory = make_test_inventory(base / "inventory", base / "lab", rigs=rigs)
    lab = Lab.from_inventory(Inventory.load(inventory))
    try:
        yield LabRun(inventory, lab, lab.up())
    finally:
        lab.down()


# ------------------------------------------------------------------ what the lab tests share


def lab_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the lab rigs need root"
    for tool in ("systemd-nspawn", "debootstrap", "ip"):
        if shutil.which(tool) is None:
            return f"the lab rigs need {tool}"
    return None


def wait_healthy(inventory: Inventory, timeout: float = 180.0) -> None:
    """Wait until every enabled llama-server instance of ``inventory`` answers /health 200."""
    import time

    import httpx

    pending = {(h.address, s.port) for h in inventory.hosts.values() for s in h.servers if s.enabled}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for address, port in sorted(pending):
            try:
                if httpx.get(f"http://{address}:{port}/health", timeout=5).status_code == 200:
                    pending.discard((address, port))
            except httpx.HTTPError:
                pass
        if pending:
            time.sleep(1)
    if pending:
        raise TimeoutError(f"llama-server not healthy after {timeout:.0f} s: {sorted(pending)}")


def check_mode_play(inventory: Inventory, extravars: dict, tags: str = "llama_cpp", limit: str = "desktop") -> str:
    """What ``playbooks/site.yml --check`` prints for ``limit`` with these tags and variables (the roles'
    plan lines); it must succeed. Nothing on the host changes."""
    from rigctl.fleet.deploy import ansible_env

    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory.source), "playbooks/site.yml",
         "--check", "--tags", tags, "--limit", limit, "-e", json.dumps(extravars)],
        cwd=REPO, env={**os.environ, **ansible_env(REPO)}, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


#: The lab's second build: the pinned source with another stamp, so another build key. Every lab test that needs a
#: build beside the current one takes this one: compiled once, ccache-warm (only what the stamp touches is
#: compiled again), and copied from the controller's cache by every later provision that asks for it.
SECOND_BUILD_VARS = {"llama_cpp_build_commit": "rollbacktest"}
