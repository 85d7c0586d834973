"""What ``nvidia-smi`` prints, read in one place: the controller's probe and fleet state, the jobs on the
host (bench readings, the stamp) and the roles' modules (``ansible.module_utils.nvidia_smi``) all read it
through these functions. Standard library only: it runs on hosts.

Held to recorded real outputs (``tests/fixtures/real/nvidia-smi-*``): drivers of both header generations
(``Driver Version``/``CUDA Version`` and, from R610, ``KMD Version``/``CUDA UMD Version``), cells the driver
cannot fill (``[N/A]``, ``[Not Supported]``, ``[Unknown Error]``, ``ERR!``), MIG listings and several GPUs.
A cell the driver cannot fill is "not reported" (None), never an error: a working host prints them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

#: Cells that mean "no value" without brackets (the summary table's ``N/A``, the error marker ``ERR!``);
#: every bracketed cell (``[N/A]``, ``[Not Supported]``, ``[Unknown Error]``, ``[Insufficient
#: Permissions]``, ``[Requested functionality has been deprecated]``) means the same.
_UNREPORTED = {"", "N/A", "ERR!"}
_DRIVER_VERSION = re.compile(r"\b(?:Driver|KMD) Version:\s*(\d+(?:\.\d+){1,3})\b")
_CUDA_VERSION = re.compile(r"\bCUDA (?:UMD )?Version:\s*(\d+\.\d+)\b")
_LIST_GPU = re.compile(r"^GPU (\d+): (.+) \(UUID: (GPU-[0-9A-Fa-f-]+)\)$")
#: A MIG device line of ``nvidia-smi -L``; before R470 its UUID was ``MIG-GPU-<uuid>/<gi>/<ci>``.
_LIST_MIG = re.compile(r"^MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[0-9A-Za-z/-]+)\)$")


def cell(text: str) -> str | None:
    """A cell's value; None where the driver reports none."""
    value = text.strip()
    if value in _UNREPORTED or (value.startswith("[") and value.endswith("]")):
        return None
    return value


def number(text: str) -> float | None:
    """A numeric cell (``--format=...,nounits``); None where the driver reports none or no finite number."""
    value = cell(text)
    if value is None:
        return None
    try:
        parsed = float(value)
    except ValueError:
        return None
    return parsed if math.isfinite(parsed) else None


def whole(text: str) -> int | None:
    """A numeric cell as a whole number (MiB, MHz, °C), rounded; None where none is reported."""
    value = number(text)
    return None if value is None else round(value)


def reasons(text: str) -> int | None:
    """The clock event reasons bit mask (``0x0000000000000004``); None where none is reported."""
    value = cell(text)
    if value is None or not value.lower().startswith("0x"):
        return None
    try:
        return int(value, 16)
    except ValueError:
        return None


def query_rows(text: str, fields: Sequence[str]) -> list[dict[str, str]]:
    """``--query-gpu=<fields> --format=csv,noheader,nounits``: one {field: raw cell} per GPU line.
    ValueError naming the line when its cells do not match the fields."""
    rows = []
    for number_, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            raise ValueError(f"nvidia-smi line {number_}: {len(cells)} fields, expected {len(fields)}: "
                             f"{line.strip()[:200]!r}")
        rows.append(dict(zip(fields, cells, strict=True)))
    return rows


@dataclass(frozen=True)
class SummaryVersions:
    """The driver and the newest CUDA it supports, from the summary table's header (None: not printed)."""

    driver: str | None
    cuda: str | None


