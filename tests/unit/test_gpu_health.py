"""GPU health (the verdict, the exporter's families) from recorded real outputs, and drained hosts (the
inventory's rigctl_drain: written, refused, skipped, and drained by policy)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from exporter_support import PROMTOOL, parse_samples, promtool_check, sample_value

from rigctl.errors import ConfigError, DrainedError
from rigctl.fleet import drain
from rigctl.fleet.health import host_problems, verdicts
from rigctl.fleet.state import GpuSample, HostPlan, HostState
from rigctl.hostside import nvidia_smi
from rigctl.inventory import Inventory
from rigctl.inventory.check import check
from rigctl.services.exporter import Snapshot, exposition, metric_families

REPO = Path(__file__).resolve().parents[2]
REAL = REPO / "tests" / "fixtures" / "real"


def _recorded(kind: str, name: str) -> str:
    return (REAL / kind / name).read_text().partition("\n")[2]


def _as_query(cells: list[dict[str, str]]) -> str:
    """What ``--query-gpu=<HEALTH_FIELDS> --format=csv,noheader,nounits`` prints for these cells (as the lab's
    stand-in prints a recorded ``-q``'s); a field the record lacks is [N/A]."""
    return "".join(", ".join(gpu.get(f, "[N/A]") if f != "index" else str(i) for f in nvidia_smi.HEALTH_FIELDS)
                   + "\n" for i, gpu in enumerate(cells))


def _row_remap_host() -> HostState:
    """The A100 of the recorded Xid 63 (177 corrected ECC errors, a row remap pending), with its Xid line and
    a dmesg of Xids on another bus."""
    health = nvidia_smi.parse_health(_as_query(nvidia_smi.query_health_cells(
        _recorded("nvidia-smi-q", "ml-engineering__a100-xid63-row-remap-pending.txt"))))
    xids = nvidia_smi.parse_xids(_recorded("kernel_log_xid", "ml-engineering__xid63.txt")
                                 + _recorded("kernel_log_xid", "bumblebee-677__dmesg.txt"))
    return HostState("desktop", up=True, health=health, xids=xids,
                     gpus=[GpuSample("0", "GPU-aaaa", "NVIDIA A100-SXM4-80GB", 40.0, 0.0, 8e10, 0.0)])


def test_a_recorded_row_remap_is_an_unhealthy_gpu_with_its_xid_and_stray_xids_apart():
    facts = _row_remap_host()
    (gpu, stray) = verdicts(facts.health, facts.xids)
    assert gpu.index == 0 and gpu.xids == {63: 1}
    assert gpu.problems == ("remapped rows pending a reset", "Xid 63 (1x since boot)")
    # Xid 31 is the application's (a page fault), 32 a corrupted push buffer: only 32 makes a problem.
    assert stray.index is None and stray.xids == {31: 1, 32: 2} and stray.problems == ("Xid 32 (2x since boot)",)
    assert host_problems([gpu, stray])[0] == "GPU 0: remapped rows pending a reset"


def test_a_healthy_recorded_h100_has_no_problem_and_its_unreported_fields_stay_unreported():
    text = (REAL / "nvidia-smi-query" / "exporter__linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01__load.txt")
    lines = [line for line in text.read_text().partition("\n")[2].splitlines() if line.strip()]
    header = [name.strip().split(" [")[0] for name in lines[0].split(",")]
    cells = [c.strip().removesuffix(" W") for c in lines[1].split(",")]
    row = ", ".join(cells[header.index(f)] for f in nvidia_smi.HEALTH_FIELDS)
    (gpu,) = nvidia_smi.parse_health(row)
    assert gpu.retired_pages_pending is None and gpu.remapped_rows_pending is False
    assert verdicts([gpu], []) [0].problems == ()


def test_a_failing_legacy_query_keeps_the_legacy_fields():
    (gpu,) = nvidia_smi.parse_health("0, 00000000:01:00.0, 0, 2, 0, 7, 1, 0, Yes, 0x0000000000000040, 150.5, "
                                     "170.00, 3, 3, 8, 16", nvidia_smi.LEGACY_HEALTH_FIELDS)
    assert gpu.ecc_uncorrected_volatile == 2 and gpu.retired_pages_pending is True and gpu.remapped_rows_pending is None
    assert gpu.reasons == 0x40 and gpu.pcie_width == 8 and gpu.recovery_action is None
    assert {"2 uncorrected ECC errors since the driver loaded", "retired pages pending a reset"} <= set(
        verdicts([gpu], None)[0].problems)


def _families(facts: HostState, drains: dict) -> dict:
    snap = Snapshot(completed_at=time.time(), duration_seconds=0.1, hosts={"desktop": facts}, drains=drains)
    plans = {"desktop": HostPlan("desktop", "", "", {})}
    return parse_samples(exposition(metric_families(snap, plans)).decode())


def test_the_exporter_shows_each_signal_and_the_drain():
    facts = _row_remap_host()
    found = drain.Drain("desktop", "GPU 0 remaps rows", "2026-12-07T10:00:00Z", "operator")
    samples = _families(facts, {"desktop": found})
    gpu = {"host": "desktop", "gpu": "0", "name": "NVIDIA A100-SXM4-80GB"}
    assert sample_value(samples, "rigctl_gpu_unhealthy", **gpu) == 1.0
    assert sample_value(samples, "rigctl_gpu_remapped_rows_pending", **gpu) == 1.0
    assert sample_value(samples, "rigctl_gpu_ecc_errors", **gpu, error="corrected", scope="volatile") == 177.0
    assert sample_value(samples, "rigctl_gpu_remapped_rows", **gpu, cause="correctable") == 1.0
    assert sample_value(samples, "rigctl_gpu_xid_errors", **gpu, xid="63") == 1.0
    assert sample_value(samples, "rigctl_gpu_xid_errors", host="desktop", gpu="", xid="32") == 2.0
    assert sample_value(samples, "rigctl_host_drained", host="desktop", reason="GPU 0 remaps rows") == 1.0
    # Not reported by the driver: no sample, never a 0 that reads as healthy.
    assert "rigctl_gpu_retired_pages_pending" not in samples and "rigctl_gpu_power_draw_watts" not in samples
    assert sample_value(_families(facts, {"desktop": None}), "rigctl_host_drained", host="desktop") == 0.0


def test_a_kernel_log_that_cannot_be_read_is_said_so():
    facts = HostState("desktop", up=True, xids=None, xid_error="dmesg: read kernel buffer failed")
    assert sample_value(_families(facts, {}), "rigctl_kernel_log_readable", host="desktop") == 0.0


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
def test_the_health_families_pass_promtool():
    snap = Snapshot(completed_at=time.time(), duration_seconds=0.1, hosts={"desktop": _row_remap_host()},
                    drains={"desktop": None})
    promtool_check(exposition(metric_families(snap, {"desktop": HostPlan("desktop", "", "", {})})))


# ----------------------------------------------------------------------------------------------- drain


@pytest.fixture
def inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Inventory:
    monkeypatch.setenv("RIGCTL_LAB_SLOT", "0")
    shutil.copytree(REPO / "inventory" / "lab", tmp_path / "inv")
    return Inventory.load(tmp_path / "inv")


def test_drain_and_undrain_round_trip_the_host_vars(inventory: Inventory):
    path = inventory.source / "host_vars" / "desktop.yml"
    before = path.read_text()
    found = drain.drain(inventory, "desktop", "GPU 0: Xid 79, fell off the bus")
    reloaded = Inventory.load(inventory.source)
    assert drain.host_drain(reloaded.host("desktop")) == found and found.by == "operator"
    assert not [p for p in check(reloaded, [REPO / "roles"]) if p.severity == "error"]
    kept, skipped = drain.admitted(list(reloaded.hosts.values()), lambda h: h, "the eval")
    assert [h.name for h in kept] == ["laptop"]
    assert skipped == {"desktop": f"drained since {found.since} by operator: GPU 0: Xid 79, fell off the bus"}
    with pytest.raises(DrainedError, match="host desktop is drained .*Xid 79"):
        drain.InService(reloaded, "a campaign").host("desktop")
    assert drain.undrain(reloaded, "desktop") == found
    assert path.read_text() == before
    assert drain.undrain(Inventory.load(inventory.source), "desktop") is None


@pytest.mark.parametrize("reason", ["[bold red]down[/]", "<b>down</b>", "{{ lookup('pipe', 'id') }}", "a\nb", "",
                                    "x" * 201])
def test_a_bad_reason_is_one_error_and_nothing_is_written(inventory: Inventory, reason: str):
    path = inventory.source / "host_vars" / "desktop.yml"
    before = path.read_text()
    with pytest.raises(ConfigError, match=r"^--reason: "):
        drain.drain(inventory, "desktop", reason)
    assert path.read_text() == before


def test_inventory_check_names_a_bad_drain_and_policy(inventory: Inventory):
    path = inventory.source / "host_vars" / "laptop.yml"
    path.write_text(path.read_text() + "rigctl_drain: {reason: '<i>x</i>', since: now, by: me}\n"
                    "rigctl_drain_policy: {unhealthy_gpu: reboot, extra: 1}\n")
    problems = [str(p) for p in check(Inventory.load(inventory.source), [REPO / "roles"]) if p.severity == "error"]
    for key in ("rigctl_drain.reason", "rigctl_drain.since", "rigctl_drain.by", "rigctl_drain_policy.unhealthy_gpu",
                "rigctl_drain_policy.extra"):
        assert any(f"host laptop: {key}:" in p for p in problems), (key, problems)


def test_the_policy_drains_an_unhealthy_host_once_and_ignore_leaves_it(inventory: Inventory):
    problems = {"desktop": host_problems(verdicts(_row_remap_host().health, [])), "laptop": []}
    assert drain.apply_policy(inventory, problems) == {}  # no policy: ignore
    path = inventory.source / "host_vars" / "desktop.yml"
    path.write_text(path.read_text() + "rigctl_drain_policy: {unhealthy_gpu: drain}\n")
    done = drain.apply_policy(Inventory.load(inventory.source), problems)
    assert list(done) == ["desktop"] and done["desktop"].by == "policy"
    assert done["desktop"].reason == "unhealthy GPU: GPU 0: remapped rows pending a reset"
    assert drain.apply_policy(Inventory.load(inventory.source), problems) == {}  # drained already


# ----------------------------------------------------------------------------------------------- the lab's stand-in


def test_the_stand_in_plays_a_recorded_condition_through_the_host_side_reading(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch):
    """The lab's RTX 3050 given a recorded -q's ECC errors and a recorded dmesg's Xids: the host side's own
    commands (nvidia-smi's health query with its fallback, dmesg) read them back, and the verdict says so."""
    import dataclasses

    from rigctl.fleet.state import read_health
    from rigctl.hostside import fleet_state
    from rigctl.lab.gpu import gpu_from_capture, health_from_capture, host_gpu_uuid, kernel_log_from_capture

    card = gpu_from_capture("rtx3050-8gb", host_gpu_uuid("desktop"))
    state = tmp_path / "gpu.json"
    state.write_text(card.to_json())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("nvidia-smi", "dmesg"):
        (bin_dir / tool).symlink_to(REPO / "rigctl" / "lab" / "assets" / tool)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(__import__('sys').executable).parent}:/usr/bin:/bin")
    monkeypatch.setenv("RIGCTL_LAB_GPU_STATE", str(state))

    def reading() -> HostState:
        raw = {"health": None, "kernel_xids": fleet_state.kernel_xids(30)}
        for fields in (nvidia_smi.HEALTH_FIELDS, nvidia_smi.LEGACY_HEALTH_FIELDS):
            raw["health"] = {**fleet_state.run(["nvidia-smi", "--query-gpu=" + ",".join(fields),
                                                "--format=csv,noheader,nounits"], 30), "fields": list(fields)}
            if raw["health"]["rc"] == 0:
                break
        facts = HostState("desktop", up=True)
        read_health(facts, raw)
        return facts

    healthy = reading()
    assert healthy.health_error is None and healthy.xids == []
    assert healthy.health[0].ecc_uncorrected_volatile is None and healthy.health[0].bus_id == "00000000:01:00.0"
    assert verdicts(healthy.health, healthy.xids)[0].problems == ()

    state.write_text(dataclasses.replace(card, health=health_from_capture("sram-uncorrectable"),
                                         kernel_log=kernel_log_from_capture("xid-32-31-bus-01")).to_json())
    sick = reading()
    (gpu,) = verdicts(sick.health, sick.xids)
    assert sick.health[0].ecc_uncorrected_volatile == 1 and sick.health[0].ecc_uncorrected_aggregate == 5
    assert gpu.xids == {31: 1, 32: 2}  # the recorded bus 0000:01:00 is the captured RTX 3050's
    assert gpu.problems == ("1 uncorrected ECC errors since the driver loaded", "Xid 32 (2x since boot)")


