"""Shared fixtures: the real lab rigs (systemd-nspawn containers over real SSH), brought up once
per test session and torn down at its end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigctl.inventory import Inventory

REPO = Path(__file__).resolve().parent.parent
LAB_INVENTORY = REPO / "inventory" / "lab"
LAB_TESTS = REPO / "tests" / "lab"
#: The lab's second build: the pinned source with another stamp, so another build key. Every lab test that needs a
#: build beside the current one takes this one: compiled once, ccache-warm (only what the stamp touches is
#: compiled again), and copied from the controller's cache by every later provision that asks for it.
SECOND_BUILD_VARS = {"llama_cpp_build_commit": "rollbacktest"}


def lab_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the lab rigs need root"
    for tool in ("systemd-nspawn", "debootstrap", "ip"):
        if shutil.which(tool) is None:
            return f"the lab rigs need {tool}"
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Before the first test, the slow one-time work outside every test's time limit: the lab's (`rigctl lab
    prepare`: base image, the lab's llama.cpp build) when lab tests are selected, and SmolLM2's HF checkout
    with its tools venv when a test is marked ``hf_checkout``. Seconds when `make test` has just prepared,
    and a lab test file run alone on a cold machine gets the same bounded tests."""
    if session.config.option.collectonly:
        return
    if lab_unavailable_reason() is None and any(Path(item.path).parent == LAB_TESTS for item in session.items):
        from rigctl.errors import RigctlError
        from rigctl.lab.prepare import prepare

        try:
            prepare(Inventory.load(LAB_INVENTORY))
        except RigctlError as exc:
            pytest.exit(f"lab prepare failed: {exc}", returncode=1)
    if any(item.get_closest_marker("hf_checkout") for item in session.items):
        sys.path.insert(0, str(REPO / "tests" / "fixtures"))
        from make_hf_checkout import make_checkout

        make_checkout()


@pytest.fixture
def rigs(tmp_path: Path) -> Path:
    """A copy of the reference rigs' inventory (inventory/rigs) to break on purpose."""
    dest = tmp_path / "rigs"
    shutil.copytree(REPO / "inventory" / "rigs", dest)
    return dest


@pytest.fixture(scope="session")
def lab_inventory() -> Inventory:
    return Inventory.load(LAB_INVENTORY)


@pytest.fixture(scope="session")
def lab_up(lab_inventory: Inventory) -> Iterator[Inventory]:
    """Both lab rigs up and answering SSH. Torn down at the session's end if this session brought
    them up; a lab that was already up (a developer's, `make demo`'s) is left as found."""
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from rigctl.lab.rigs import Lab

    with Lab.from_inventory(lab_inventory).up_while():
        yield lab_inventory


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


@pytest.fixture(scope="session")
def lab_served(lab_up: Inventory) -> Iterator[Inventory]:
    """The lab rigs provisioned once per session with playbooks/site.yml (toolchain, llama.cpp,
    models, llama-server units) and every enabled llama-server instance answering /health 200:
    SmolLM2 as instance ``smollm2`` on port 8080 of each rig (``host.servers``, ``host.address``).
    Raises DeployError when the play fails on any host."""
    from rigctl.fleet.deploy import run_playbook

    run_playbook(lab_up, "site.yml").raise_for_failures()
    wait_healthy(lab_up)
    yield lab_up


def check_mode_play(inventory: Inventory, extravars: dict, tags: str = "llama_cpp", limit: str = "desktop") -> str:
    """What ``playbooks/site.yml --check`` prints for ``limit`` with these tags and variables (the roles'
    plan lines); it must succeed. Nothing on the host changes."""
    from rigctl.fleet.deploy import ansible_env

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory.source), "playbooks/site.yml",
         "--check", "--tags", tags, "--limit", limit, "-e", json.dumps(extravars)],
        cwd=repo, env={**os.environ, **ansible_env(repo)}, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout
