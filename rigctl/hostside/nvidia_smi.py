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
