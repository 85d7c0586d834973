"""One SSH connection per host per command: the rig's sshd accepts exactly one login from a `rigctl` command
that talks to it many times (start a bench job, follow it, pull it; a drafter race's systemctl calls)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from benchlab import rigctl, served_inventory

from rigctl.inventory import Inventory
from rigctl.results.store import ResultsStore
from rigctl.ssh import SshClient


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Inventory:
    return served_inventory(request)


def _rig_clock(inventory: Inventory, host: str) -> int:
    """The rig's clock in whole seconds, one second on: what follows happens after it."""
    with SshClient.for_host(inventory.host(host)) as ssh:
        now = int(ssh.run("date +%s", timeout=30).stdout)
    time.sleep(max(0.0, now + 1 - time.time()) + 1.0)  # the clocks are the controller's (containers)
    return now + 1


def _logins_since(inventory: Inventory, host: str, since: int) -> int:
    """sshd's accepted logins on ``host`` since ``since``, not counting the one that asks."""
    with SshClient.for_host(inventory.host(host)) as ssh:
        out = ssh.run(f"journalctl --since @{since} -o cat --no-pager | grep -c '^Accepted ' || true",
                      timeout=60).stdout
    return int(out.strip()) - 1


@pytest.mark.lab
def test_bench_run_wait_logs_in_once(served: Inventory, tmp_path: Path) -> None:
    since = _rig_clock(served, "desktop")
    done = rigctl("bench", "run", "-H", "desktop", "-m", "smollm2-135m-q4_1", "-p", "16", "-n", "4", "-r", "1",
                  "-t", "1", "--no-cooldown", "--keep-servers", "--wait", results=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = next(line.split()[2] for line in done.stdout.splitlines() if " started " in line)
    run = ResultsStore(tmp_path).find(f"desktop/{job_id}")  # the pull also brings the rig's earlier runs
    assert run.record.status == "done"
    # Starting the job (files, unit), following it to the end and pulling it: one login.
    assert _logins_since(served, "desktop", since) == 1


@pytest.mark.lab
def test_drafter_race_logs_in_once(served: Inventory, tmp_path: Path) -> None:
    since = _rig_clock(served, "desktop")
    done = rigctl("bench", "spec", "desktop", "--baseline", "smollm2-q4_0", "--prompts", "code", "--repeats", "1",
                  "--temperatures", "0", "--max-tokens", "8", results=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    # Which instances run, starting the stopped ones, stopping them again: one login.
    assert _logins_since(served, "desktop", since) == 1
