"""What a GPU host is: its GPUs, CPU, memory, disk and OS, read with one SSH command.

:func:`probe_command` is the shell script sent to the host; :func:`parse_probe` turns what came back
into :class:`HostFacts`. The parser is pure and trusts nothing: the host's output is input, every
field is checked and a bad one is a :class:`~rigctl.errors.ProbeError` naming the host and the field.
Sections are fenced with a token the controller draws for each probe, so no line the host prints
can pass for a section of its own. Text the host chooses freely (a GPU's name, the CPU model, the OS)
is :class:`HostText`: printable, bounded and free of template markers, and written into the inventory
as ``!unsafe`` so Ansible never templates it.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from rigctl.errors import ProbeError
from rigctl.hostside import cpuinfo
from rigctl.inventory.keys import HOST_TEXT_MAX
from rigctl.trust import data_text_problem

#: nvidia-smi's per-GPU fields, in the order the probe asks for them.
GPU_QUERY = "index,name,memory.total,compute_cap,driver_version,uuid,pci.bus_id"
#: CPU flags that change which llama.cpp kernels run (x86 `flags`, then arm64 `Features`: NEON and its fp16
#: and dot-product forms, SVE, int8 and bf16 matrix multiply, SME); the rest of /proc/cpuinfo's list is noise here.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16",
             "asimd", "asimdhp", "asimddp", "sve", "sve2", "i8mm", "bf16", "sme")
PROBE_TIMEOUT_S = 60.0
_SECTIONS = ("gpus", "smi", "cpu", "cpus", "memory", "disk", "os")
_COMPUTE_CAP = re.compile(r"^[0-9]{1,2}\.[0-9]$")
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+){0,3}$")
_CUDA_VERSION = re.compile(r"CUDA Version:\s*(\d+\.\d+)")


class HostText(str):
    """Text the host chose (a GPU's name, its CPU model, its OS), checked by :func:`host_text`: data, which
    the inventory files keep as ``!unsafe``. Values a pattern already confines (versions, compute
    capabilities) stay plain ``str``: Ansible reads an ``!unsafe`` scalar as YAML would read it unquoted, so
    ``!unsafe '8.6'`` would load as a float."""


def host_text(host: str, field: str, text: str) -> HostText:
    """``text`` as :class:`HostText`; ProbeError naming ``host`` and ``field`` when it cannot be kept as data."""
    problem = data_text_problem(text, HOST_TEXT_MAX)
    if problem is not None:
        raise ProbeError(host, field, problem)
    return HostText(text)


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: HostText
    vram_mib: int
    compute_capability: str
    uuid: HostText

    @property
    def cuda_arch(self) -> str:
        """CMake's CUDA architecture for this compute capability (8.6 -> 86)."""
        return self.compute_capability.replace(".", "")


@dataclass(frozen=True)
class HostFacts:
    gpus: tuple[GpuFacts, ...]
    driver_version: str
    cuda_version: str
    cpu_model: HostText
    cpu_flags: tuple[str, ...]
    cpus: int
    memory_mib: int
    disk_free_mib: int
    os: HostText

    @property
    def cuda_architectures(self) -> str:
        """What llama_cpp_cuda_architectures takes: every GPU's architecture once, ascending."""
        return ";".join(sorted({g.cuda_arch for g in self.gpus}, key=int))


def probe_command(token: str, disk_path: str = "/var/lib") -> str:
    """The one command the probe runs: each section behind ``### <token> <section>``."""

    def section(name: str, body: str) -> str:
        return f"echo '### {token} {name}'; {body}"

    return "; ".join([
        section("gpus", f"nvidia-smi --query-gpu={GPU_QUERY} --format=csv,noheader,nounits 2>&1 || echo 'rc='$?"),
        section("smi", "nvidia-smi 2>&1 | head -n 12"),
        section("cpu", cpuinfo.probe_command()),
        section("cpus", "nproc"),
        section("memory", "grep -E '^MemTotal:' /proc/meminfo"),
        section("disk", f"df -Pk {disk_path} | tail -n 1"),
        section("os", "cat /etc/os-release"),
        f"echo '### {token} end'",
    ])


def new_token() -> str:
    return secrets.token_hex(8)


def parse_probe(host: str, output: str, token: str) -> HostFacts:
    """The facts in ``output`` of :func:`probe_command` run with ``token`` on ``host``."""
    sections = _split(host, output, token)
    gpus, driver = _gpus(host, sections["gpus"])
    cuda = _CUDA_VERSION.search(sections["smi"])
    if cuda is None:
        raise ProbeError(host, "cuda_version", "nvidia-smi's summary names no CUDA version")
    model, flags = read_cpu(host, sections["cpu"])
    return HostFacts(
        gpus=gpus,
        driver_version=driver,
        cuda_version=cuda.group(1),
        cpu_model=model,
        cpu_flags=flags,
        cpus=_positive_int(host, "cpus", sections["cpus"].strip()),
        memory_mib=_memory_mib(host, sections["memory"]),
        disk_free_mib=_disk_free_mib(host, sections["disk"]),
        os=read_os(host, sections["os"]),
    )


def _split(host: str, output: str, token: str) -> dict[str, str]:
    marker = f"### {token} "
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    ended = False
    for line in output.splitlines():
        if line.startswith(marker):
            name = line[len(marker):].strip()
            if name == "end":
                ended = True
                break
            if name not in _SECTIONS or name in found:
                raise ProbeError(host, "output", f"unexpected section {name!r}")
            current = found[name] = []
        elif current is not None:
            current.append(line)
    missing = [name for name in _SECTIONS if name not in found]
    if missing or not ended:
        raise ProbeError(host, "output", f"incomplete (missing: {', '.join(missing) or 'end'})")
    return {name: "\n".join(lines) for name, lines in found.items()}


def _gpus(host: str, text: str) -> tuple[tuple[GpuFacts, ...], str]:
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or lines[-1].startswith("rc="):
        reason = lines[0].strip() if lines else "no output"
        raise ProbeError(host, "gpus", f"nvidia-smi failed: {reason}")
    gpus: list[GpuFacts] = []
    drivers = set()
    for number, line in enumerate(lines, 1):
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(GPU_QUERY.split(",")):
            raise ProbeError(host, f"gpus line {number}", f"expected {len(GPU_QUERY.split(','))} fields: {line!r}")
        index, name, vram, cap, driver, uuid, _bus = cells
        where = f"gpus[{index}]"
        if not name:
            raise ProbeError(host, f"{where}.name", "empty")
        if not _COMPUTE_CAP.match(cap):
            raise ProbeError(host, f"{where}.compute_capability", f"{cap!r} is not major.minor")
        if not _VERSION.match(driver):
            raise ProbeError(host, "driver_version", f"{driver!r} is not a version")
        drivers.add(driver)
        gpus.append(GpuFacts(_int(host, f"{where}.index", index), host_text(host, f"{where}.name", name),
                             _positive_int(host, f"{where}.vram_mib", vram), cap,
                             host_text(host, f"{where}.uuid", uuid)))
    if len(drivers) != 1:
        raise ProbeError(host, "driver_version", f"GPUs report different drivers: {', '.join(sorted(drivers))}")
    indexes = [g.index for g in gpus]
    if indexes != list(range(len(gpus))):
        raise ProbeError(host, "gpus", f"indexes {indexes} are not 0..{len(gpus) - 1} in order")
    return tuple(gpus), drivers.pop()


def read_cpu(host: str, text: str) -> tuple[HostText, tuple[str, ...]]:
    """The CPU model and its :data:`ISA_FLAGS` from the probe's cpu section (or a whole /proc/cpuinfo)."""
    info = cpuinfo.parse(text)
    if not info.model:
        raise ProbeError(host, "cpu_model", "/proc/cpuinfo names no model and no CPU part")
    return host_text(host, "cpu_model", info.model), tuple(f for f in ISA_FLAGS if f in info.flags)


def _memory_mib(host: str, text: str) -> int:
    match = re.match(r"^MemTotal:\s+([0-9]+)\s+kB$", text.strip())
    if match is None:
        raise ProbeError(host, "memory_mib", f"unexpected /proc/meminfo line {text.strip()!r}")
    return _positive_int(host, "memory_mib", match.group(1)) // 1024


def _disk_free_mib(host: str, text: str) -> int:
    cells = text.split()
    if len(cells) < 6:
        raise ProbeError(host, "disk_free_mib", f"unexpected df line {text.strip()!r}")
    return _int(host, "disk_free_mib", cells[3]) // 1024


def read_os(host: str, text: str) -> HostText:
    """The system's name from /etc/os-release text: PRETTY_NAME, else NAME and VERSION_ID."""
    release: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and re.fullmatch(r"[A-Z_]+", key):
            value = value.strip()
            quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'"  # os-release(5) takes either
            release[key] = value[1:-1] if quoted else value
    name = release.get("PRETTY_NAME") or " ".join(filter(None, (release.get("NAME"), release.get("VERSION_ID"))))
    if not name:
        raise ProbeError(host, "os", "/etc/os-release names no system")
    return host_text(host, "os", name)


def _int(host: str, field: str, text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,15}", text):
        raise ProbeError(host, field, f"{text!r} is not a whole number")
    return int(text)


def _positive_int(host: str, field: str, text: str) -> int:
    value = _int(host, field, text)
    if value <= 0:
        raise ProbeError(host, field, f"{value} is not positive")
    return value


# ----------------------------------------------------------------------------------------------- inventory form


def inventory_vars(facts: HostFacts) -> dict[str, object]:
    """The host_vars the facts become: the first GPU as ``gpu_host_gpu`` (what the roles check), every
    GPU as ``gpu_host_gpus`` when there are several, the CUDA architectures, the rest as
    ``rigctl_host_facts``. Free disk space is shown, not recorded: it changes on its own, and a record
    of it would make every `hosts add` rewrite the file."""
    first = facts.gpus[0]
    out: dict[str, object] = {
        "gpu_host_gpu": {"name": first.name, "vram_mib": first.vram_mib,
                         "compute_capability": first.compute_capability},
    }
    if len(facts.gpus) > 1:
        out["gpu_host_gpus"] = [
            {"index": g.index, "name": g.name, "vram_mib": g.vram_mib, "compute_capability": g.compute_capability}
            for g in facts.gpus
        ]
    out["llama_cpp_cuda_architectures"] = facts.cuda_architectures
    out["rigctl_host_facts"] = {
        "driver_version": facts.driver_version,
        "cuda_version": facts.cuda_version,
        "cpu_model": facts.cpu_model,
        "cpu_flags": list(facts.cpu_flags),
        "cpus": facts.cpus,
        "memory_mib": facts.memory_mib,
        "os": facts.os,
    }
    return out


def drift(recorded: Mapping[str, object], observed: Mapping[str, object]) -> list[tuple[str, object, object]]:
    """(key path, recorded, observed) for each value of ``observed`` that ``recorded`` states otherwise."""
    out: list[tuple[str, object, object]] = []

    def walk(path: str, old: object, new: object) -> None:
        if isinstance(new, Mapping) and isinstance(old, Mapping):
            for key in new:
                walk(f"{path}.{key}" if path else str(key), old.get(key), new[key])
        elif old != new:
            out.append((path, old, new))

    walk("", recorded, observed)
    return out