def summary_versions(text: str) -> SummaryVersions:
    """The versions in plain ``nvidia-smi``'s header, of either generation: ``Driver Version: 570.86.15
    CUDA Version: 12.8`` or, from R610, ``KMD Version: 610.57.04  CUDA UMD Version: 13.3``."""
    driver, cuda = _DRIVER_VERSION.search(text), _CUDA_VERSION.search(text)
    return SummaryVersions(driver.group(1) if driver else None, cuda.group(1) if cuda else None)


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance: a process pinned to ``uuid`` (CUDA_VISIBLE_DEVICES) sees only this slice."""

    gpu: int
    device: int
    profile: str  # 1g.10gb, 3g.40gb, ...
    uuid: str


@dataclass(frozen=True)
class ListedGpu:
    index: int
    name: str
    uuid: str
    mig: tuple[MigDevice, ...]


def list_gpus(text: str) -> list[ListedGpu]:
    """``nvidia-smi -L``: each GPU with its MIG instances (none when MIG is off). ValueError naming a line
    that is neither a GPU nor a MIG device."""
    gpus: list[ListedGpu] = []
    for number_, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        gpu, mig = _LIST_GPU.match(stripped), _LIST_MIG.match(stripped)
        if gpu is not None:
            gpus.append(ListedGpu(int(gpu.group(1)), gpu.group(2), gpu.group(3), ()))
        elif mig is not None and gpus:
            last = gpus[-1]
            device = MigDevice(last.index, int(mig.group(2)), mig.group(1), mig.group(3))
            gpus[-1] = ListedGpu(last.index, last.name, last.uuid, (*last.mig, device))
        else:
            raise ValueError(f"nvidia-smi -L line {number_}: {stripped[:200]!r} is neither a GPU nor a MIG device")
    return gpus


# ------------------------------------------------------------------------------------------ clock readings

#: One GPU reading, in this order (names as ``nvidia-smi --help-query-gpu`` lists them); ``index`` tells
#: the lines of several GPUs apart, ``power.limit`` tells a power cap at idle power from a real one.
READING_FIELDS = ("index", "clocks.sm", "clocks.mem", "clocks.max.sm", "power.draw", "power.limit",
                  "clocks_event_reasons.active", "temperature.gpu")
#: Drivers before R535 know the reasons field only by its old name.
LEGACY_READING_FIELDS = tuple("clocks_throttle_reasons.active" if f == "clocks_event_reasons.active" else f
                              for f in READING_FIELDS)
#: NVML's clock event reasons (nvmlClocksEventReason*), bit -> name.
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
           0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
GPU_IDLE = 0x1
SW_POWER_CAP = 0x4
#: The reasons that mean heat or power held the clocks down.
THROTTLE_REASONS = SW_POWER_CAP | 0x8 | 0x20 | 0x40 | 0x80
#: A software power cap below this share of the power limit is the driver's idle policy, not a GPU held
#: back by power: a recorded idle RTX 2080 SUPER reports it at 39 W of 250 W.
IDLE_POWER_SHARE = 0.5


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit] + (
        [f"0x{mask & ~sum(REASONS):x}"] if mask & ~sum(REASONS) else [])


def parse_reading(line: str) -> dict[str, int | float | None]:
    """One line of ``--query-gpu=<READING_FIELDS> --format=csv,noheader,nounits`` (either spelling of the
    reasons field): the GPU's index, clocks (MHz), power (W), reasons mask and temperature (°C)."""
    row = query_rows(line, READING_FIELDS)
    if len(row) != 1:
        raise ValueError(f"expected one reading line, got {len(row)}")
    cells = row[0]
    return {"gpu": whole(cells["index"]), "sm_mhz": whole(cells["clocks.sm"]),
            "mem_mhz": whole(cells["clocks.mem"]), "max_sm_mhz": whole(cells["clocks.max.sm"]),
            "power_w": number(cells["power.draw"]), "power_limit_w": number(cells["power.limit"]),
            "reasons": reasons(cells["clocks_event_reasons.active"]), "temp_c": whole(cells["temperature.gpu"])}


def held_reasons(reading: dict[str, object]) -> int:
    """The reasons of ``reading`` that mean heat or power held its clocks: none on an idle GPU (the
    gpu_idle bit), and no software power cap below :data:`IDLE_POWER_SHARE` of the power limit."""
    mask = reading.get("reasons")
    if not isinstance(mask, int) or mask & GPU_IDLE:
        return 0
    held = mask & THROTTLE_REASONS
    power, limit = reading.get("power_w"), reading.get("power_limit_w")
    if held & SW_POWER_CAP and isinstance(power, float) and isinstance(limit, float) and limit > 0 \
            and power < IDLE_POWER_SHARE * limit:
        held &= ~SW_POWER_CAP
    return held


# ------------------------------------------------------------------------------------------ GPU health

#: One GPU's health, in this order (``--help-query-gpu``'s names): ECC error totals since the driver
#: loaded (volatile) and over the card's life (aggregate), retired pages (before Ampere) and remapped rows
#: (from Ampere), the action the driver asks for (R550 on), the clock event reasons, power and the PCIe link.
HEALTH_FIELDS = ("index", "pci.bus_id",
                 "ecc.errors.corrected.volatile.total", "ecc.errors.uncorrected.volatile.total",
                 "ecc.errors.corrected.aggregate.total", "ecc.errors.uncorrected.aggregate.total",
                 "retired_pages.single_bit_ecc.count", "retired_pages.double_bit.count", "retired_pages.pending",
                 "remapped_rows.correctable", "remapped_rows.uncorrectable", "remapped_rows.pending",
                 "remapped_rows.failure", "gpu_recovery_action", "clocks_event_reasons.active",
                 "power.draw", "power.limit", "pcie.link.gen.current", "pcie.link.gen.max",
                 "pcie.link.width.current", "pcie.link.width.max")
