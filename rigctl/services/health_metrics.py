"""The exporter's GPU health and drain families: what each GPU's driver and the host's kernel log say
(:mod:`rigctl.fleet.health`), and which hosts are drained (:mod:`rigctl.fleet.drain`). A signal the driver
does not report (``[N/A]``, ``[Not Supported]``) has no sample; it is never a 0 that would read as healthy."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.core import GaugeMetricFamily, Metric

from rigctl.fleet.drain import Drain
from rigctl.fleet.health import APPLICATION_XIDS, verdicts
from rigctl.fleet.state import HostState
from rigctl.hostside import nvidia_smi

GPU_LABELS = ["host", "gpu", "name", "uuid"]
#: key -> (metric, help, labels)
FAMILIES: dict[str, tuple[str, str, list[str]]] = {
    "ecc": ("rigctl_gpu_ecc_errors", "ECC errors the driver counted: since it loaded (scope volatile) or over the "
            "GPU's life (aggregate); error corrected or uncorrected", [*GPU_LABELS, "error", "scope"]),
    "retired": ("rigctl_gpu_retired_pages", "Memory pages retired for ECC errors (before Ampere), by cause",
                [*GPU_LABELS, "cause"]),
    "retired_pending": ("rigctl_gpu_retired_pages_pending", "1 if pages wait for a GPU reset to be retired",
                        GPU_LABELS),
    "remapped": ("rigctl_gpu_remapped_rows", "Memory rows remapped (Ampere on), by the error that caused it",
                 [*GPU_LABELS, "cause"]),
    "remap_pending": ("rigctl_gpu_remapped_rows_pending", "1 if a row remap waits for a GPU reset", GPU_LABELS),
    "remap_failure": ("rigctl_gpu_remapped_rows_failure", "1 if a row remapping failed", GPU_LABELS),
    "recovery": ("rigctl_gpu_recovery_action", "1 if the driver asks for a recovery action (action: its words)",
                 [*GPU_LABELS, "action"]),
    "reason": ("rigctl_gpu_clock_event_reason", "1 for each clock event reason active now (NVML's names)",
               [*GPU_LABELS, "reason"]),
    "throttled": ("rigctl_gpu_throttled", "1 if heat or power holds the clocks now (not idle, not the idle power "
                  "policy)", GPU_LABELS),
    "power": ("rigctl_gpu_power_draw_watts", "Power drawn by the board", GPU_LABELS),
    "power_limit": ("rigctl_gpu_power_limit_watts", "The power limit in force", GPU_LABELS),
    "pcie_gen": ("rigctl_gpu_pcie_link_generation", "PCIe link generation: link current or max",
                 [*GPU_LABELS, "link"]),
    "pcie_width": ("rigctl_gpu_pcie_link_width", "PCIe link width in lanes: link current or max",
                   [*GPU_LABELS, "link"]),
    "xid": ("rigctl_gpu_xid_errors", "Xid reports in the kernel log since boot, by code (gpu empty: a bus no GPU "
            "of the host answers for; blame: gpu, or application for the codes NVIDIA puts on it)",
            [*GPU_LABELS, "xid", "blame"]),
    "unhealthy": ("rigctl_gpu_unhealthy", "1 if the GPU is unhealthy by rigctl's verdict (what drains by policy)",
                  GPU_LABELS),
    "health_ok": ("rigctl_gpu_health_readable", "1 if the driver answered the health query", ["host"]),
    "kernel_ok": ("rigctl_kernel_log_readable", "1 if the host's kernel log could be read for Xids", ["host"]),
    "drained": ("rigctl_host_drained", "1 if the host is drained (out of campaigns, evals, benches, canaries)",
                ["host", "reason", "by"]),
}


#: The families whose samples exist only where the driver (or the kernel log) reports the signal: a GeForce
#: has no ECC, a GPU before Ampere no row remapping, a host without Xids no Xid series. The others always
#: have a sample for every host that answered.
REPORTED_ONLY = frozenset(FAMILIES[key][0] for key in (
    "ecc", "retired", "retired_pending", "remapped", "remap_pending", "remap_failure", "recovery", "reason",
    "throttled", "power", "power_limit", "pcie_gen", "pcie_width", "xid"))


def health_families(hosts: Mapping[str, HostState], drains: Mapping[str, Drain | None]) -> list[Metric]:
    f = {key: GaugeMetricFamily(name, text, labels=labels) for key, (name, text, labels) in FAMILIES.items()}
    for host, found in sorted(drains.items()):
        f["drained"].add_metric([host, found.reason, found.by] if found else [host, "", ""], 1.0 if found else 0.0)
    for host, facts in sorted(hosts.items()):
        if not facts.up:
            continue
        f["health_ok"].add_metric([host], 0.0 if facts.health_error else 1.0)
        f["kernel_ok"].add_metric([host], 0.0 if facts.xids is None else 1.0)
        samples = {s.index: s for s in facts.gpus}
        by_index = {gpu.index: gpu for gpu in facts.health}
        for verdict in verdicts(facts.health, facts.xids):
            sample = samples.get(str(verdict.index))
            labels = [host, "" if verdict.index is None else str(verdict.index), sample.name if sample else "",
                      sample.uuid if sample else ""]
            for code, count in verdict.xids.items():
                blame = "application" if code in APPLICATION_XIDS else "gpu"
                f["xid"].add_metric([*labels, str(code), blame], float(count))
            if verdict.index is None:
                continue
            f["unhealthy"].add_metric(labels, 1.0 if verdict.problems else 0.0)
            _gpu(by_index[verdict.index], labels, f)
    return list(f.values())


def _sample(family: GaugeMetricFamily, labels: list[str], value: float | bool | None) -> None:
    if value is not None:
        family.add_metric(labels, float(value))


def _gpu(gpu: nvidia_smi.GpuHealth, labels: list[str], f: Mapping[str, GaugeMetricFamily]) -> None:
    for error in ("corrected", "uncorrected"):
        for scope in ("volatile", "aggregate"):
            _sample(f["ecc"], [*labels, error, scope], getattr(gpu, f"ecc_{error}_{scope}"))
    _sample(f["retired"], [*labels, "single_bit_ecc"], gpu.retired_pages_single_bit)
    _sample(f["retired"], [*labels, "double_bit_ecc"], gpu.retired_pages_double_bit)
    _sample(f["retired_pending"], labels, gpu.retired_pages_pending)
    _sample(f["remapped"], [*labels, "correctable"], gpu.remapped_rows_correctable)
    _sample(f["remapped"], [*labels, "uncorrectable"], gpu.remapped_rows_uncorrectable)
    _sample(f["remap_pending"], labels, gpu.remapped_rows_pending)
    _sample(f["remap_failure"], labels, gpu.remapped_rows_failure)
    if gpu.recovery_action is not None:
        f["recovery"].add_metric([*labels, gpu.recovery_action[:64]],
                                 0.0 if gpu.recovery_action == nvidia_smi.NO_RECOVERY_ACTION else 1.0)
    if gpu.reasons is not None:
        for bit, name in nvidia_smi.REASONS.items():
            f["reason"].add_metric([*labels, name], 1.0 if gpu.reasons & bit else 0.0)
        reading = {"reasons": gpu.reasons, "power_w": gpu.power_w, "power_limit_w": gpu.power_limit_w}
        f["throttled"].add_metric(labels, 1.0 if nvidia_smi.held_reasons(reading) else 0.0)
    _sample(f["power"], labels, gpu.power_w)
    _sample(f["power_limit"], labels, gpu.power_limit_w)
    for link, gen, width in (("current", gpu.pcie_gen, gpu.pcie_width), ("max", gpu.pcie_gen_max, gpu.pcie_width_max)):
        _sample(f["pcie_gen"], [*labels, link], gen)
        _sample(f["pcie_width"], [*labels, link], width)
