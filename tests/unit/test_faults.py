"""Faults that need no rig (issue 16, class 8): one hash rule for verify and the exporter, a second provision
refused, a cell without results, a full disk under the models module (a real tmpfs).
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from benchlab import RIGCTL
from handmade_runs import bench_record, bench_run

from rigctl.analysis.latest import ResultsReader
from rigctl.bench.matrix import load_run_samples
from rigctl.errors import ConfigError
from rigctl.evals.runner import recorded_targets
from rigctl.fleet.deploy_lock import host_key, hosts_lock
from rigctl.fleet.models import ArtifactStatus, Manifest
from rigctl.fleet.state import FleetState, HostState, ModelFact
from rigctl.fleet.tether import MARK_VARIABLE, marked_processes
from rigctl.forward import server_endpoint
from rigctl.hostside import hash_cache, jobhost, jobrun, play_lock
from rigctl.hostside.llama_server_http import RETRY_ATTEMPTS, attempts_within
from rigctl.hostside.units import RESTART_WAIT_CEILING_S, RESTART_WAIT_MARGIN_S, fact_restart_wait_s, restart_wait_s
from rigctl.inventory import Inventory
from rigctl.jobs import JOBS_DIR, parse_job
from rigctl.llama_http import Retry
from rigctl.results.record import RunRecord
from rigctl.results.record import Server as RecordServer
from rigctl.results.store import ResultsStore

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "inventory" / "lab"
A, B = "a" * 64, "b" * 64


# ----------------------------------------------------------------------------------------------- no rig


def _manifest(sha: str) -> Manifest:
    return Manifest("m", "desktop", "/m.gguf", 1, sha, 1, {}, {}, {}, "", 0.0, {})


def test_verify_and_the_exporter_use_one_rule_manifest_hash_when_no_pin() -> None:
    tampered = ArtifactStatus("desktop", "m", "/m.gguf", _manifest(A), actual_sha256=B, pin=None)
    assert tampered.status == "mismatch"
    assert tampered.describe() == (f"desktop: m: no pin, and /m.gguf has {B} but its manifest records {A} "
                                   "(changed since the models role made it)")
    assert ModelFact("m", "/m.gguf", True, B, None, A, 1).drift is True
    intact = ArtifactStatus("desktop", "m", "/m.gguf", _manifest(A), actual_sha256=A, pin=None)
    assert intact.status == "unpinned" and ModelFact("m", "/m.gguf", True, A, None, A, 1).drift is False
    pinned = ArtifactStatus("desktop", "m", "/m.gguf", _manifest(A), actual_sha256=B, pin=B)
    assert pinned.status == "ok" and ModelFact("m", "/m.gguf", True, B, B, A, 1).drift is False


def test_second_provision_is_refused_naming_the_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This controller's lock is per host, not per inventory file: a copy of the inventory (a second checkout)
    naming the same rigs is refused before Ansible starts, naming the run that holds them."""
    env = {**os.environ, "RIGCTL_CACHE_DIR": str(tmp_path / "cache"),
           "RIGCTL_LAB_SLOT": os.environ.get("RIGCTL_LAB_SLOT", "3")}
    copy = tmp_path / "second-checkout" / "lab"
    shutil.copytree(LAB, copy)
    monkeypatch.setenv("RIGCTL_CACHE_DIR", env["RIGCTL_CACHE_DIR"])
    monkeypatch.setenv("RIGCTL_LAB_SLOT", env["RIGCTL_LAB_SLOT"])
    hosts = Inventory.load(LAB).hosts.values()
    first = min(hosts, key=host_key)
    with hosts_lock(hosts, command="rigctl provision --tags llama_server"):
        started = time.monotonic()
        done = subprocess.run([*RIGCTL, "-i", str(copy), "provision", "--limit", first.name],
                              capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
        refused_in = time.monotonic() - started
    # Released with the block (and by the kernel if its holder dies): the next run may take it.
    with hosts_lock(hosts, command="again"):
        pass
    assert done.returncode == 1, done.stdout + done.stderr
    line, = done.stderr.strip().splitlines()
    assert re.fullmatch(
        rf"error: {first.name}: refused: pid {os.getpid()} on {re.escape(getpass.getuser())}@"
        rf"{re.escape(socket.gethostname())} \(`rigctl provision --tags llama_server`, since [0-9T:-]+Z\) is running "
        rf"a play against {re.escape(host_key(first))}; wait for it to finish", line), line
    assert "TASK" not in done.stdout and refused_in < 30  # refused before Ansible started


def _start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _wait_gone(pids: list[int], timeout: float) -> float:
    started = time.monotonic()
    while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
              for pid in pids):
        assert time.monotonic() - started < timeout, [pid for pid in pids if Path(f"/proc/{pid}").exists()]
        time.sleep(0.05)
    return time.monotonic() - started


