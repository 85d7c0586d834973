"""Shared fixtures: the real lab rigs (systemd-nspawn containers over real SSH), brought up once
per test session and torn down at its end."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigctl.inventory import Inventory

REPO = Path(__file__).resolve().parent.parent
LAB_INVENTORY = REPO / "inventory" / "lab"


def lab_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the lab rigs need root"
    for tool in ("systemd-nspawn", "debootstrap", "ip"):
        if shutil.which(tool) is None:
            return f"the lab rigs need {tool}"
    return None


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
    from rigctl.lab import Lab

    lab = Lab.from_inventory(lab_inventory)
    was_up = all(rig.running and rig.sshd for rig in lab.status())
    lab.up()
    try:
        yield lab_inventory
    finally:
        if not was_up:
            lab.down()