def test_the_cli_refuses_a_reason_with_markup_in_one_line_and_writes_nothing(inventory: Inventory):
    import subprocess
    import sys

    path = inventory.source / "host_vars" / "desktop.yml"
    before = path.read_text()
    done = subprocess.run([str(Path(sys.executable).parent / "rigctl"), "-i", str(inventory.source), "hosts", "drain",
                           "desktop", "--reason", "GPU [red]gone[/red]"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == ["error: --reason: plain text without markup, got '[' in it"]
    assert path.read_text() == before


def test_a_bench_and_a_canary_on_a_drained_host_say_why_before_anything_connects(inventory: Inventory):
    from rigctl.bench.matrix import parse_spec, start_bench
    from rigctl.upgrade.upgrade import upgrade

    drain.drain(inventory, "desktop", "fans replaced, burn-in first")
    drained = Inventory.load(inventory.source)
    started = start_bench(drained, parse_spec({"hosts": ["desktop"], "models": ["smollm2-135m-q4_1"]}, "test"))
    assert list(started) == ["desktop"] and isinstance(started["desktop"], DrainedError)
    assert "host desktop is drained (drained since " in str(started["desktop"])
    with pytest.raises(DrainedError, match=r"host desktop is drained .*fans replaced, burn-in first.*"
                                           r"`rigctl hosts undrain desktop`"):
        upgrade(drained, "b9999", canary="desktop", store=None)
