"""Shared fixtures: the real lab rigs (systemd-nspawn containers over real SSH), brought up once
per test session and torn down at its end. Helpers a test imports live in importable modules
(labrigs_support and the other *_support.py), never here: conftest is pytest's to load."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from labrigs_support import LAB_INVENTORY, REPO, lab_unavailable_reason, wait_healthy

from rigctl.inventory import Inventory

LAB_TESTS = REPO / "tests" / "lab"
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
        from make_hf_checkout import make_checkout

        make_checkout()


@pytest.fixture
def rigs(tmp_path: Path) -> Path:
    """A copy of the reference rigs' inventory (inventory/rigs) to break on purpose."""
    dest = tmp_path / "rigs"
    shutil.copytree(REPO / "inventory" / "rigs", dest)
    return dest


@pytest.fixture
def lab_copy(tmp_path: Path) -> Path:
    """A copy of the lab inventory (inventory/lab) to edit or break on purpose."""
    dest = tmp_path / "lab"
    shutil.copytree(LAB_INVENTORY, dest)
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
