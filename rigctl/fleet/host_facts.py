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
from rigctl.hostside import cpuinfo, nvidia_smi
from rigctl.inventory.edit import OutsideText
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
_SECTIONS = ("gpus", "smi", "list", "cpu", "cpus", "memory", "disk", "os")
_COMPUTE_CAP = re.compile(r"^[0-9]{1,2}\.[0-9]$")
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+){0,3}$")


class HostText(OutsideText):
    """Text the host chose (a GPU's name, its CPU model, its OS), checked by :func:`host_text`: data, which
    the inventory files keep as ``!unsafe`` (:class:`~rigctl.inventory.edit.OutsideText`)."""


def host_text(host: str, field: str, text: str) -> HostText:
    """``text`` as :class:`HostText`; ProbeError naming ``host`` and ``field`` when it cannot be kept as data."""
    problem = data_text_problem(text, HOST_TEXT_MAX)
    if problem is not None:
        raise ProbeError(host, field, problem)
    return HostText(text)


@dataclass(frozen=True)
class MigFacts:
    """One MIG instance of a GPU (``nvidia-smi -L``): what a process pinned to ``uuid`` sees."""

    device: int
    profile: HostText
    uuid: HostText


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: HostText
    vram_mib: int | None  # None: the driver reports none (a unified-memory GPU: GB10, Grace Hopper)
    compute_capability: str
    uuid: HostText
    mig: tuple[MigFacts, ...] = ()  # MIG instances; none when MIG is off

    @property
    def unified_memory(self) -> bool:
        """Whether the GPU has no memory of its own to report: it uses the host's (``memory.total`` is
        ``[N/A]`` by design on GB10 and Grace Hopper)."""
        return self.vram_mib is None

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
        section("list", "nvidia-smi -L 2>&1"),
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
    summary = nvidia_smi.summary_versions(sections["smi"])
    gpus, driver = _gpus(host, sections["gpus"], summary.driver)
    if summary.cuda is None:
        raise ProbeError(host, "cuda_version", "nvidia-smi's summary names no CUDA version "
                                               "(neither 'CUDA Version' nor 'CUDA UMD Version')")
    gpus = _with_mig(host, gpus, sections["list"])
    model, flags = read_cpu(host, sections["cpu"])
    return HostFacts(
        gpus=gpus,
        driver_version=driver,
        cuda_version=summary.cuda,
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


def _gpus(host: str, text: str, summary_driver: str | None) -> tuple[tuple[GpuFacts, ...], str]:
    """The query's GPUs and their driver (the summary's where the query reports none)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or lines[-1].startswith("rc="):
        reason = lines[0].strip() if lines else "no output"
        raise ProbeError(host, "gpus", f"nvidia-smi failed: {reason}")
    fields = GPU_QUERY.split(",")
    gpus: list[GpuFacts] = []
    drivers = set()
    for number, line in enumerate(lines, 1):
        try:
            (cells,) = nvidia_smi.query_rows(line, fields)
        except ValueError:
            raise ProbeError(host, f"gpus line {number}", f"expected {len(fields)} fields: {line!r}") from None
        index = cells["index"]
        where = f"gpus[{index}]"
        name, cap = nvidia_smi.cell(cells["name"]), nvidia_smi.cell(cells["compute_cap"]) or ""
        driver = nvidia_smi.cell(cells["driver_version"]) or summary_driver or ""
        if not name:
            raise ProbeError(host, f"{where}.name", "not reported")
        if not _COMPUTE_CAP.match(cap):
            raise ProbeError(host, f"{where}.compute_capability", f"{cells['compute_cap']!r} is not major.minor")
        if not _VERSION.match(driver):
            raise ProbeError(host, "driver_version", f"{cells['driver_version']!r} is not a version")
        drivers.add(driver)
        vram = None if nvidia_smi.cell(cells["memory.total"]) is None else \
            _positive_int(host, f"{where}.vram_mib", cells["memory.total"])
        gpus.append(GpuFacts(_int(host, f"{where}.index", index), host_text(host, f"{where}.name", name),
                             vram, cap, host_text(host, f"{where}.uuid", cells["uuid"])))
    if len(drivers) != 1:
        raise ProbeError(host, "driver_version", f"GPUs report different drivers: {', '.join(sorted(drivers))}")
    indexes = [g.index for g in gpus]
    if indexes != list(range(len(gpus))):
        raise ProbeError(host, "gpus", f"indexes {indexes} are not 0..{len(gpus) - 1} in order")
    return tuple(gpus), drivers.pop()


def _with_mig(host: str, gpus: tuple[GpuFacts, ...], text: str) -> tuple[GpuFacts, ...]:
    """``gpus`` with their MIG instances from ``nvidia-smi -L``; ProbeError naming the line it cannot read."""
    try:
        listed = {g.index: g for g in nvidia_smi.list_gpus(text)}
    except ValueError as exc:
        raise ProbeError(host, "gpus.mig", str(exc)) from None
    out = []
    for gpu in gpus:
        entry = listed.get(gpu.index)
        mig = tuple(MigFacts(m.device, host_text(host, f"gpus[{gpu.index}].mig[{m.device}].profile", m.profile),
                             host_text(host, f"gpus[{gpu.index}].mig[{m.device}].uuid", m.uuid))
                    for m in (entry.mig if entry else ()))
        out.append(GpuFacts(gpu.index, gpu.name, gpu.vram_mib, gpu.compute_capability, gpu.uuid, mig))
    return tuple(out)



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
    out: dict[str, object] = {"gpu_host_gpu": _gpu_vars(facts, facts.gpus[0])}
    if len(facts.gpus) > 1:
        out["gpu_host_gpus"] = [{"index": g.index, **_gpu_vars(facts, g)} for g in facts.gpus]
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


def _gpu_vars(facts: HostFacts, gpu: GpuFacts) -> dict[str, object]:
    """One GPU as the inventory states it. A unified-memory GPU's memory is what the platform offers it,
    the host's (the VRAM checks use it); its MIG instances, where MIG is on, by UUID."""
    out: dict[str, object] = {"name": gpu.name,
                              "vram_mib": facts.memory_mib if gpu.unified_memory else gpu.vram_mib,
                              "compute_capability": gpu.compute_capability}
    if gpu.unified_memory:
        out["unified_memory"] = True
    if gpu.mig:
        out["mig"] = [{"device": m.device, "profile": m.profile, "uuid": m.uuid} for m in gpu.mig]
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