# What rigctl does around a play, in a child that is then SIGKILLed alone: a tether, and under it processes
# like ansible-playbook's (one in a session of its own, as mitogen puts its ssh), which print their pids.
_CONTROLLER = """
import os, subprocess, sys, time
from rigctl.fleet.tether import Tether
with Tether() as tether:
    env = {**os.environ, **tether.env}
    play = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env)
    ssh = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env, start_new_session=True)
    print(play.pid, ssh.pid, tether._watchdog.pid, flush=True)
    if sys.argv[1] == "normal":
        play.kill(); play.wait()
    else:
        time.sleep(300)
"""


def test_a_killed_controller_takes_its_play_with_it() -> None:
    """SIGKILL of the controller alone (not its process group): every process of its play, including one in a
    session of its own, is gone within seconds."""
    controller = subprocess.Popen([sys.executable, "-c", _CONTROLLER, "killed"], stdout=subprocess.PIPE, text=True,
                                  cwd=REPO)
    assert controller.stdout is not None
    play, ssh, watchdog = map(int, controller.stdout.readline().split())
    # A child's /proc environ can read empty for a moment after its exec on a busy machine: look again, briefly.
    deadline = time.monotonic() + 5
    while sorted(marked_processes(_mark_of(play))) != sorted([play, ssh]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(marked_processes(_mark_of(play))) == sorted([play, ssh])
    os.kill(controller.pid, signal.SIGKILL)
    controller.wait()
    took = _wait_gone([play, ssh, watchdog], timeout=10)
    print(f"the killed controller's play was gone {took:.1f} s after its SIGKILL")


def test_a_play_that_ends_normally_leaves_nothing_and_its_locks_free(tmp_path: Path) -> None:
    controller = subprocess.run([sys.executable, "-c", _CONTROLLER, "normal"], capture_output=True, text=True,
                                cwd=REPO, timeout=60)
    assert controller.returncode == 0, controller.stderr
    play, ssh, watchdog = map(int, controller.stdout.split())
    _wait_gone([play, ssh, watchdog], timeout=10)  # what the play left (the "ssh") went with the block


# A play under rigctl's run_playbook, on this machine only (implicit localhost, no rig): it says when its task
# starts, then prints how run_playbook ended.
_PLAY_UNDER_CTRL_C = """
import sys
from pathlib import Path
from rigctl.fleet.deploy import run_playbook
from rigctl.inventory import Inventory
try:
    run_playbook(Inventory.load(Path(sys.argv[1])), "wait.yml", project=Path(sys.argv[2]), preflight=False,
                 on_task=lambda name: print("task", name, flush=True))
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
print("returned", flush=True)
"""


def test_a_ctrl_c_during_a_play_is_an_interrupt_not_a_failed_play(tmp_path: Path) -> None:
    """ansible-runner takes the Ctrl-C, ends ansible-playbook and reports the play ``canceled`` (rc 254):
    run_playbook hands it on as KeyboardInterrupt, so a run open around the play is sealed stopped (a
    DeployError would seal it failed)."""
    project = tmp_path / "project"
    (project / "playbooks").mkdir(parents=True)
    (project / "ansible.cfg").write_text("[defaults]\nretry_files_enabled = False\n")
    (project / "playbooks" / "wait.yml").write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
        "    - name: Wait\n      ansible.builtin.command: sleep 120\n      changed_when: false\n")
    env = {**os.environ, "RIGCTL_CACHE_DIR": str(tmp_path / "cache")}
    child = subprocess.Popen([sys.executable, "-c", _PLAY_UNDER_CTRL_C, str(LAB), str(project)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "task Wait", (line, child.stderr.read() if child.poll() is not None else "")
    started = time.monotonic()
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert (child.returncode, out.strip()) == (130, "interrupted"), (out, err)
    print(f"the interrupted play ended {time.monotonic() - started:.1f} s after its Ctrl-C")


def _mark_of(pid: int) -> str:
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(f"{MARK_VARIABLE}=".encode()):
            return item.split(b"=", 1)[1].decode()
    raise AssertionError(f"pid {pid} carries no mark")


def test_the_host_lock_refuses_a_second_play_and_is_freed_by_its_holders_connection(tmp_path: Path) -> None:
    """The play_lock role's code on a host (here: this machine, a ``sleep`` standing for the controller's SSH
    connection): a second play is refused naming the first's holder; when the first's connection ends its
    lock goes within a second and the next play takes over, reporting the stale record; release frees it."""
    lock_dir = str(tmp_path / "lock")
    connection = subprocess.Popen(["sleep", "300"])
    link = (connection.pid, _start_time(connection.pid))
    first_holder = {**play_lock.controller_holder("rigctl provision"), "controller": "laptop-a"}
    first = play_lock.acquire(first_holder, lock_dir=lock_dir, link=link)
    assert first["stale"] is None and first["keeper_pid"] > 0
    with pytest.raises(play_lock.LockBusy) as busy:
        play_lock.acquire({"controller": "laptop-b", "pid": 1, "command": "rigctl provision"}, lock_dir=lock_dir,
                          link=link, wait_s=0.5)
    assert str(busy.value).startswith(f"refused: pid {os.getpid()} on {getpass.getuser()}@laptop-a "
                                      f"(`rigctl provision`, since ")
    assert play_lock.holder(lock_dir)["token"] == first["token"]

    connection.kill()
    connection.wait()
    gone = _wait_gone([first["keeper_pid"]], timeout=5)
    second_link = (os.getpid(), _start_time(os.getpid()))
    second = play_lock.acquire({"controller": "laptop-b", "pid": 2, "command": "again"}, lock_dir=lock_dir,
                               link=second_link)
    assert second["stale"]["token"] == first["token"] and second["stale"]["controller"] == "laptop-a"
    print(f"a lock whose holder's connection ended was free {gone:.1f} s later")
    assert play_lock.release("not-the-token", lock_dir=lock_dir) is False
    assert play_lock.release(second["token"], lock_dir=lock_dir) is True
    _wait_gone([second["keeper_pid"]], timeout=5)
    assert play_lock.holder(lock_dir) is None


def test_a_command_run_while_connected_stops_when_the_connection_ends() -> None:
    """What the llama_cpp role's compile runs under: its whole process group stops, status 75."""
    connection = subprocess.Popen(["sleep", "300"])
    argv = play_lock.while_connected(sys.executable, ["sh", "-c", "sleep 300 & sleep 300"],
                                     link=(connection.pid, _start_time(connection.pid)))
    watched = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    assert watched.poll() is None
    children = [int(p) for p in Path(f"/proc/{watched.pid}/task/{watched.pid}/children").read_text().split()]
    connection.kill()
    connection.wait()
    assert watched.wait(timeout=10) == play_lock.DISCONNECTED
    assert "the controller's connection" in (watched.stderr.read() if watched.stderr else "")
    _wait_gone(children, timeout=10)
    # A command that ends by itself gives its own status.
    done = subprocess.run(play_lock.while_connected(sys.executable, ["sh", "-c", "exit 3"],
                                                    link=(os.getpid(), _start_time(os.getpid()))), timeout=30)
    assert done.returncode == 3


def test_a_cell_without_results_is_not_a_successful_cell(tmp_path: Path) -> None:
    run_dir = bench_run(tmp_path, "desktop", "bench-1", [("m", [bench_record((512, 0), [10.0, 11.0])])])
    raw = next((run_dir / "llama-bench").glob("*.json"))
    raw.write_text("")
    run = ResultsStore(tmp_path).find("desktop/bench-1")
    with pytest.raises(ConfigError, match=r"empty \(0 bytes\): llama-bench wrote no results"):
        load_run_samples(run)
    raw.write_text("[]")
    with pytest.raises(ConfigError, match="an empty array: llama-bench wrote no results"):
        load_run_samples(run)
    # What the bench task writes now for such a cell: marked with its error, left out of every summary.
    cells = run_dir / "cells.jsonl"
    cells.write_text(json.dumps({**json.loads(cells.read_text()), "error": "llama-bench exited 0 but wrote no "
                                                                            "results"}) + "\n")
    assert load_run_samples(run) == []


@pytest.fixture
def small_disk() -> Any:
    """A 2 MiB tmpfs: a real file system that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = Path(tempfile.mkdtemp(prefix="rigctl-full-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True, timeout=30)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False, timeout=30)
        mount.rmdir()


def test_models_artifact_on_a_full_disk_says_the_disk_is_full(small_disk: Path, tmp_path: Path) -> None:
    """The models role's own module (as Ansible runs it) copying a 4 MiB artifact onto a 2 MiB disk."""
    source = tmp_path / "in.gguf"
    source.write_bytes(b"GGUF" + os.urandom(4 << 20))
    args = {"name": "big", "path": str(small_disk / "big.gguf"), "kind": "copy", "input": str(source),
            "host": "controller"}
    # Ansible's own defaults, not the project's, but for where the roles' module_utils live.
    (tmp_path / "ansible.cfg").write_text(f"[defaults]\nmodule_utils = {REPO / 'rigctl/hostside'}\n")
    ansible = str(Path(sys.executable).parent / "ansible")
    done = subprocess.run(
        [ansible, "localhost", "-c", "local", "-M", str(REPO / "roles/models/library"), "-m", "models_artifact",
         "-a", json.dumps(args)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg"), "ANSIBLE_LOCALHOST_WARNING": "0"})
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "controller: big: copying" in out and "No space left on device" in out, out
    assert "disk full:" in out and f"free on the file system of {small_disk}" in out, out
    assert "Traceback" not in out
    assert list(small_disk.iterdir()) == []  # the partial file is gone


# ----------------------------------------------------------------------------------------------- issue 28, item 5


def test_an_eval_rides_through_a_restart_within_a_ceiling() -> None:
    """The retry budget: the unit's restart delay plus twice the load time measured at deploy, plus a margin,
    at most the ceiling; the attempts' shortest waits cover it."""
    fact = json.dumps({"restart_sec": 2, "stop_timeout_sec": 5,
                       "instances": {"smollm2": {"load_s": 1.5, "measured": "2026-12-01T00:00:00Z"}}})
    wait_s = fact_restart_wait_s(fact, "smollm2")
    assert wait_s == restart_wait_s(2, 1.5) == 2 + 3 + RESTART_WAIT_MARGIN_S
    retry = Retry.within(wait_s)
    assert retry.attempts > RETRY_ATTEMPTS
    waits = [min(retry.max_wait, retry.backoff * 2**n) * 0.75 for n in range(retry.attempts - 1)]
    assert sum(waits) >= wait_s
    assert sum(waits[:-1]) < wait_s  # no more attempts than that takes
    assert fact_restart_wait_s(fact, "other") is None and fact_restart_wait_s("not json", "smollm2") is None
    assert restart_wait_s(2, 3600) == RESTART_WAIT_CEILING_S
    assert attempts_within(0) == RETRY_ATTEMPTS <= Retry.within(0).attempts


def test_a_fan_out_rides_through_a_restart_of_its_slowest_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """`eval run` and a campaign's eval step size their retries by the slowest inventory server of the run; a
    bare URL has no deploy to say, and gets the default."""
    from rigctl.evals import runner
    from rigctl.evals.target import inventory_target, url_target

    inventory = Inventory.load(LAB)
    asked: list[tuple[str, str]] = []

    def measured(host, server: str) -> Retry | None:  # what each rig's llama_server fact says
        asked.append((host.name, server))
        return {"desktop": Retry.within(restart_wait_s(2, 30)), "laptop": Retry.within(restart_wait_s(2, 1))}.get(
            host.name)

    monkeypatch.setattr(runner, "restart_retry", measured)
    targets = [inventory_target(inventory.host(name), "smollm2", facts=False) for name in ("laptop", "desktop")]
    assert runner.retry_for(targets) == Retry.within(restart_wait_s(2, 30))
    assert asked == [("laptop", "smollm2"), ("desktop", "smollm2")]
    asked.clear()
    assert runner.retry_for([url_target("http://127.0.0.1:9/")]) == Retry() and asked == []


def test_resume_finds_a_single_inventory_servers_key(tmp_path: Path) -> None:
    """`eval run --resume RUN` alone: the recorded server is found in the inventory, its key with it."""
    inventory = Inventory.load(LAB)
    served = inventory.host("desktop").server("smollm2")
    endpoint = server_endpoint(inventory.host("desktop"), served)
    run_dir = tmp_path / "desktop" / "eval-1"
    run_dir.mkdir(parents=True)
    record = RunRecord(id="eval-1", kind="eval", host="desktop", started="2026-12-01T00:00:00.000000Z",
                       servers=[RecordServer(name="smollm2", host="desktop", endpoint=endpoint.url)])
    record.save(run_dir)
    targets = recorded_targets(ResultsStore(tmp_path).find("desktop/eval-1"), lambda: inventory)
    assert [t.endpoint.url for t in targets] == [endpoint.url]
    assert targets[0].endpoint.api_key == endpoint.api_key and endpoint.api_key


def test_models_list_reads_the_hash_cache_the_jobs_write() -> None:
    assert str(jobrun.hash_cache_path({"job_dir": f"{JOBS_DIR}/job-1"})) == hash_cache.HOST_CACHE


def test_models_list_compares_the_files_own_hash_with_the_pin(tmp_path: Path) -> None:
    """What `rigctl models list` runs on a host: the file's hash, cached by its identity; a file changed since
    (tampered) is hashed again, so its pin no longer says ok."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 1000)
    (tmp_path / "m.gguf.manifest.json").write_text(json.dumps({"sha256": hashlib.sha256(model.read_bytes())
                                                               .hexdigest()}))
    cache = tmp_path / "sha256-cache.json"
    pin = hashlib.sha256(model.read_bytes()).hexdigest()
    first = hash_cache.inspect({"m": str(model)}, cache)["m"]
    assert first["sha256"] == pin and first["sha256_from"] == "hashed now"
    assert hash_cache.inspect({"m": str(model)}, cache)["m"]["sha256_from"].startswith("cache")
    with model.open("ab") as handle:
        handle.write(b"x")
    again = hash_cache.inspect({"m": str(model)}, cache)["m"]
    assert again["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest() != pin
    status = ArtifactStatus("desktop", "m", str(model), _manifest(pin), actual_sha256=again["sha256"], pin=pin)
    assert status.status == "mismatch"


def test_a_job_that_could_not_write_its_run_ends_failed_with_the_cause(small_disk: Path, tmp_path: Path) -> None:
    """Root's step after a job whose results disk was full from the start: the job shows as failed with the
    disk named, not lost (nor "collecting facts") forever."""
    job_dir = tmp_path / "jobs" / "job-1"
    job_dir.mkdir(parents=True)
    spec = {"id": "job-1", "kind": "bench", "host": "desktop", "unit": "rigctl-job-job-1.service",
            "results_dir": str(small_disk), "job_dir": str(job_dir)}
    (job_dir / "spec.json").write_text(json.dumps(spec))
    with contextlib.suppress(OSError), (small_disk / "filler").open("wb") as handle:
        while True:
            handle.write(b"\0" * 65536)
    (job_dir / "output.log").write_text("jobrun: disk full: no space left on device\n")
    assert jobrun.finish(job_dir) == 0
    state = jobhost.job_state(str(job_dir), {}, None)
    assert state["state"] == "failed" and state["error"].startswith(f"disk full on {small_disk}"), state
    parsed = parse_job("desktop", {"spec": spec, "state": state, "active": False})
    assert parsed.state == "failed" and parsed.error == state["error"]


def test_a_job_killed_without_a_word_is_lost_not_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Root's step after a job SIGKILLed (systemd: SERVICE_RESULT=signal) with room on its disk and no complaint:
    no cause is made up; the job is lost, for `rigctl pull` to seal. One that exited by itself says how."""
    job_dir = tmp_path / "jobs" / "job-1"
    job_dir.mkdir(parents=True)
    spec = {"id": "job-1", "kind": "bench", "host": "desktop", "results_dir": str(tmp_path / "results"),
            "job_dir": str(job_dir)}
    monkeypatch.setenv("SERVICE_RESULT", "signal")
    monkeypatch.setenv("EXIT_STATUS", "KILL")
    assert jobrun.unsealed_cause(job_dir, spec) is None
    monkeypatch.setenv("SERVICE_RESULT", "exit-code")
    monkeypatch.setenv("EXIT_STATUS", "1")
    assert jobrun.unsealed_cause(job_dir, spec) == ("the job's unit ended (exit-code, exit status 1) without "
                                                    "writing a final state")


def test_the_exporter_says_a_bad_record_once_and_when_a_host_goes_down_and_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "desktop" / "eval-bad").mkdir(parents=True)
    (tmp_path / "desktop" / "eval-bad" / "run.json").write_text("{not json")
    reader = ResultsReader(ResultsStore(tmp_path))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            reader.latest()
    assert sum("eval-bad" in r.getMessage() for r in caplog.records) == 1, caplog.text
    caplog.clear()
    watcher = SimpleNamespace(_up={})
    with caplog.at_level(logging.WARNING):
        for up in (True, True, False, False, True, True):
            FleetState._log_changes(watcher, {"desktop": HostState("desktop", up=up, error=None if up else "refused")})
    assert [r.getMessage() for r in caplog.records] == ["desktop: down: refused", "desktop: back up"]
