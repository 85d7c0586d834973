"""``/proc/cpuinfo`` as a CPU model and its instruction-set words: the one reader of that file, used by
rigctl's host probe (``rigctl/fleet/host_facts.py``) and by the llama_cpp role's build probe (as
``module_utils``). Standard library only.

x86 kernels name the model (``model name``) and list ``flags``. arm64 kernels name no model at all: each
processor block gives ``CPU implementer`` and ``CPU part`` (the MIDR fields) and lists ``Features``; the model
is the part's name as the kernel's own table (arch/arm64/include/asm/cputype.h) and util-linux's lscpu call
it. A host whose cores are of several parts (big.LITTLE, DGX Spark's X925 + A725) is named by each, in the
order the kernel lists them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: (implementer, part) -> the core's name, for the cores GPU servers and workstations carry (Arm's Neoverse
#: and Cortex server/desktop cores, NVIDIA's and Ampere's own). An unlisted part is named by its numbers.
ARM_PARTS: dict[tuple[int, int], str] = {
    (0x41, 0xD03): "Cortex-A53", (0x41, 0xD05): "Cortex-A55", (0x41, 0xD07): "Cortex-A57",
    (0x41, 0xD08): "Cortex-A72", (0x41, 0xD0B): "Cortex-A76", (0x41, 0xD0C): "Neoverse-N1",
    (0x41, 0xD40): "Neoverse-V1", (0x41, 0xD41): "Cortex-A78", (0x41, 0xD49): "Neoverse-N2",
    (0x41, 0xD4F): "Neoverse-V2", (0x41, 0xD83): "Neoverse-V3AE", (0x41, 0xD84): "Neoverse-V3",
    (0x41, 0xD8E): "Neoverse-N3", (0x41, 0xD85): "Cortex-X925", (0x41, 0xD87): "Cortex-A725",
    (0x4E, 0x004): "NVIDIA Carmel", (0xC0, 0xAC3): "Ampere-1", (0xC0, 0xAC4): "Ampere-1a",
    (0x43, 0x0AF): "ThunderX2", (0x46, 0x001): "A64FX",
}
#: Implementer codes (MIDR bits 31:24) -> vendor, for naming a part the table does not know.
ARM_IMPLEMENTERS: dict[int, str] = {0x41: "ARM", 0x43: "Cavium", 0x46: "Fujitsu", 0x48: "HiSilicon",
                                    0x4E: "NVIDIA", 0x51: "Qualcomm", 0x61: "Apple", 0xC0: "Ampere"}
#: The keys the probe asks for; everything else in the file is per-core noise (clock, ids, bugs).
KEYS = ("model name", "flags", "Features", "CPU implementer", "CPU part")
_HEX = re.compile(r"^0x[0-9a-fA-F]{1,4}$")


@dataclass(frozen=True)
class CpuInfo:
    model: str | None  # None: the file names no model and no core part
    flags: frozenset[str]  # the first processor's `flags` (x86) or `Features` (arm64) words


def probe_command(path: str = "/proc/cpuinfo") -> str:
    """Shell that sends what :func:`parse` needs from ``path`` and no more: the lines of :data:`KEYS`, each
    distinct line once (a 192-core host repeats the same flags 192 times). Parsed, it gives what the whole
    file gives, as long as no implementer code comes back after another one (no known host mixes vendors)."""
    keys = "|".join(KEYS)
    return f"grep -E '^({keys})[[:space:]]*:' {path} | awk '!seen[$0]++'"


def parse(text: str) -> CpuInfo:
    """The model and instruction-set words of ``/proc/cpuinfo`` text (the whole file or
    :func:`probe_command`'s lines). Lines that are not ``key : value`` are skipped."""
    model: str | None = None
    flags: frozenset[str] | None = None
    implementer: int | None = None
    parts: list[tuple[int, int]] = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "model name" and model is None and value:
            model = value
        elif key in ("flags", "Features") and flags is None:
            flags = frozenset(value.split())
        elif key == "CPU implementer" and _HEX.match(value):
            implementer = int(value, 16)
        elif key == "CPU part" and _HEX.match(value) and implementer is not None \
                and (implementer, int(value, 16)) not in parts:
            parts.append((implementer, int(value, 16)))
    if model is None and parts:
        model = " + ".join(_part_name(implementer, part) for implementer, part in parts)
    return CpuInfo(model=model, flags=flags or frozenset())


def _part_name(implementer: int, part: int) -> str:
    known = ARM_PARTS.get((implementer, part))
    if known:
        return known
    vendor = ARM_IMPLEMENTERS.get(implementer, f"implementer 0x{implementer:02x}")
    return f"{vendor} part 0x{part:03x}"
