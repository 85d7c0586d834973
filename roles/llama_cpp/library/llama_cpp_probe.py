#!/usr/bin/python3
# Part of rigctl's llama_cpp role.
"""Read-only probe of a build host: toolchain, CUDA, GPU, free disk. Changes nothing."""

from __future__ import annotations

DOCUMENTATION = r"""
module: llama_cpp_probe
short_description: Report what a llama.cpp build needs to know about the host
description:
  - Versions of cmake, the C++ compiler, ccache, git and nvcc; where a linker finds the CUDA driver
    library C(libcuda.so) (the driver's, or the toolkit's stub), if anywhere; the driver's CUDA version
    and the GPUs' compute capabilities from nvidia-smi; the CPU model and the instruction-set extensions
    C(-march=native) compiles for (from /proc/cpuinfo flags) with their short hash; free space under
    the given paths; the llama.cpp config files on the host (module_utils sandbox, rigctl/hostside/sandbox.py,
    the fact rigctl's probe reads too).
  - Never changes the host; supports check mode.
  - nvidia-smi's output is read by module_utils nvidia_smi (rigctl/hostside/nvidia_smi.py), the reader rigctl's
    probe uses too: both header generations (Driver/CUDA Version and R610's KMD/CUDA UMD Version).
options:
  paths:
    description: Directories whose file systems must hold the build (nearest existing parent).
    type: list
    elements: path
    default: []
  cuda_home:
    description: Where the CUDA toolkit is installed; its bin/ is searched for nvcc first.
    type: path
    default: /usr/local/cuda
  nvidia_smi:
    description: Ask nvidia-smi for the driver's CUDA version and the compute capabilities.
    type: bool
    default: true
"""

import hashlib
import os
import platform
import re
import shutil
import subprocess

from ansible.module_utils.cpuinfo import parse as parse_cpuinfo
from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.nvidia_smi import cell, summary_versions
from ansible.module_utils.sandbox import CONFIG_HOME, config_files_command, parse_config_files


def _run(argv: list[str], timeout: float = 20.0) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


def _version(argv: list[str], pattern: str) -> str | None:
    if shutil.which(argv[0]) is None and not os.path.isfile(argv[0]):
        return None
    rc, out = _run(argv)
    if rc != 0:
        return None
    match = re.search(pattern, out)
    return match.group(1) if match else out.strip().splitlines()[0] if out.strip() else None


def driver_library(cuda_home: str, machine: str) -> str | None:
    """Where CMake's FindCUDAToolkit would find ``libcuda.so`` for CUDA::cuda_driver: the toolkit's stubs
    and library directories, then the system's. None: a CUDA build cannot link the driver library here."""
    dirs = [os.path.join(cuda_home, sub) for sub in ("lib64/stubs", "lib/stubs", "lib64", "lib")]
    dirs += [f"/usr/lib/{machine}-linux-gnu", f"/lib/{machine}-linux-gnu", "/usr/lib64", "/usr/lib"]
    return next((os.path.join(d, "libcuda.so") for d in dirs if os.path.exists(os.path.join(d, "libcuda.so"))), None)


def _free_mib(path: str) -> int:
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize // (1024 * 1024)


#: x86 /proc/cpuinfo flags that name instruction-set extensions a compiler may use with -march=native
#: (ggml's own SSE/AVX/AVX-512/AMX/F16C/FMA/BMI2 among them). Everything else in `flags` (hypervisor,
#: constant_tsc, nopl...) says nothing about what a binary may execute and would only split the key.
X86_ISA_FLAGS = frozenset("""
    cmov cx8 cx16 mmx sse sse2 pni ssse3 sse4_1 sse4_2 sse4a popcnt abm lahf_lm 3dnowprefetch movbe
    bmi1 bmi2 adx tbm fma fma4 xop f16c avx avx2 avx_vnni avx_vnni_int8 avx_ne_convert avx_ifma
    avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni
    avx512_bitalg avx512_vpopcntdq avx512_bf16 avx512_fp16 avx512_vp2intersect
    amx_tile amx_int8 amx_bf16 amx_fp16 amx_complex
    aes vaes pclmulqdq vpclmulqdq sha_ni gfni rdrand rdseed rdpid fsgsbase clflushopt clwb clzero
    xsave xsaveopt xsavec xsaves movdiri movdir64b serialize waitpkg cldemote ptwrite pku mwaitx
    wbnoinvd enqcmd uintr hreset
""".split())


def cpu_info(text: str, machine: str) -> tuple[str, list[str]]:
    """(model, sorted instruction-set extensions) from /proc/cpuinfo text (module_utils cpuinfo reads it).
    x86: the `flags` of the first processor that are in X86_ISA_FLAGS; other machines (aarch64 `Features`):
    all of them."""
    info = parse_cpuinfo(text)
    found = set(info.flags)
    if machine in ("x86_64", "amd64", "i386", "i686"):
        found &= X86_ISA_FLAGS
    return info.model or "unknown", sorted(found)


def isa_hash(machine: str, isa: list[str]) -> str:
    """Short, stable name of a machine type and instruction set: what a native build's key holds."""
    return hashlib.sha256(f"{machine}:{' '.join(sorted(isa))}".encode()).hexdigest()[:12]


def _cpu() -> tuple[str, list[str]]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return cpu_info(f.read(), platform.machine())
    except OSError:
        return "unknown", []


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "paths": {"type": "list", "elements": "path", "default": []},
            "cuda_home": {"type": "path", "default": "/usr/local/cuda"},
            "nvidia_smi": {"type": "bool", "default": True},
        },
        supports_check_mode=True,
    )
    p = module.params
    cpu_model, isa = _cpu()
    nvcc = os.path.join(p["cuda_home"], "bin", "nvcc")
    if not os.access(nvcc, os.X_OK):
        nvcc = shutil.which("nvcc") or ""
    result = {
        "changed": False,
        "cmake_version": _version(["cmake", "--version"], r"cmake version (\S+)"),
        "cxx_version": _version(["c++", "--version"], r"^(.*)$"),
        "cc_present": shutil.which("cc") is not None,
        "make_present": shutil.which("make") is not None or shutil.which("ninja") is not None,
        "ccache_version": _version(["ccache", "--version"], r"ccache version (\S+)"),
        "git_version": _version(["git", "--version"], r"git version (\S+)"),
        "nvcc_path": nvcc or None,
        "nvcc_version": _version([nvcc, "--version"], r"release (\d+\.\d+)") if nvcc else None,
        "cuda_driver_library": driver_library(p["cuda_home"], platform.machine()),
        "driver_cuda_version": None,
        "driver_version": None,
        "compute_caps": [],
        "nvidia_smi": shutil.which("nvidia-smi"),
        "cpu_model": cpu_model,
        "machine": platform.machine(),
        "cpu_isa": isa,
        "cpu_isa_hash": isa_hash(platform.machine(), isa),
        "free_mib": {path: _free_mib(path) for path in p["paths"]},
        "config_files": parse_config_files(_run(config_files_command())[1]),
        "config_home": CONFIG_HOME,
    }
    if p["nvidia_smi"] and result["nvidia_smi"]:
        rc, out = _run(["nvidia-smi"])
        if rc == 0:
            # Either header generation: Driver/CUDA Version, or R610's KMD/CUDA UMD Version.
            versions = summary_versions(out)
            result["driver_cuda_version"], result["driver_version"] = versions.cuda, versions.driver
        rc, out = _run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
        if rc == 0:
            caps = (cell(line) for line in out.splitlines())
            result["compute_caps"] = [cap for cap in caps if cap is not None]
    module.exit_json(**result)


if __name__ == "__main__":
    main()
