"""The CVE floor against the real lab rigs, without a compile (part of `make test`): the exporter reads the
build each rig runs over SSH and shows it, and the inventory's pin, against llama.cpp's published advisories;
a pin moved into an advisory's range (a hand edit) flips the metric, fails `inventory check`, and is refused by
`provision` and `build upgrade` before anything runs or is fetched. Accepting the advisory by name (with its
reason) clears the metric."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from benchlab import REPO, RIGCTL, cli_env
from exporter_support import parse_samples, sample_value
from inventory_support import edit_yaml

from rigctl.inventory import Inventory
from rigctl.results.store import ResultsStore
from rigctl.services.exporter import Exporter

pytestmark = pytest.mark.lab

ADVISORY = "GHSA-6hc7-9rph-cm99"  # CVE-2026-43631: builds b7492 through b9060
SIBLING = "CVE-2026-43632"  # the same builds, the same dangling vocabulary from six more endpoints


def vulnerable(inventory_dir: Path, results: Path) -> dict[tuple[str, str], tuple[float, str]]:
    """rigctl_build_vulnerable per (host, build): (value, the advisories label), after one collection."""
    exporter = Exporter(Inventory.load(inventory_dir), results=ResultsStore(results), interval=1.0, host_timeout=10.0)
    try:
        exporter.collect_once()
        samples = parse_samples(exporter.render().decode())
    finally:
        exporter.stop()
    out = {}
    for labels, value in samples.get("rigctl_build_vulnerable", []):
        out[(labels["host"], labels["build"])] = (value, labels["advisories"])
    assert sample_value(samples, "rigctl_host_up", host="desktop") == 1.0
    return out


def test_a_pin_inside_a_cve_range_is_refused_and_the_exporter_metric_flips(lab_served: Inventory, tmp_path: Path):
    copy = tmp_path / "lab"
    shutil.copytree(REPO / "inventory" / "lab", copy)
    env = {**cli_env(tmp_path / "results"), "RIGCTL_INVENTORY": str(copy)}
    running = lab_served.host("desktop").llama_cpp.version
    before = vulnerable(copy, tmp_path / "results")
    assert before[("desktop", "pinned")] == (0.0, "") and before[("desktop", "running")] == (0.0, "")
    assert before[("laptop", "running")] == (0.0, "")

    pins = copy / "group_vars" / "all" / "llama_cpp.yml"
    edit_yaml(pins, lambda d: d.update(llama_cpp_version="b9060"))  # a hand edit of the pin
    after = vulnerable(copy, tmp_path / "results")
    both = f"{ADVISORY},{SIBLING}"
    assert after[("desktop", "pinned")] == (1.0, both) and after[("laptop", "pinned")] == (1.0, both)
    assert after[("desktop", "running")] == (0.0, "")  # what runs is still the lab's build

    check = subprocess.run([*RIGCTL, "inventory", "check"], capture_output=True, text=True, env=env, timeout=300,
                           cwd=REPO, check=False)
    assert check.returncode == 2 and f"llama_cpp_version: pin b9060 (build 9060) is inside {ADVISORY}" in check.stderr
    provision = subprocess.run([*RIGCTL, "provision"], capture_output=True, text=True, env=env, timeout=300,
                               cwd=REPO, check=False)
    assert provision.returncode == 1
    assert provision.stderr.startswith(f"error: host desktop: pin b9060 (build 9060) is inside {ADVISORY}")
    assert "TASK" not in provision.stdout  # refused before any play
    upgrade = subprocess.run([*RIGCTL, "-i", str(REPO / "inventory" / "lab"), "build", "upgrade", "--to", "b9060",
                              "--canary", "desktop"], capture_output=True, text=True, env=env, timeout=300, cwd=REPO,
                             check=False)
    assert upgrade.returncode == 1 and len(upgrade.stderr.strip().splitlines()) == 1
    assert upgrade.stderr.startswith(f"error: llama.cpp b9060 (build 9060) is inside {ADVISORY} (CVE-2026-43631")
    assert lab_served.host("desktop").llama_cpp.version == running

    edit_yaml(pins, lambda d: d.update(rigctl_allowed_advisories={ADVISORY: "no instance runs --sleep-idle-seconds",
                                                                  SIBLING: "no instance runs --sleep-idle-seconds"}))
    accepted = vulnerable(copy, tmp_path / "results")
    assert accepted[("desktop", "pinned")] == (0.0, "")
