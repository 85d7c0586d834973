"""The lab's stand-in GPU, which is no GPU: the JSON state file each rig's stand-in ``nvidia-smi``
(``assets/nvidia-smi``) answers from. Tests set it to play a card's temperature, clocks and memory; product
code never depends on it."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from rigctl.errors import ConfigError, LabError
from rigctl.hostside.nvidia_smi import HEALTH_FIELDS, query_health_cells
from rigctl.lab.system import wait_until

GPU_STATE_IN_RIG = Path("etc/rigctl-lab/gpu.json")
NVIDIA_SMI_IN_RIG = Path("usr/local/bin/nvidia-smi")
#: The stand-in kernel log (``assets/dmesg``): the state's kernel_log lines.
DMESG_IN_RIG = Path("usr/local/bin/dmesg")
DEFAULT_GPU_DRIVER_VERSION = "535.183.01"
DEFAULT_GPU_CUDA_VERSION = "12.2"
IDLE_GPU_TEMPERATURE_C = 35
#: The stand-in's clocks: a card at its boost clock with nothing holding it back.
DEFAULT_GPU_MAX_SM_MHZ = 1950
DEFAULT_GPU_MEM_MHZ = 7000
DEFAULT_GPU_POWER_W = 20.0
DEFAULT_GPU_POWER_LIMIT_W = 250.0
#: What one entry of ``clocks_sequence`` may set.
GPU_CLOCK_KEYS = {"clocks_sm_mhz": int, "clocks_mem_mhz": int, "power_draw_w": (int, float),
                  "clocks_event_reasons": int}
ADDITIONAL_GPU_FIELDS = frozenset({"name", "memory_total_mib", "compute_cap", "uuid", "pci_bus_id"})
#: The readings a second, third... GPU may have of its own; what it does not set comes from the first GPU.
ADDITIONAL_GPU_READINGS = {"temperature": int, "memory_used_mib": int, "utilization_gpu": int,
                           "persistence_mode": bool, "power_draw_w": (int, float),
                           "power_limit_w": (int, float, type(None)),
                           "clocks_sm_mhz": int, "clocks_max_sm_mhz": int, "clocks_mem_mhz": int,
                           "clocks_event_reasons": int}
#: Besides, its MIG mode (as a capture has it).
ADDITIONAL_GPU_OPTIONAL = {**ADDITIONAL_GPU_READINGS, "mig_mode": str}
#: The fields a capture fixes: a test may move a captured card's readings, never make it another card.
CAPTURED_FIELDS = ("name", "memory_total_mib", "compute_cap", "driver_version", "cuda_version", "pci_bus_id",
                   "mig_mode", "additional_gpus", "summary")
GPU_LOCK_TIMEOUT_S = 10


@dataclass(frozen=True)
class GpuState:
    """What the stand-in nvidia-smi of one rig reports (its JSON state file)."""

    name: str
    #: None: the card reports no memory of its own (a unified-memory GPU prints ``[N/A]``).
    memory_total_mib: int | None
    compute_cap: str
    uuid: str
    driver_version: str = DEFAULT_GPU_DRIVER_VERSION
    cuda_version: str = DEFAULT_GPU_CUDA_VERSION
    temperature: int = IDLE_GPU_TEMPERATURE_C
    #: Each nvidia-smi call that reports the temperature takes the next value; the last one sticks.
    temperature_sequence: tuple[int, ...] = ()
    memory_used_mib: int = 0
    utilization_gpu: int = 0
    persistence_mode: bool = False
    pci_bus_id: str = "00000000:01:00.0"
    clocks_sm_mhz: int = DEFAULT_GPU_MAX_SM_MHZ
    clocks_max_sm_mhz: int = DEFAULT_GPU_MAX_SM_MHZ
    clocks_mem_mhz: int = DEFAULT_GPU_MEM_MHZ
    power_draw_w: float = DEFAULT_GPU_POWER_W
    #: None: the card reports no power limit (a GB10 prints N/A).
    power_limit_w: float | None = DEFAULT_GPU_POWER_LIMIT_W
    #: NVML clock event reasons bitmask (0x40: HW thermal slowdown, 0x4: SW power cap, ...).
    clocks_event_reasons: int = 0
    #: Each nvidia-smi call that reports a clock, power or reasons field applies the next entry (a
    #: mapping of GPU_CLOCK_KEYS), which then sticks: how tests throttle a card in the middle of a cell.
    clocks_sequence: tuple[dict[str, Any], ...] = ()
    #: A rig with several GPUs: the second, third... (each its own name, memory_total_mib,
    #: compute_cap, uuid and pci_bus_id); what it does not say comes from the first.
    additional_gpus: tuple[Mapping[str, Any], ...] = ()
    #: The summary table's "MIG M." cell: N/A (no MIG), Disabled or Enabled.
    mig_mode: str = "N/A"
    #: The recorded real capture this card replays (rigctl/lab/captures/nvidia-smi/<capture>.txt); "" for
    #: a card made up from ``gpu_host_gpu``.
    capture: str = ""
    #: That capture's summary table, which the stand-in prints with this state's readings in its cells.
    summary: str = ""
    #: The first GPU's health query cells by field (:data:`rigctl.hostside.nvidia_smi.HEALTH_FIELDS`), as a
    #: recorded ``nvidia-smi -q`` has them (:func:`health_from_capture`); a field it lacks reads [N/A].
    health: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: What the stand-in dmesg prints: recorded kernel log lines (:func:`kernel_log_from_capture`).
    kernel_log: tuple[str, ...] = ()

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["temperature_sequence"] = list(self.temperature_sequence)
        data["clocks_sequence"] = [dict(entry) for entry in self.clocks_sequence]
        data["additional_gpus"] = [dict(g) for g in self.additional_gpus]
        data["health"], data["kernel_log"] = dict(self.health), list(self.kernel_log)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], origin: str) -> GpuState:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{origin}: unknown GPU field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        values = dict(data)
        if "temperature_sequence" in values:
            values["temperature_sequence"] = tuple(values["temperature_sequence"] or ())
        if "clocks_sequence" in values:
            values["clocks_sequence"] = tuple(values["clocks_sequence"] or ())
        for watts in ("power_draw_w", "power_limit_w"):
            if isinstance(values.get(watts), int) and not isinstance(values[watts], bool):
                values[watts] = float(values[watts])
        if "additional_gpus" in values:
            values["additional_gpus"] = tuple(values["additional_gpus"] or ())
        if "kernel_log" in values:
            values["kernel_log"] = tuple(values["kernel_log"] or ())
        if "health" in values:
            values["health"] = dict(values["health"] or {})
        try:
            state = cls(**values)
        except TypeError as exc:
            raise ConfigError(f"{origin}: {exc}") from None
        state.check(origin)
        return state

    def check(self, origin: str) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = {"int": int, "str": str, "bool": bool, "float": float}.get(str(f.type))
            if expected is not None and (type(value) is not expected):
                raise ConfigError(f"{origin}: GPU field {f.name} must be {f.type}, got {value!r}")
        if not all(type(t) is int for t in self.temperature_sequence):
            raise ConfigError(
                f"{origin}: temperature_sequence must hold whole degrees, got {self.temperature_sequence!r}"
            )
        for entry in self.clocks_sequence:
            if not isinstance(entry, dict) or not entry or not set(entry) <= set(GPU_CLOCK_KEYS) or any(
                    type(v) is bool or not isinstance(v, GPU_CLOCK_KEYS[k]) for k, v in entry.items()):
                raise ConfigError(f"{origin}: clocks_sequence entries must map some of "
                                  f"{', '.join(sorted(GPU_CLOCK_KEYS))} to numbers, got {entry!r}")
        if self.power_limit_w is not None and type(self.power_limit_w) is not float:
            raise ConfigError(f"{origin}: GPU field power_limit_w must be a number or null, "
                              f"got {self.power_limit_w!r}")
        if self.memory_total_mib is not None and type(self.memory_total_mib) is not int:
            raise ConfigError(f"{origin}: GPU field memory_total_mib must be int or null, "
                              f"got {self.memory_total_mib!r}")
        _check_memory(origin, self.memory_used_mib, self.memory_total_mib)
        cells = set(HEALTH_FIELDS) - {"index", "pci.bus_id", "power.draw", "power.limit", "clocks_event_reasons.active"}
        if not isinstance(self.health, Mapping) or not set(self.health) <= cells or not all(
                isinstance(v, str) and v.isprintable() and "," not in v for v in self.health.values()):
            raise ConfigError(f"{origin}: health maps some of {', '.join(sorted(cells))} to one cell's text each")
        if not all(isinstance(line, str) and line.isprintable() for line in self.kernel_log):
            raise ConfigError(f"{origin}: kernel_log must hold lines of text")
        for number, extra in enumerate(self.additional_gpus):
            where = f"{origin}: additional_gpus[{number}]"
            if not isinstance(extra, Mapping) or not ADDITIONAL_GPU_FIELDS <= set(extra) <= (
                    ADDITIONAL_GPU_FIELDS | set(ADDITIONAL_GPU_OPTIONAL)):
                raise ConfigError(f"{where} must have {', '.join(sorted(ADDITIONAL_GPU_FIELDS))} and may have "
                                  f"{', '.join(sorted(ADDITIONAL_GPU_OPTIONAL))}")
            if extra["memory_total_mib"] is not None and type(extra["memory_total_mib"]) is not int or not all(
                type(extra[k]) is str for k in ADDITIONAL_GPU_FIELDS - {"memory_total_mib"}
            ) or any(type(v) is bool and ADDITIONAL_GPU_OPTIONAL[k] is not bool
                     or not isinstance(v, ADDITIONAL_GPU_OPTIONAL[k]) for k, v in extra.items()
                     if k in ADDITIONAL_GPU_OPTIONAL):
                raise ConfigError(f"{where} has a value of the wrong type")
            _check_memory(where, extra.get("memory_used_mib", self.memory_used_mib), extra["memory_total_mib"])
        if self.capture:
            captured = _captured_state(self.capture, self.uuid)
            moved = [k for k in CAPTURED_FIELDS
                     if _fixed(getattr(self, k)) != _fixed(getattr(captured, k))]
            if moved:
                raise ConfigError(f"{origin}: {', '.join(moved)} must stay as capture {self.capture} has them; "
                                  "only readings (temperature, clocks, memory used, ...) may change")


def _fixed(value: Any) -> Any:
    """``value`` with what a reading may change left out (for comparing what a capture fixes)."""
    if isinstance(value, tuple):
        return [{k: v for k, v in g.items() if k not in ADDITIONAL_GPU_READINGS} for g in value]
    return value


def _check_memory(origin: str, used: int, total: int | None) -> None:
    if total is not None and not 0 <= used <= total:
        raise ConfigError(f"{origin}: memory_used_mib {used} is outside 0..{total}")


#: What a summary table does not print: each captured model's compute capability (NVIDIA's CUDA GPU list).
CAPTURED_COMPUTE_CAPABILITY = {"NVIDIA GeForce RTX 3050": "8.6", "NVIDIA GeForce GTX 1650 Ti": "7.5",
                               "NVIDIA A100-PCIE-40GB": "8.0", "NVIDIA GeForce RTX 2060": "7.5",
                               "NVIDIA GeForce RTX 3060": "8.6", "NVIDIA GeForce RTX 3060 Ti": "8.6",
                               "NVIDIA GeForce RTX 3070": "8.6",
                               "NVIDIA GeForce RTX 5090": "12.0", "NVIDIA GB10": "12.1"}
_HEADER = re.compile(r"NVIDIA-SMI \S+\s+(?:Driver|KMD) Version: (\S+)\s+CUDA (?:UMD )?Version: (\S+)")
_ROW_NAME = re.compile(r"^\|\s+(\d+)\s+(\S.*?)\s+(On|Off)\s+\|\s+([0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)\s")
_ROW_READINGS = re.compile(r"^\|\s*\S+\s+(\d+)C\s+P\d+\s+(\S+)\s*/\s*(\S+)\s*\|\s*"
                           r"(?:(\d+)MiB\s*/\s*(\d+)MiB|Not Supported)\s*\|\s*(?:(\d+)%|N/A)")
_ROW_MIG = re.compile(r"^\|\s+\|\s+\|\s+(\S+)\s+\|$")


def capture_text(name: str, kind: str = "nvidia-smi") -> tuple[str, str]:
    """The source line and the text of the lab's capture ``name`` of ``kind`` (nvidia-smi: summary tables,
    nvidia-smi-q: ``nvidia-smi -q`` records, kernel-log: kernel logs); ConfigError naming it when there is none."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise ConfigError(f"capture {name!r}: not a capture name (lower-case letters, digits and -)")
    path = resources.files("rigctl.lab") / "captures" / kind / f"{name}.txt"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"capture {name}: no such capture in rigctl/lab/captures/{kind}") from None
    source, _, table = text.partition("\n")
    if not source.startswith("# source: "):
        raise ConfigError(f"capture {name}: its first line must name its source (# source: ...)")
    return source, table


