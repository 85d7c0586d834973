"""The lab's stand-in GPU, which is no GPU: the JSON state file each rig's stand-in ``nvidia-smi``
(``assets/nvidia-smi``) answers from. Tests set it to play a card's temperature, clocks and memory; product
code never depends on it."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigctl.errors import ConfigError, LabError
from rigctl.lab.system import wait_until

GPU_STATE_IN_RIG = Path("etc/rigctl-lab/gpu.json")
NVIDIA_SMI_IN_RIG = Path("usr/local/bin/nvidia-smi")
DEFAULT_GPU_DRIVER_VERSION = "535.183.01"
DEFAULT_GPU_CUDA_VERSION = "12.2"
IDLE_GPU_TEMPERATURE_C = 35
#: The stand-in's clocks: a card at its boost clock with nothing holding it back.
DEFAULT_GPU_MAX_SM_MHZ = 1950
DEFAULT_GPU_MEM_MHZ = 7000
DEFAULT_GPU_POWER_W = 20.0
#: What one entry of ``clocks_sequence`` may set.
GPU_CLOCK_KEYS = {"clocks_sm_mhz": int, "clocks_mem_mhz": int, "power_draw_w": (int, float),
                  "clocks_event_reasons": int}
ADDITIONAL_GPU_FIELDS = frozenset({"name", "memory_total_mib", "compute_cap", "uuid", "pci_bus_id"})
GPU_LOCK_TIMEOUT_S = 10


@dataclass(frozen=True)
class GpuState:
    """What the stand-in nvidia-smi of one rig reports (its JSON state file)."""

    name: str
    memory_total_mib: int
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
    #: NVML clock event reasons bitmask (0x40: HW thermal slowdown, 0x4: SW power cap, ...).
    clocks_event_reasons: int = 0
    #: Each nvidia-smi call that reports a clock, power or reasons field applies the next entry (a
    #: mapping of GPU_CLOCK_KEYS), which then sticks: how tests throttle a card in the middle of a cell.
    clocks_sequence: tuple[dict[str, Any], ...] = ()
    #: A rig with several GPUs: the second, third... (each its own name, memory_total_mib,
    #: compute_cap, uuid and pci_bus_id); what it does not say comes from the first.
    additional_gpus: tuple[Mapping[str, Any], ...] = ()

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["temperature_sequence"] = list(self.temperature_sequence)
        data["clocks_sequence"] = [dict(entry) for entry in self.clocks_sequence]
        data["additional_gpus"] = [dict(g) for g in self.additional_gpus]
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
        if isinstance(values.get("power_draw_w"), int) and not isinstance(values["power_draw_w"], bool):
            values["power_draw_w"] = float(values["power_draw_w"])
        if "additional_gpus" in values:
            values["additional_gpus"] = tuple(values["additional_gpus"] or ())
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
        if not 0 <= self.memory_used_mib <= self.memory_total_mib:
            raise ConfigError(f"{origin}: memory_used_mib {self.memory_used_mib} is outside 0..{self.memory_total_mib}")
        for number, extra in enumerate(self.additional_gpus, 1):
            if not isinstance(extra, Mapping) or set(extra) != ADDITIONAL_GPU_FIELDS:
                raise ConfigError(f"{origin}: additional_gpus[{number - 1}] must have exactly "
                                  f"{', '.join(sorted(ADDITIONAL_GPU_FIELDS))}")
            if type(extra["memory_total_mib"]) is not int or not all(
                type(extra[k]) is str for k in ADDITIONAL_GPU_FIELDS - {"memory_total_mib"}
            ):
                raise ConfigError(f"{origin}: additional_gpus[{number - 1}] has a value of the wrong type")


def gpu_seed(host: str, gpu: Mapping[str, Any]) -> GpuState:
    """The stand-in GPU's first state, from the host's ``gpu_host_gpu``."""
    origin = f"{host}: gpu_host_gpu"
    try:
        return GpuState.from_mapping(
            {
                "name": str(gpu["name"]),
                "memory_total_mib": int(gpu["vram_mib"]),
                "compute_cap": str(gpu["compute_capability"]),
                "uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'rigctl-lab:{host}')}",
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
