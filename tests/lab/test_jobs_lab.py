"""rigctl jobs on the lab rigs: detached jobs, their lock, a cut connection, pulling."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from benchlab import RIGCTL, cli_env, rigctl, served_inventory

from rigctl import jobs
from rigctl.bench.matrix import BenchSpec, bench_job_spec, parse_spec
from rigctl.errors import JobBusyError
from rigctl.inventory import Host, Inventory
from rigctl.lab import Lab
from rigctl.results.record import file_sha256
from rigctl.results.store import ResultsStore
from rigctl.ssh import SshClient, SshTarget

MODELS = ["smollm2-135m-q4_1", "smollm2-135m-q4_0"]


# ----------------------------------------------------------------------------------------------- lab


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Inventory:
    return served_inventory(request)


COOLING = "cell 1/1 smollm2-135m-q4_1: cooling down"


def _one_cell_spec(**fields: object) -> BenchSpec:
    """One tiny cell that waits for a card cooler than 40 °C (tests set the stand-in hotter)."""
    return parse_spec({"hosts": ["desktop"], "models": MODELS[:1], "matrix": {"p": [16], "n": [4], "r": 1, "t": [1]},
                       "cooldown": {"threshold_c": 40, "timeout_s": 300, "poll_s": 0.5}, **fields}, "test")


def _wait_job(host: Host, job_id: str, reached: Callable[[jobs.JobInfo], bool], timeout: float) -> jobs.JobInfo:
    deadline = time.monotonic() + timeout
    while not reached(info := jobs.status(host, job_id)):
        assert time.monotonic() < deadline, info
        time.sleep(0.5)
    return info


def _remote(inventory: Inventory, host: str, cmd: str) -> str:
    with SshClient(SshTarget.from_host(inventory.host(host))) as ssh:
        return ssh.run(cmd, timeout=60, check=True).stdout


@pytest.mark.lab
def test_second_bench_on_a_host_is_refused(served: Inventory, tmp_path: Path) -> None:
    lab = Lab.from_inventory(served)
    host = served.host("desktop")
    lab.set_gpu("desktop", temperature=85, temperature_sequence=[])  # the first job waits for the card to cool
    spec = _one_cell_spec()
    first = jobs.start(host, bench_job_spec(host, spec))
    try:
        _wait_job(host, first.id, lambda info: info.message == COOLING, 60)
        with pytest.raises(JobBusyError, match=f"desktop: refused: job {first.id} is running"):
            jobs.start(host, bench_job_spec(host, spec))
        cli = rigctl("bench", "run", "-H", "desktop", "-m", MODELS[1], "-p", "16", "-n", "4", "-r", "1", "-t", "1",
                     results=tmp_path, timeout=120)
        assert cli.returncode == 1
        assert f"error: desktop: refused: job {first.id} is running and holds the 'gpu' lock" in cli.stderr
        # Refused starts leave nothing behind: one job on the host, the lock still the first's.
        assert [j.id for j in jobs.list_jobs(host) if j.state == "running"] == [first.id]
        lock = json.loads(_remote(served, "desktop", f"cat {jobs.JOBS_DIR}/locks/gpu.json"))
        assert lock["job"] == first.id
    finally:
        stopped = jobs.stop(host, first.id)
        lab.set_gpu("desktop", temperature=35, temperature_sequence=[])
    assert stopped.state == "stopped"
    assert _remote(served, "desktop", f"ls {jobs.JOBS_DIR}/locks/").split() == []  # released
    record = json.loads(_remote(served, "desktop", f"cat {shlex.quote(stopped.run_dir or '')}/run.json"))
    assert record["status"] == "stopped"
    assert len(record["extra"]["host_facts"]) > 0


@pytest.mark.lab
def test_job_outlives_a_cut_connection_and_pull_brings_it_home(served: Inventory, tmp_path: Path) -> None:
    Lab.from_inventory(served).set_gpu("desktop", temperature=35, temperature_sequence=[])
    argv = [*RIGCTL, "bench", "run", "-H", "desktop", "-m", ",".join(MODELS), "-p", "16", "-n", "4", "-r", "1",
            "-t", "1", "--cooldown-poll", "0.2", "--wait"]
    follower = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=cli_env(tmp_path))
    assert follower.stdout is not None
    seen = []
    for line in follower.stdout:
        seen.append(line)
        if "cell 1/2 smollm2-135m-q4_1: running llama-bench" in line:
            break
    # The controller dies mid-cell: its SSH connection goes with it.
    follower.send_signal(signal.SIGKILL)
    follower.wait(timeout=30)
    cut = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    job_id = next(line.split()[2] for line in seen if " started " in line)
    host = served.host("desktop")
    final = jobs.wait(host, job_id, poll_s=1, timeout_s=400)
    assert final.state == "done", final.describe()

    store = ResultsStore(tmp_path)
    assert not list(store.runs())  # nothing came home before the pull
    pulled = rigctl("pull", "desktop", results=tmp_path, timeout=120)
    assert pulled.returncode == 0, pulled.stderr
    assert f"+ desktop/{job_id}" in pulled.stdout
    run = store.find(job_id)
    assert run.record.status == "done"
    assert store.verify(run) == []
    assert {f.path for f in run.record.files} == {
        "cells.jsonl", "llama-bench/cell-001-smollm2-135m-q4_1.json", "llama-bench/cell-001-smollm2-135m-q4_1.log",
        "llama-bench/cell-002-smollm2-135m-q4_0.json", "llama-bench/cell-002-smollm2-135m-q4_0.log",
        "llama-bench/cell-001-smollm2-135m-q4_1.clocks.jsonl", "llama-bench/cell-002-smollm2-135m-q4_0.clocks.jsonl"}
    for raw in run.record.files:
        assert file_sha256(run.path / raw.path) == raw.sha256
    cells = [json.loads(line) for line in (run.path / "cells.jsonl").read_text().splitlines()]
    assert cells[1]["started"] > cut  # the second cell began after the connection was gone
    # A second pull copies nothing again.
    again = jobs.pull(host, store)
    assert again.copied == [] and job_id in again.skipped


@pytest.mark.lab
def test_a_killed_job_is_sealed_as_lost_by_pull_and_comes_home(served: Inventory, tmp_path: Path) -> None:
    lab = Lab.from_inventory(served)
    host = served.host("desktop")
    lab.set_gpu("desktop", temperature=85, temperature_sequence=[])  # the job waits for the card to cool
    job = jobs.start(host, bench_job_spec(host, _one_cell_spec(stop_servers=False)))
    try:
        _wait_job(host, job.id, lambda info: info.message == COOLING, 60)
        # SIGKILL leaves the runtime no chance to seal its run or free its lock.
        _remote(served, "desktop", f"systemctl kill --signal=KILL {shlex.quote(job.unit)}")
        _wait_job(host, job.id, lambda info: info.state == "lost", 30)
    finally:
        lab.set_gpu("desktop", temperature=35, temperature_sequence=[])
    record = json.loads(_remote(served, "desktop", f"cat {shlex.quote(job.run_dir or '')}/run.json"))
    assert record["status"] == "running"  # as the dead job left it

    pulled = rigctl("pull", "desktop", results=tmp_path, timeout=120)
    assert pulled.returncode == 0, pulled.stderr
    assert f"+ desktop/{job.id} (lost: its job died without sealing it; partial)" in pulled.stdout
    store = ResultsStore(tmp_path)
    run = store.find(job.id)
    assert run.record.status == "lost" and "killed" in run.record.extra["error"]
    assert run.record.extra["host_facts"] and store.verify(run) == []
    # Sealed on the host too: the job reads lost from its own state, and its lock is gone.
    assert jobs.status(host, job.id).state == "lost"
    assert _remote(served, "desktop", f"ls {jobs.JOBS_DIR}/locks/").split() == []
    again = jobs.pull(host, store)
    assert job.id in again.skipped and again.lost == [] and again.copied == []
