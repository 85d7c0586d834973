"""Helpers shared by the bench and jobs lab tests: a provisioned lab and the CLI as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rigctl.inventory import Inventory

REPO = Path(__file__).resolve().parent.parent
RIGCTL = [str(Path(sys.executable).parent / "rigctl")]  # the installed script, as users run it


def served_inventory(request: pytest.FixtureRequest) -> Inventory:
    """The lab up with site.yml applied: the suite's ``lab_served`` when conftest has it, else ``lab_up``
    provisioned here."""
    try:
        return request.getfixturevalue("lab_served")
    except pytest.FixtureLookupError:
        pass
    from rigctl.fleet.deploy import run_playbook

    inventory = request.getfixturevalue("lab_up")
    run_playbook(inventory, "site.yml", timeout=3600).raise_for_failures()
    return inventory


def cli_env(results: Path) -> dict[str, str]:
    return {**os.environ, "RIGCTL_INVENTORY": str(REPO / "inventory" / "lab"), "RIGCTL_RESULTS": str(results),
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}


def rigctl(*args: str, results: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RIGCTL, *args], capture_output=True, text=True, timeout=timeout, env=cli_env(results),
                          cwd=REPO, check=False)


def assert_deployed(server, inventory: Inventory, host: str, instance: str) -> None:
    """``server`` (a record's :class:`rigctl.results.record.Server`) carries the argv the unit runs: the
    instance's binary link and its arguments file as the role rendered it, read from the rig here."""
    from rigctl.fleet.servers import deployed_argv
    from rigctl.ssh import SshClient, SshTarget

    served = inventory.host(host).server(instance)
    with SshClient(SshTarget.from_host(inventory.host(host))) as ssh:
        args = deployed_argv(ssh, served)
    assert server.name == instance and server.unit == served.unit
    assert server.argv_from and server.argv_from.startswith("/proc/") and server.argv_from.endswith("/cmdline")
    assert server.argv == [served.binary, *args], server.argv
    assert server.ctx_size is not None and server.ctx_size > 0