#: What a driver before R550 answers (it refuses the whole query over one field it does not know): no
#: recovery action, no remapped rows, and the reasons under their pre-R535 name.
LEGACY_HEALTH_FIELDS = tuple("clocks_throttle_reasons.active" if f == "clocks_event_reasons.active" else f
                             for f in HEALTH_FIELDS
                             if f != "gpu_recovery_action" and not f.startswith("remapped_rows."))
#: The recovery action that means none is needed (NVML's NVML_GPU_RECOVERY_ACTION_NONE as nvidia-smi prints it).
NO_RECOVERY_ACTION = "None"


def flag(text: str) -> bool | None:
    """A Yes/No cell; None where the driver reports none."""
    value = cell(text)
    return {"yes": True, "no": False}.get(value.lower()) if value is not None else None


@dataclass(frozen=True)
class GpuHealth:
    """What the driver says of one GPU's health; None: not reported (a consumer card has no ECC, a
    pre-Ampere card no row remapper, an older driver no recovery action)."""

    index: int | None
    bus_id: str | None
    ecc_corrected_volatile: int | None
    ecc_uncorrected_volatile: int | None
    ecc_corrected_aggregate: int | None
    ecc_uncorrected_aggregate: int | None
    retired_pages_single_bit: int | None
    retired_pages_double_bit: int | None
    retired_pages_pending: bool | None
    remapped_rows_correctable: int | None
    remapped_rows_uncorrectable: int | None
    remapped_rows_pending: bool | None
    remapped_rows_failure: bool | None
    #: What the driver asks for to recover the GPU (``None`` printed: nothing; None here: not reported).
    recovery_action: str | None
    reasons: int | None
    power_w: float | None
    power_limit_w: float | None
    pcie_gen: int | None
    pcie_gen_max: int | None
    pcie_width: int | None
    pcie_width_max: int | None


def parse_health(text: str, fields: Sequence[str] = HEALTH_FIELDS) -> list[GpuHealth]:
    """``--query-gpu=<fields> --format=csv,noheader,nounits`` (:data:`HEALTH_FIELDS` or
    :data:`LEGACY_HEALTH_FIELDS`) as one :class:`GpuHealth` per GPU. ValueError naming a line whose cells do
    not match the fields."""
    out = []
    for row in query_rows(text, fields):
        get = row.get
        reasons_cell = get("clocks_event_reasons.active", get("clocks_throttle_reasons.active", ""))
        out.append(GpuHealth(
            index=whole(get("index", "")), bus_id=cell(get("pci.bus_id", "")),
            ecc_corrected_volatile=whole(get("ecc.errors.corrected.volatile.total", "")),
            ecc_uncorrected_volatile=whole(get("ecc.errors.uncorrected.volatile.total", "")),
            ecc_corrected_aggregate=whole(get("ecc.errors.corrected.aggregate.total", "")),
            ecc_uncorrected_aggregate=whole(get("ecc.errors.uncorrected.aggregate.total", "")),
            retired_pages_single_bit=whole(get("retired_pages.single_bit_ecc.count", "")),
            retired_pages_double_bit=whole(get("retired_pages.double_bit.count", "")),
            retired_pages_pending=flag(get("retired_pages.pending", "")),
            remapped_rows_correctable=whole(get("remapped_rows.correctable", "")),
            remapped_rows_uncorrectable=whole(get("remapped_rows.uncorrectable", "")),
            remapped_rows_pending=flag(get("remapped_rows.pending", "")),
            remapped_rows_failure=flag(get("remapped_rows.failure", "")),
            recovery_action=cell(get("gpu_recovery_action", "")),
            reasons=reasons(reasons_cell), power_w=number(get("power.draw", "")),
            power_limit_w=number(get("power.limit", "")),
            pcie_gen=whole(get("pcie.link.gen.current", "")), pcie_gen_max=whole(get("pcie.link.gen.max", "")),
            pcie_width=whole(get("pcie.link.width.current", "")),
            pcie_width_max=whole(get("pcie.link.width.max", "")),
        ))
    return out