def health_from_capture(name: str) -> dict[str, str]:
    """The first GPU's health cells of recorded ``nvidia-smi -q`` ``name`` (rigctl/lab/captures/nvidia-smi-q),
    read by rigctl's own reader (:func:`rigctl.hostside.nvidia_smi.query_health_cells`): the ``health`` a
    test gives the stand-in to play that condition. What the record says N/A is left to read [N/A]."""
    _, text = capture_text(name, "nvidia-smi-q")
    gpus = query_health_cells(text)
    if not gpus:
        raise ConfigError(f"capture {name}: no GPU health in it")
    return {k: v for k, v in gpus[0].items() if k != "pci.bus_id" and v != "N/A"}


def kernel_log_from_capture(name: str) -> tuple[str, ...]:
    """The lines of recorded kernel log ``name`` (rigctl/lab/captures/kernel-log): the stand-in dmesg's."""
    _, text = capture_text(name, "kernel-log")
    return tuple(text.splitlines())


def gpu_from_capture(name: str, first_uuid: str) -> GpuState:
    """The card(s) capture ``name`` shows, as the stand-in's state: its driver and CUDA versions, each GPU's
    model, bus id, memory, persistence and MIG mode, and its readings as recorded. The first GPU's UUID is
    ``first_uuid``; the others' follow from it."""
    state = _captured_state(name, first_uuid)
    state.check(f"capture {name}")
    return state


