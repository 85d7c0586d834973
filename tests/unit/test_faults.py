"""Faults that need no rig (issue 16, class 8): one hash rule for verify and the exporter, a second provision
refused, a cell without results, a full disk under the models module (a real tmpfs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from benchlab import RIGCTL
from handmade_runs import bench_record, bench_run

from rigctl.bench.matrix import load_run_samples
from rigctl.errors import ConfigError
from rigctl.fleet.deploy_lock import inventory_lock
from rigctl.fleet.models import ArtifactStatus, Manifest
from rigctl.fleet.state import ModelFact
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


def test_second_provision_is_refused_naming_the_holder(tmp_path: Path) -> None:
    env = {**os.environ, "RIGCTL_CACHE_DIR": str(tmp_path), "RIGCTL_LAB_SLOT": os.environ.get("RIGCTL_LAB_SLOT", "3")}
    os.environ["RIGCTL_CACHE_DIR"] = str(tmp_path)
    try:
        with inventory_lock(LAB, command="rigctl provision --tags llama_server"):
            started = time.monotonic()
            done = subprocess.run([*RIGCTL, "-i", str(LAB), "provision"], capture_output=True, text=True,
                                  timeout=60, env=env, cwd=REPO)
            refused_in = time.monotonic() - started
    finally:
        del os.environ["RIGCTL_CACHE_DIR"]
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: inventory {LAB}: refused: pid {os.getpid()} (`rigctl provision --tags llama_server`, since "
        f"{done.stderr.split('since ')[1].split(')')[0]}) is running a playbook against it; wait for it to finish"]
    assert "TASK" not in done.stdout and refused_in < 30  # refused before Ansible started
    # Released with the block (and by the kernel if its holder dies): the next run may take it.
    os.environ["RIGCTL_CACHE_DIR"] = str(tmp_path)
    try:
        with inventory_lock(LAB, command="again"):
            pass
    finally:
        del os.environ["RIGCTL_CACHE_DIR"]


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
