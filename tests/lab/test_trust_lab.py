"""The trust boundary against the real lab rigs: a rig whose host key changed, a rig that lies about its
runs, and where an API key may be found after evals (nowhere but the role's key file)."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import time
from pathlib import Path

import pytest
from benchlab import REPO, RIGCTL, cli_env, served_inventory
from labkeys import RESTORE_HOST_KEYS, ROTATE_HOST_KEYS

from rigctl.fleet.deploy import TaskEvent, run_playbook
from rigctl.inventory import Inventory
from rigctl.jobs import JOBS_DIR, RESULTS_DIR
from rigctl.results.record import RawFile, RunRecord
from rigctl.ssh import SshClient, SshTarget

pytestmark = pytest.mark.lab


def _cli(*args: str, results: Path, extra_env: dict[str, str] | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RIGCTL, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**cli_env(results), **(extra_env or {})}, check=False)


# ----------------------------------------------------------------------------------------------- host keys


def test_provision_refuses_a_rig_whose_host_key_changed(lab_up: Inventory, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    desktop = SshTarget.from_host(lab_up.host("desktop"))
    with SshClient(desktop) as old:  # this session survives sshd reloading
        old.run(ROTATE_HOST_KEYS, timeout=30)
        try:
            out = _cli("provision", results=tmp_path)
            assert out.returncode != 0
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1, out.stderr
            assert lines[0].startswith("error: desktop: host key rejected: ")
            assert f"differs from the one in {desktop.known_hosts}" in lines[0]
            assert "TASK" not in out.stdout and "laptop" not in out.stdout  # nothing ran, on either rig

            # Ansible's own check, without rigctl's preflight: mitogen (ansible.cfg's strategy) refuses the
            # host too, even with ANSIBLE_HOST_KEY_CHECKING=False in the caller's environment.
            monkeypatch.setenv("ANSIBLE_HOST_KEY_CHECKING", "False")
            events: list[TaskEvent] = []
            result = run_playbook(lab_up, "site.yml", limit="desktop", preflight=False, on_event=events.append)
            outcome = result.hosts["desktop"]
            assert outcome.unreachable == 1 and outcome.changed == 0, outcome
            # The only task before the refusal is Ansible's own check of the play lock role's arguments, which
            # runs on the controller: nothing reached the rig.
            assert [e.status for e in events] == ["ok", "unreachable"], events
            assert events[0].task.startswith("Validating arguments against arg spec"), events
            assert events[1].task == "Take the host's play lock", events
            # mitogen's words for ssh's "Host key verification failed" (plain ssh's, without mitogen).
            assert re.search(r"mismatching host key|host key verification failed", outcome.failure or "", re.I), \
                outcome.failure
        finally:
            old.run(RESTORE_HOST_KEYS, timeout=30)
    with SshClient(desktop, retries=5, backoff_base=0.2) as restored:
        assert restored.run("hostname", timeout=10).stdout == "desktop\n"


# ----------------------------------------------------------------------------------------------- a lying rig

HONEST = "bench-20261201T100000Z-0001"
SETUID = "eval-20261201T100000Z-0002"
OTHER_ID = "eval-20261201T100000Z-0003"
ABSOLUTE = "eval-20261201T100000Z-0004"
TRAVERSING = "eval-20261201T100000Z-0005"
CELLS_OUT = "bench-20261201T100000Z-0006"
OTHER_HOST = "eval-20261201T100000Z-0007"
NOT_AN_ID = "not-a-run"

# Builds the runs under RESULTS_DIR/desktop on the rig, each sealed as the job runtime would (sha256 of
# every file in run.json), then tampered with as described below.
_MAKE_RUNS = r"""
import hashlib, json, os, sys
root = sys.argv[1]
spec = json.load(sys.stdin)
for run_id, run in spec.items():
    d = os.path.join(root, run["dir"])
    os.makedirs(d, exist_ok=True)
    files = []
    for rel, (text, mode) in run["files"].items():
        path = os.path.join(d, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as out:
            out.write(text)
        os.chmod(path, int(mode, 8))
        data = text.encode()
        files.append({"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
    for rel in run.get("extra_paths", []):  # listed, pointing outside the run
        data = open(rel if rel.startswith("/") else os.path.join(d, rel), "rb").read()
        files.append({"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
    record = {"id": run.get("id", run_id), "kind": run["kind"], "host": run.get("host", "desktop"),
              "started": "2026-12-01T10:00:00.000000Z", "ended": "2026-12-01T10:01:00.000000Z",
              "status": "done", "files": files}
    with open(os.path.join(d, "run.json"), "w") as out:
        json.dump(record, out)
    os.chmod(d, 0o777)
"""

# A rig that lies in its listing too: python3 on the rig's PATH answers pull's run listing with two more
# entries, a traversing id and an absolute one, each with a record that agrees with it.
_LYING_PYTHON = r"""#!/bin/sh
out=$(/usr/bin/python3 "$@") || exit $?
case "$*" in
  *%(results)s/desktop*) printf '%%s' "$out" | /usr/bin/python3 -c '
import json, sys
runs = json.load(sys.stdin)
for bad in ("../ESCAPED", "%(absolute)s"):
    runs[bad] = {"record": {"id": bad, "kind": "eval", "host": "desktop", "started": "x", "status": "done",
                            "files": []}, "active": False}
print(json.dumps(runs))' ;;
  *) printf '%%s\n' "$out" ;;
esac
"""


def _runs_on_the_rig() -> dict[str, dict]:
    cells = json.dumps({"index": 1, "rc": 0, "artifact": "m", "raw": "/etc/hostname", "log": None}) + "\n"
    return {
        HONEST: {"dir": HONEST, "kind": "bench", "files": {
            "cells.jsonl": (json.dumps({"index": 1, "rc": 0, "artifact": "m", "raw": "llama-bench/cell-001.json",
                                        "log": "llama-bench/cell-001.log"}) + "\n", "644"),
            "llama-bench/cell-001.json": ("[]\n", "600"), "llama-bench/cell-001.log": ("ok\n", "666")}},
        SETUID: {"dir": SETUID, "kind": "eval", "files": {"answers.jsonl": ('{"id": 1}\n', "6777")}},
        OTHER_ID: {"dir": OTHER_ID, "id": "eval-20261201T100000Z-0bad", "kind": "eval",
                   "files": {"answers.jsonl": ("{}\n", "644")}},
        ABSOLUTE: {"dir": ABSOLUTE, "kind": "eval", "files": {"answers.jsonl": ("{}\n", "644")},
                   "extra_paths": ["/etc/hostname"]},
        TRAVERSING: {"dir": TRAVERSING, "kind": "eval", "files": {"answers.jsonl": ("{}\n", "644")},
                     "extra_paths": [f"../{SETUID}/answers.jsonl"]},
        CELLS_OUT: {"dir": CELLS_OUT, "kind": "bench", "files": {"cells.jsonl": (cells, "644")}},
        OTHER_HOST: {"dir": OTHER_HOST, "host": "laptop", "kind": "eval", "files": {"answers.jsonl": ("{}\n", "644")}},
        NOT_AN_ID: {"dir": NOT_AN_ID, "id": NOT_AN_ID, "kind": "eval", "files": {"answers.jsonl": ("{}\n", "644")}},
    }


def test_an_sftp_read_of_a_job_output_linked_to_a_device_stops_at_its_recorded_size(lab_up: Inventory,
                                                                                    tmp_path: Path) -> None:
    """A job's output the job left as a link to /dev/zero: the pull's SFTP read stops just past the size its
    record names, with a TransferError naming the file, and leaves nothing behind (it streamed for ever)."""
    from rigctl.errors import TransferError

    host = lab_up.host("desktop")
    run_dir = f"{RESULTS_DIR}/desktop/eval-20261207T120000Z-{os.getpid() % 10000:04d}"
    recorded = 4096
    target = tmp_path / "answers.jsonl"
    with SshClient(SshTarget.from_host(host)) as ssh:
        ssh.run(f"mkdir -p {run_dir} && ln -sfn /dev/zero {run_dir}/answers.jsonl", timeout=30)
        try:
            started = time.monotonic()
            with pytest.raises(TransferError, match=f"answers.jsonl.*more than the {recorded} bytes"):
                ssh.get(f"{run_dir}/answers.jsonl", target, timeout=60, max_bytes=recorded)
            took = time.monotonic() - started
        finally:
            ssh.run(f"rm -rf {run_dir}", timeout=30)
    assert took < 30, f"the read took {took:.1f} s"
    assert list(tmp_path.iterdir()) == []


def test_pull_from_a_lying_rig_brings_home_only_the_honest_runs(lab_up: Inventory, tmp_path: Path) -> None:
    host = lab_up.host("desktop")
    results = tmp_path / "store" / "results"
    absolute = f"/tmp/rigctl-escaped-{os.getpid()}"
    runs = _runs_on_the_rig()
    root = f"{RESULTS_DIR}/desktop"
    with SshClient(SshTarget.from_host(host)) as ssh:
        # Runs other tests of the session left on the rig are honest and come home too.
        earlier = set(ssh.run(f"ls {root} 2>/dev/null", timeout=30, check=False).stdout.split())
        ssh.run(f"python3 -c {shlex.quote(_MAKE_RUNS)} {root}", timeout=30, input=json.dumps(runs))
        ssh.run("cat > /usr/local/bin/python3 && chmod 755 /usr/local/bin/python3", timeout=30,
                input=_LYING_PYTHON % {"results": RESULTS_DIR, "absolute": absolute})
        try:
            out = _cli("pull", "desktop", results=results)
        finally:
            dirs = " ".join(f"{root}/{r['dir']}" for r in runs.values())
            ssh.run(f"rm -f /usr/local/bin/python3; rm -rf {dirs}", timeout=30)
    assert out.returncode != 0, out.stdout
    assert f"desktop/{HONEST}" in out.stdout and f"desktop/{SETUID}" in out.stdout, out.stderr
    refused = [line for line in out.stderr.splitlines() if "refused" in line]
    expected = {OTHER_ID: "has id", ABSOLUTE: "/etc/hostname", TRAVERSING: "leaves its directory",
                CELLS_OUT: "cells.jsonl line 1 raw", OTHER_HOST: "names host 'laptop'", NOT_AN_ID: "not a run id",
                "../ESCAPED": "not a run id", absolute: "not a run id"}
    assert len(refused) == len(expected), out.stderr
    for run_id, reason in expected.items():
        line = [x for x in refused if f"run {run_id!r} refused" in x]
        assert len(line) == 1 and reason in line[0], (run_id, out.stderr)

    # Only the honest runs came home, nothing half-written, nothing outside the store, every mode as set here.
    assert sorted(p.name for p in (results / "desktop").iterdir() if p.name not in earlier) == sorted([HONEST, SETUID])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["results"]
    assert not Path(absolute).exists()
    for path in results.rglob("*"):
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert not path.is_symlink() and mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
    record = RunRecord.load(results / "desktop" / HONEST)
    assert [f.path for f in record.files] == ["cells.jsonl", "llama-bench/cell-001.json", "llama-bench/cell-001.log"]
    assert isinstance(record.files[0], RawFile)


# ----------------------------------------------------------------------------------------------- secrets


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Inventory:
    return served_inventory(request)


def test_no_key_in_records_job_dirs_or_logs_after_evals(served: Inventory, tmp_path: Path) -> None:
    host = served.host("desktop")
    key = str(host.vars["llama_server_api_key"])
    assert len(key) >= 8
    dataset = tmp_path / "arith.jsonl"
    dataset.write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n"
                               for q, a in (("What is 2 + 3?", "5"), ("What is 10 - 4?", "6"))))
    task = tmp_path / "arith.yaml"
    task.write_text("name: trust-arith\nscorer: gsm8k\ndataset:\n  path: arith.jsonl\nmax_tokens: 16\n")
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    results = tmp_path / "results"

    local = _cli("-vv", "eval", "run", "--host", "desktop", "--server", "smollm2", "--task", str(task),
                 "--api-key-file", str(key_file), results=results)
    assert local.returncode == 0, local.stderr
    remote = _cli("-vv", "eval", "run", "--host", "desktop", "--server", "smollm2", "--task", str(task),
                  "--remote", results=results)
    assert remote.returncode == 0, remote.stderr
    # A key on the command line of a remote eval would have to travel: refused, in one line.
    refused = _cli("eval", "run", "--host", "desktop", "--server", "smollm2", "--task", str(task), "--remote",
                   "--api-key-file", str(key_file), results=results)
    assert refused.returncode != 0 and refused.stderr.strip().startswith("error: --remote")

    # The remote eval's pull brings home every finished run on the rig, other tests' too (test_mcp's "arith"
    # among them): the task's name is this test's own, so these two are its runs.
    records = [r for r in (RunRecord.load(run) for run in sorted((results / "desktop").iterdir()))
               if r.task and r.task.name == "trust-arith"]
    assert len(records) == 2
    assert all(r.status == "done" and r.extra["summary"]["overall"]["n"] == 2 for r in records)
    local_record = next(r for r in records if not r.extra.get("remote"))
    assert any("--api-key-file" in c for c in local_record.commands)

    found = subprocess.run(["grep", "-rlF", key, str(results)], capture_output=True, text=True, check=False)
    assert found.returncode == 1, found.stdout  # 1: no file holds it
    for out in (local, remote, refused):
        assert key not in out.stdout and key not in out.stderr
    remote_id = next(r.id for r in records if r.extra.get("remote"))
    with SshClient(SshTarget.from_host(host)) as ssh:
        spec = json.loads(ssh.run(f"cat {JOBS_DIR}/{remote_id}/spec.json", timeout=30).stdout)
        assert spec["params"]["api_key_file"] == "/etc/llama-server/api-key"
        on_rig = ssh.run(f"grep -rlF -- {shlex.quote(key)} {JOBS_DIR} {RESULTS_DIR}; "
                         f"journalctl -u 'rigctl-*' --no-pager | grep -cF -- {shlex.quote(key)}",
                         timeout=60, check=False)
        assert on_rig.stdout.split() == ["0"], on_rig.stdout  # no file under them; no journal line
        # The role's key file is where the key lives, as the role made it.
        assert ssh.run("stat -c '%U %G %a' /etc/llama-server/api-key", timeout=30).stdout.split() == \
            ["root", "llama", "640"]


def test_server_unit_keeps_the_gpu_device_nodes_reachable(served: Inventory) -> None:
    """DevicePolicy=closed with the role's DeviceAllow= as systemd loaded them, and GPU device nodes (made
    here: the lab rigs have no NVIDIA driver) visible in the running unit's mount namespace and opened by
    its user down to the kernel: ENXIO, no driver behind the node; not ENOENT (hidden, as PrivateDevices
    would) nor EPERM/EACCES (refused). The rigs' cgroup has no device controller, so the lab cannot show
    systemd refusing the other devices; on a GPU host DeviceAllow's classes admit these same nodes."""
    host = served.host("desktop")
    with SshClient(SshTarget.from_host(host)) as ssh:
        shown = ssh.run("systemctl show -p DevicePolicy -p DeviceAllow llama-server@smollm2.service",
                        timeout=30).stdout
        assert {"DevicePolicy=closed", "DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=char-nvidia-uvm rw",
                "DeviceAllow=char-nvidia-caps rw"} <= set(shown.splitlines()), shown
        probe = ssh.run(_DEVICE_PROBE, timeout=60, check=False)
    assert probe.ok, probe.stderr
    verdicts = dict(line.split("=", 1) for line in probe.stdout.split())
    assert set(verdicts) == {"nvidia0", "nvidiactl", "nvidia-uvm"}, probe.stdout
    assert all(v in ("ENXIO", "ENODEV") for v in verdicts.values()), probe.stdout


# NVIDIA's nodes (majors as the driver registers them: 195 frontend, 511 uvm), opened by the unit's user
# inside the running server's mount namespace; removed again whatever happens.
_DEVICE_PROBE = r"""
set -eu
trap 'rm -f /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm' EXIT
mknod -m 0666 /dev/nvidia0 c 195 0
mknod -m 0666 /dev/nvidiactl c 195 255
mknod -m 0666 /dev/nvidia-uvm c 511 0
pid=$(systemctl show -p MainPID --value llama-server@smollm2.service)
user=$(systemctl show -p User --value llama-server@smollm2.service)
for node in nvidia0 nvidiactl nvidia-uvm; do
    verdict=$(nsenter -t "$pid" -m setpriv --reuid="$user" --regid="$user" --clear-groups /usr/bin/python3 -c '
import errno, os, sys
try:
    os.close(os.open(sys.argv[1], os.O_RDWR))
    print("OK")
except OSError as exc:
    print(errno.errorcode[exc.errno])' /dev/$node)
    echo "$node=$verdict"
done
"""