#: ``nvidia-smi -q``'s sections whose counters :func:`query_health_cells` reads, by the query field each
#: feeds: (section path, the keys summed; a ``Total`` key, where printed, is taken instead).
_Q_ECC = {"ecc.errors.corrected.volatile.total": ("ECC Errors/Volatile", "Correctable"),
          "ecc.errors.uncorrected.volatile.total": ("ECC Errors/Volatile", "Uncorrectable"),
          "ecc.errors.corrected.aggregate.total": ("ECC Errors/Aggregate", "Correctable"),
          "ecc.errors.uncorrected.aggregate.total": ("ECC Errors/Aggregate", "Uncorrectable")}
_Q_VALUES = {"retired_pages.single_bit_ecc.count": "Retired Pages/Single Bit ECC",
             "retired_pages.double_bit.count": "Retired Pages/Double Bit ECC",
             "retired_pages.pending": "Retired Pages/Pending Page Blacklist",
             "remapped_rows.correctable": "Remapped Rows/Correctable Error",
             "remapped_rows.uncorrectable": "Remapped Rows/Uncorrectable Error",
             "remapped_rows.pending": "Remapped Rows/Pending",
             "remapped_rows.failure": "Remapped Rows/Remapping Failure Occurred",
             "gpu_recovery_action": "GPU Recovery Action"}


def query_health_cells(text: str) -> list[dict[str, str]]:
    """``nvidia-smi -q`` (whole or the sections kept): per GPU (``GPU 00000000:10:1C.0`` blocks; a record
    without its ``GPU`` line is one GPU's) the cells :data:`HEALTH_FIELDS` would print for the ECC,
    retired-page, remapped-row and recovery sections it holds (a section it lacks is left out): what the
    lab's stand-in replays from a recorded ``-q``. An ECC total is the sum of a section's
    ``...Correctable``/``...Uncorrectable`` counters (SRAM and DRAM, or device memory, register file, caches)
    where it prints no ``Total``."""
    gpus: list[dict[str, str]] = []
    values: dict[str, str] = {}
    path: list[tuple[int, str]] = []

    def finish() -> None:
        if not gpus:
            return
        cells = gpus[-1]
        for field, key in _Q_VALUES.items():
            if key in values:
                cells[field] = values[key]
        for field, (section, kind) in _Q_ECC.items():
            total = values.get(f"{section}/Total")
            counters = [v for k, v in values.items() if k.startswith(section + "/")
                        and k.rsplit("/", 1)[1].split()[-1] == kind]
            if total is not None:
                cells[field] = total
            elif counters:
                numbers = [whole(v) for v in counters]
                cells[field] = str(sum(n for n in numbers if n is not None)) if any(
                    n is not None for n in numbers) else "[N/A]"

    for line in text.splitlines():
        gpu = re.match(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)\s*$", line)
        if gpu is not None:
            finish()
            gpus.append({"pci.bus_id": gpu.group(1)})
            values, path = {}, []
            continue
        item = re.match(r"^( +)([^:\[]+?)\s*(?::\s*(.*))?$", line)
        if item is None:
            continue
        if not gpus:  # one GPU's record, shown without its GPU line
            gpus.append({})
        depth, key, value = len(item.group(1)), item.group(2).strip(), item.group(3)
        while path and path[-1][0] >= depth:
            path.pop()
        name = "/".join([p for _, p in path] + [key])
        if not value:
            path.append((depth, key))
        else:
            values[name] = value.strip()
    finish()
    return gpus


# ------------------------------------------------------------------------------------------ Xid errors

#: The driver's Xid report in the kernel log, as dmesg, journalctl and syslog all print it after their own
#: prefix: ``NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, ...`` (domain:bus:device of the GPU, then the code).
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})(?:\.[0-7])?\): (\d{1,4})\b")


@dataclass(frozen=True)
class XidEvent:
    bus: tuple[int, int, int]  # PCI domain, bus, device
    code: int


def parse_xids(text: str) -> list[XidEvent]:
    """Every Xid report in a kernel log's text, in order; every other line is passed over."""
    return [XidEvent((int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16)), int(m.group(4)))
            for m in map(_XID.search, text.splitlines()) if m is not None]


def bus_address(bus_id: str | None) -> tuple[int, int, int] | None:
    """nvidia-smi's ``pci.bus_id`` (``00000000:10:1C.0``) as the (domain, bus, device) an Xid names."""
    match = re.fullmatch(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.[0-7]", (bus_id or "").strip())
    return None if match is None else (int(match.group(1), 16), int(match.group(2), 16), int(match.group(3), 16))
