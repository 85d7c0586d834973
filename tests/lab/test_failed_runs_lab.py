"""Runs that fail for real on the lab rigs leave their record (issue 25): a server-speed run against an
instance that is down, a load run whose probe cannot bind its port, and a drafter race whose drafter's
build refuses a flag in its arguments file each leave a run directory sealed ``failed`` with the reason.

Each fault is made for real on the desktop rig and undone afterwards; the waits are the server lifecycle's,
which ends at once when a unit fails (no health timeout is sat out).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from benchlab import rigctl, served_inventory

from rigctl.bench.load import run_load
from rigctl.errors import ServerError
from rigctl.inventory import Inventory
from rigctl.results.store import ResultsStore
from rigctl.ssh import SshClient, SshTarget

HOST = "desktop"


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Inventory:
    return served_inventory(request)


def _remote(inventory: Inventory, cmd: str, check: bool = True) -> str:
    with SshClient(SshTarget.from_host(inventory.host(HOST))) as ssh:
        return ssh.run(cmd, timeout=300, check=check).stdout


def _failed(results: Path, kind: str) -> tuple[object, str]:
    [run] = list(ResultsStore(results).runs(HOST, kind=kind))
    record = run.record
    assert record.status == "failed" and record.ended, record
    assert ResultsStore(results).verify(run) == []
    return run, str(record.extra["error"])


@pytest.mark.lab
@pytest.mark.timeout(300)
def test_a_server_speed_run_against_a_stopped_instance_is_sealed_failed(served: Inventory, tmp_path: Path) -> None:
    unit = served.host(HOST).server("smollm2").unit
    _remote(served, f"systemctl stop {unit}")
    began = time.monotonic()
    try:
        done = rigctl("bench", "server", HOST, "smollm2", "--prompt-lengths", "16", "--max-tokens", "2",
                      results=tmp_path, timeout=240)
    finally:
        _remote(served, f"systemctl start {unit}")
    assert done.returncode == 1 and time.monotonic() - began < 120  # not the health timeout sat out
    assert f"{unit} is inactive (dead)" in done.stderr and "Traceback" not in done.stderr
    run, error = _failed(tmp_path, "server-speed")
    assert f"{HOST}/smollm2: start: {unit} is inactive (dead)" in error
    # What the inventory knew went in at once: the server, its artifact, the GPU.
    assert run.record.server.name == "smollm2" and run.record.artifacts[0].name == "smollm2-135m-q4_1"
    assert run.record.gpu.name == "Lab stand-in for RTX 3050 OEM" and run.record.extra["prompt_lengths"] == [16]


@pytest.mark.lab
@pytest.mark.timeout(300)
def test_a_load_run_whose_probe_cannot_bind_its_port_is_sealed_failed(served: Inventory, tmp_path: Path) -> None:
    """Port 22 is the rig's sshd (and privileged): the probe, run as the service account, cannot bind it."""
    store = ResultsStore(tmp_path)
    with pytest.raises(ServerError) as info:
        run_load(served.host(HOST), "smollm2", concurrency=[1], requests=1, max_tokens=2, slot_ctx=128,
                 probe_port=22, store=store)
    run, error = _failed(tmp_path, "load")
    assert error == str(info.value) and "rigctl-loadprobe-smollm2" in error
    assert "bind" in error.lower(), error  # llama-server's own last word, from the probe's journal
    assert run.record.server.unit == "rigctl-loadprobe-smollm2" and run.record.server.port == 22
    assert [f.path for f in run.record.files] == []  # no level ran
    states = _remote(served, "systemctl is-active llama-server@smollm2.service rigctl-loadprobe-smollm2.service",
                     check=False).split()
    assert states == ["active", "inactive"]  # the instance is back, the probe gone


@pytest.mark.lab
@pytest.mark.timeout(300)
def test_a_race_whose_drafter_refuses_a_flag_is_sealed_failed(served: Inventory, tmp_path: Path) -> None:
    drafter = served.host(HOST).server("smollm2-q4_0-draft")
    args = drafter.args_file
    _remote(served, f"cp -p {args} {args}.orig && echo --rigctl-no-such-flag >> {args}")
    began = time.monotonic()
    try:
        done = rigctl("bench", "spec", HOST, "--baseline", "smollm2-q4_0", "--prompts", "code", "--repeats", "1",
                      "--temperatures", "0", "--max-tokens", "4", results=tmp_path, timeout=240)
    finally:
        _remote(served, f"mv {args}.orig {args}")
    assert done.returncode == 1 and time.monotonic() - began < 120, done.stdout + done.stderr
    run, error = _failed(tmp_path, "spec")
    assert drafter.unit in error and "--rigctl-no-such-flag" in error, error
    assert run.record.extra["baseline"] == "smollm2-q4_0"
    assert [s.name for s in run.record.servers] == ["smollm2-q4_0", "smollm2-q4_0-draft"]
    # Both were started for the race and are stopped again, the failing one with its failure cleared.
    states = _remote(served, f"systemctl is-active llama-server@smollm2-q4_0.service {drafter.unit}",
                     check=False).split()
    assert states[0] == "inactive" and states[1] in ("inactive", "failed"), states
