"""The unit tests' fixtures: what they read of the lab is slot 0's, whatever RIGCTL_LAB_SLOT the shell has
(a developer working on another slot runs the same unit tests with the same expectations)."""

from __future__ import annotations

import pytest
from labrigs_support import real_inventory

from rigctl.inventory import Inventory


@pytest.fixture(scope="session")
def lab_inventory() -> Inventory:
    """inventory/lab as slot 0 loads it (the lab tests' own fixture follows RIGCTL_LAB_SLOT)."""
    return real_inventory(slot=0)
