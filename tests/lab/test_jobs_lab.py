"""rigctl jobs on the lab rigs: detached jobs, their lock, a cut connection, pulling; what a job may write and
how exposed it and a probe server are beside the server unit."""

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
from rigctl.lab.rigs import Lab
from rigctl.results.record import file_sha256, new_run_id
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


# ----------------------------------------------------------------------------------------------- privileges

# Run by the bench job as its "llama-bench" (/bin/sh -m SCRIPT -d PATH,PATH,... -o json): every write a
# model exploit in llama-bench might try, each reported as it went, as llama-bench's JSON array on stdout.
_ESCAPE = r"""
out='['
try() { if ( printf 'escaped\n' >> "$1" ) 2>/dev/null; then w=true; else w=false; fi
        out="$out{\"path\": \"$1\", \"wrote\": $w},"; }
for arg in "$@"; do
    case "$arg" in /*) old=$IFS; IFS=,; set -f; for path in $arg; do IFS=$old; try "$path"; done; IFS=$old ;; esac
done
systemctl stop llama-server@smollm2.service >/dev/null 2>&1; stop=$?
printf '%s{"uid": %s, "stop_rc": %s}]\n' "$out" "$(id -u)" "$stop"
"""


def _exposure(ssh: SshClient, unit: str) -> float:
    """``systemd-analyze security UNIT``'s overall exposure (0-10, lower is safer)."""
    text = ssh.run(f"systemd-analyze security --no-pager {shlex.quote(unit)}", timeout=60, check=True).stdout
    line = next(line for line in text.splitlines() if "Overall exposure level" in line)
    return float(line.split(":")[1].split()[0])


@pytest.mark.lab
def test_a_job_cannot_write_outside_its_run_directory(served: Inventory, tmp_path: Path) -> None:
    host = served.host("desktop")
    job_id = new_run_id("bench")
    job_dir, run_dir = f"{jobs.JOBS_DIR}/{job_id}", f"{jobs.RESULTS_DIR}/desktop/{job_id}"
    # Files the job must not change (its own code and spec, the hash cache, the server's flags) and places it
    # must not add to: the job tree, another run's place, the models, the server's own writable directory.
    existing = [f"{job_dir}/spec.json", f"{job_dir}/jobrun.py", "/var/lib/rigctl/sha256-cache.json",
                "/etc/llama-server/smollm2.args"]
    planted = [f"{job_dir}/planted", f"{jobs.JOBS_DIR}/locks/planted.json", f"{jobs.RESULTS_DIR}/desktop/planted",
               "/var/lib/rigctl/models/planted", "/var/lib/llama-server/planted", "/root/planted",
               "/usr/local/bin/planted"]
    inside = f"{run_dir}/planted"
    script = tmp_path / "escape.sh"
    script.write_text(_ESCAPE)
    args_before = _remote(served, "desktop", "sha256sum /etc/llama-server/smollm2.args")
    # A bench whose llama-bench is the script: it runs where and as llama-bench would, in the job's unit.
    spec = jobs.JobSpec(kind="bench", task="bench_task", lock="gpu", files={"escape.sh": script},
                        artifacts=(f"{job_dir}/escape.sh",), params={
                            "llama_bench": "/bin/sh", "models": [{"name": "escape", "path": f"{job_dir}/escape.sh"}],
                            "matrix": {"d": [*existing, *planted, inside, "/tmp/planted"]}, "rounds": 1,
                            "order": "alternate", "cooldown": {"threshold_c": None}, "clocks": {"sample_s": 1.0},
                            "cell_timeout_s": 120})
    started = jobs.start(host, spec, job_id=job_id)
    final = jobs.wait(host, started.id, poll_s=0.2, timeout_s=300)
    assert final.state == "done", final.describe()
    *tries, who = json.loads(_remote(served, "desktop", f"cat {run_dir}/llama-bench/cell-001-escape.json"))
    wrote = {t["path"]: t["wrote"] for t in tries}
    assert wrote == {**dict.fromkeys([*existing, *planted], False), inside: True, "/tmp/planted": True}, wrote
    assert who["uid"] == int(_remote(served, "desktop", "id -u llama")) != 0  # not root
    assert who["stop_rc"] != 0  # and no power over the servers
    # On the rig: nothing planted, nothing changed; the job's /tmp was its own; the server kept serving.
    found = _remote(served, "desktop", "; ".join(f"test -e {shlex.quote(p)} && echo {shlex.quote(p)}"
                                                 for p in [*planted, "/tmp/planted"]) + "; true")
    assert found.split() == []
    assert "escaped" not in _remote(served, "desktop", "cat " + " ".join(existing))
    assert json.loads(_remote(served, "desktop", f"cat {job_dir}/spec.json"))["id"] == job_id
    assert _remote(served, "desktop", "sha256sum /etc/llama-server/smollm2.args") == args_before
    assert _remote(served, "desktop", "systemctl is-active llama-server@smollm2.service").strip() == "active"
    assert _remote(served, "desktop", f"cat {inside}") == "escaped\n"
    # The tree is root's, the run directory the job's.
    owners = _remote(served, "desktop", f"stat -c '%U %n' /var/lib/rigctl {jobs.JOBS_DIR} {job_dir} "
                                        f"{job_dir}/spec.json {jobs.RESULTS_DIR} {jobs.RESULTS_DIR}/desktop {run_dir}")
    assert [line.split()[0] for line in owners.splitlines()] == ["root"] * 6 + ["llama"], owners


@pytest.mark.lab
def test_a_bench_job_and_a_probe_server_are_no_more_exposed_than_the_server_unit(served: Inventory) -> None:
    from rigctl.fleet.servers import probe_server

    lab = Lab.from_inventory(served)
    host = served.host("desktop")
    lab.set_gpu("desktop", temperature=85, temperature_sequence=[])  # the job waits in its cool-down
    job = jobs.start(host, bench_job_spec(host, _one_cell_spec()))
    with SshClient(SshTarget.from_host(host)) as ssh:
        try:
            _wait_job(host, job.id, lambda info: info.message == COOLING, 60)
            server = _exposure(ssh, "llama-server@smollm2.service")
            bench = _exposure(ssh, job.unit)
            shown = ssh.run(f"systemctl show -p User -p NoNewPrivileges -p ProtectSystem -p ReadWritePaths "
                            f"-p CapabilityBoundingSet {job.unit}", timeout=30).stdout.splitlines()
        finally:
            stopped = jobs.stop(host, job.id)
            lab.set_gpu("desktop", temperature=35, temperature_sequence=[])
        assert stopped.state == "stopped"
        assert {"User=llama", "NoNewPrivileges=yes", "ProtectSystem=strict", "CapabilityBoundingSet=",
                f"ReadWritePaths={job.run_dir}"} <= set(shown), shown
        instance = host.server("smollm2")
        with probe_server(ssh, instance, {"ctx_size": 512}, instance.port + 150, "ctx 512") as probe:
            probed = _exposure(ssh, probe.unit)
    print(f"systemd-analyze security: llama-server@ {server}, bench job {bench}, probe {probed}")  # shown with -rP
    assert 0 < server <= 6.0
    assert bench <= server and probed <= server, (bench, probed, server)