def _captured_state(name: str, first_uuid: str) -> GpuState:
    _, table = capture_text(name)
    lines = table.splitlines()
    header = next((m for m in map(_HEADER.search, lines) if m), None)
    if header is None:
        raise ConfigError(f"capture {name}: no driver/CUDA version header")
    gpus: list[dict[str, Any]] = []
    for number, line in enumerate(lines):
        row = _ROW_NAME.match(line)
        if row is None:
            continue
        readings = _ROW_READINGS.match(lines[number + 1]) if number + 1 < len(lines) else None
        mig = _ROW_MIG.match(lines[number + 2]) if number + 2 < len(lines) else None
        model = row.group(2)
        if readings is None or mig is None or int(row.group(1)) != len(gpus):
            raise ConfigError(f"capture {name}: GPU {row.group(1)}'s rows are not a summary table's")
        if model not in CAPTURED_COMPUTE_CAPABILITY:
            raise ConfigError(f"capture {name}: no compute capability known for {model!r} "
                              "(a name the table cut short ends in ...)")
        power, cap = (readings.group(n).removesuffix("W") for n in (2, 3))
        gpus.append({
            "name": model, "persistence_mode": row.group(3) == "On", "pci_bus_id": row.group(4),
            "compute_cap": CAPTURED_COMPUTE_CAPABILITY[model], "temperature": int(readings.group(1)),
            "power_draw_w": float(power) if power.replace(".", "", 1).isdigit() else DEFAULT_GPU_POWER_W,
            "power_limit_w": float(cap) if cap.isdigit() else None,
            "memory_used_mib": int(readings.group(4) or 0),
            "memory_total_mib": int(readings.group(5)) if readings.group(5) else None,
            "utilization_gpu": int(readings.group(6) or 0), "mig_mode": mig.group(1),
            "uuid": first_uuid if not gpus else f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'{first_uuid}/{len(gpus)}')}",
        })
    if not gpus:
        raise ConfigError(f"capture {name}: no GPU rows")
    first, *others = gpus
    return GpuState(**first, driver_version=header.group(1), cuda_version=header.group(2),
                    additional_gpus=tuple(others), capture=name, summary=table)


