"""`rigctl provision`: ansible-runner over real SSH to both lab rigs, with per-host outcomes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rigctl.errors import DeployError
from rigctl.fleet.deploy import run_playbook
from rigctl.inventory import Inventory

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.lab


def rigctl(*args: str, inventory: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "rigctl.cli"]
    if inventory is not None:
        cmd += ["-i", str(inventory)]
    # The venv's bin is not on PATH, as when `make demo` runs .venv/bin/rigctl: rigctl must find
    # ansible-playbook by itself.
    env = {**os.environ, "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    return subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)


def test_provision_both_rigs_then_nothing_changes(lab_up: Inventory) -> None:
    first = run_playbook(lab_up, "site.yml")
    assert first.succeeded, first.failures()
    assert set(first.hosts) == {"desktop", "laptop"}
    for outcome in first.hosts.values():
        assert outcome.ok > 0 and outcome.failed == 0 and outcome.unreachable == 0

    second = run_playbook(lab_up, "site.yml")
    assert second.succeeded
    assert {h.host: h.changed for h in second.hosts.values()} == {"desktop": 0, "laptop": 0}


def test_cli_streams_tasks_and_prints_per_host_summary(lab_up: Inventory) -> None:
    out = rigctl("provision", "--limit", "laptop", inventory=lab_up.source)
    assert out.returncode == 0, out.stderr
    assert "TASK Check the host answers over SSH" in out.stdout
    assert "ok laptop" in out.stdout and "desktop" not in out.stdout
    summary = [line for line in out.stdout.splitlines() if line.strip().startswith("│ laptop")]
    assert summary, out.stdout


def test_check_mode_changes_nothing(lab_up: Inventory) -> None:
    result = run_playbook(lab_up, "site.yml", check=True)
    assert result.succeeded
    assert all(h.changed == 0 for h in result.hosts.values())


def test_unreachable_host_is_named_and_the_other_host_still_reported(lab_up: Inventory, tmp_path: Path) -> None:
    inv_dir = tmp_path / "lab"
    shutil.copytree(lab_up.source, inv_dir)
    host_vars = inv_dir / "host_vars" / "laptop.yml"
    data = yaml.safe_load(host_vars.read_text())
    data["ansible_port"] = 2222  # nothing listens there on the rig
    host_vars.write_text(yaml.safe_dump(data))
    broken = Inventory.load(inv_dir)

    result = run_playbook(broken, "site.yml")
    assert not result.succeeded
    assert result.hosts["laptop"].unreachable == 1
    assert result.hosts["desktop"].succeeded and result.hosts["desktop"].ok > 0
    with pytest.raises(DeployError, match=r"^laptop unreachable at 'Gathering Facts': .*"):
        result.raise_for_failures()

    out = rigctl("provision", inventory=inv_dir)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("error: laptop unreachable at 'Gathering Facts'")


def test_plain_ansible_playbook_uses_the_same_config(lab_up: Inventory) -> None:
    from rigctl.fleet.deploy import ansible_env

    env = {**os.environ, **ansible_env(REPO)}
    ansible_playbook = Path(sys.executable).parent / "ansible-playbook"
    out = subprocess.run([str(ansible_playbook), "-i", str(lab_up.source), "playbooks/site.yml"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:]
    assert "desktop                    : ok=" in out.stdout and "laptop                     : ok=" in out.stdout
