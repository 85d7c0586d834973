"""When a GPU is unhealthy: the one verdict the exporter's ``rigctl_gpu_unhealthy``, the alert rules' GPU
signals and the drain policy (:mod:`rigctl.fleet.drain`) share, from what one reading of the host said
(:class:`rigctl.fleet.state.HostState`: the driver's health query and the kernel log's Xid reports)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rigctl.hostside import nvidia_smi

#: Xids NVIDIA's catalogue puts on the application, not the GPU (an illegal instruction, a page fault of its
#: own, a stopped or cleaned-up channel): shown and counted, but no reason to take a host out.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})


@dataclass(frozen=True)
class GpuVerdict:
    """One GPU's health: its index and bus id (None for Xids on a bus no GPU of the reading has), the Xids
    since boot by code, and every reason it is unhealthy (empty: healthy as far as the driver says)."""

    index: int | None
    bus_id: str | None
    xids: dict[int, int]
    problems: tuple[str, ...]


def gpu_problems(gpu: nvidia_smi.GpuHealth) -> list[str]:
    """Why the driver's answer makes ``gpu`` unhealthy; a signal not reported is no problem."""
    problems = []
    if gpu.ecc_uncorrected_volatile:
        problems.append(f"{gpu.ecc_uncorrected_volatile} uncorrected ECC errors since the driver loaded")
    if gpu.retired_pages_pending:
        problems.append("retired pages pending a reset")
    if gpu.remapped_rows_pending:
        problems.append("remapped rows pending a reset")
    if gpu.remapped_rows_failure:
        problems.append("a row remapping failed")
    if gpu.recovery_action and gpu.recovery_action != nvidia_smi.NO_RECOVERY_ACTION:
        problems.append(f"the driver asks for recovery: {gpu.recovery_action}")
    return problems


def verdicts(health: list[nvidia_smi.GpuHealth], xids: list[nvidia_smi.XidEvent] | None) -> list[GpuVerdict]:
    """Each GPU's verdict, and one more (index None) for Xids on a bus none of them has."""
    counts: Counter[tuple[tuple[int, int, int], int]] = Counter((x.bus, x.code) for x in xids or [])
    out, claimed = [], set()
    for gpu in health:
        bus = nvidia_smi.bus_address(gpu.bus_id)
        codes = {code: n for (where, code), n in sorted(counts.items()) if where == bus}
        claimed.add(bus)
        out.append(GpuVerdict(gpu.index, gpu.bus_id, codes, (*gpu_problems(gpu), *_xid_problems(codes))))
    stray = {code: n for (where, code), n in sorted(counts.items()) if where not in claimed}
    if stray:
        out.append(GpuVerdict(None, None, stray, tuple(_xid_problems(stray))))
    return out


def _xid_problems(codes: dict[int, int]) -> list[str]:
    return [f"Xid {code} ({n}x since boot)" for code, n in codes.items() if code not in APPLICATION_XIDS]


def host_problems(found: list[GpuVerdict]) -> list[str]:
    """Every problem of a host's GPUs, each naming its GPU: what a drain by policy gives as its reason."""
    return [f"GPU {v.index if v.index is not None else '?'}: {p}" for v in found for p in v.problems]