def host_gpu_uuid(host: str) -> str:
    """The stand-in's UUID for ``host``'s first GPU: fixed by the rig's name, different for every rig."""
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'rigctl-lab:{host}')}"


def gpu_seed(host: str, gpu: Mapping[str, Any]) -> GpuState:
    """The stand-in GPU's first state, from the host's ``gpu_host_gpu``."""
    origin = f"{host}: gpu_host_gpu"
    try:
        return GpuState.from_mapping(
            {
                "name": str(gpu["name"]),
                "memory_total_mib": int(gpu["vram_mib"]),
                "compute_cap": str(gpu["compute_capability"]),
                "uuid": host_gpu_uuid(host),
                **{k: str(gpu[k]) for k in ("driver_version", "cuda_version") if k in gpu},
            },
            origin,
        )
    except KeyError as exc:
        raise ConfigError(f"{origin}: missing {exc.args[0]}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{origin}: {exc}") from None


@contextlib.contextmanager
def gpu_lock(state_path: Path) -> Iterator[None]:
    """The lock the stand-in nvidia-smi takes around its own read-modify-write of the state."""
    lock_path = f"{state_path}.lock"
    fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        if not wait_until(lambda: _try_flock(fd), GPU_LOCK_TIMEOUT_S):
            raise LabError(f"{lock_path} stayed locked for {GPU_LOCK_TIMEOUT_S}s")
        yield
    finally:
        os.close(fd)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def read_gpu_state(path: Path, rig: str) -> GpuState:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LabError(f"{rig}: cannot read the stand-in GPU state {path}: {exc}") from None
    return GpuState.from_mapping(data, f"{rig}: {path}")
