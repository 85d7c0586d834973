#!/usr/bin/python3
# Part of rigctl's llama_cpp role.
"""Read-only probe of a build host: toolchain, CUDA, GPU, free disk. Changes nothing."""

from __future__ import annotations

DOCUMENTATION = r"""
module: llama_cpp_probe
short_description: Report what a llama.cpp build needs to know about the host
description:
  - Versions of cmake, the C++ compiler, ccache, git and nvcc; the driver's CUDA version and the
    GPUs' compute capabilities from nvidia-smi; the CPU model; free space under the given paths.
  - Never changes the host; supports check mode.
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

import os
import re
import shutil
import subprocess

from ansible.module_utils.basic import AnsibleModule


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


def _free_mib(path: str) -> int:
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize // (1024 * 1024)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


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
        "nvcc_version": _version([nvcc], r"release (\d+\.\d+)") if nvcc else None,
        "driver_cuda_version": None,
        "driver_version": None,
        "compute_caps": [],
        "nvidia_smi": shutil.which("nvidia-smi"),
        "cpu_model": _cpu_model(),
        "free_mib": {path: _free_mib(path) for path in p["paths"]},
    }
    if p["nvidia_smi"] and result["nvidia_smi"]:
        rc, out = _run(["nvidia-smi"])
        if rc == 0:
            cuda = re.search(r"CUDA Version:\s*([0-9.]+)", out)
            driver = re.search(r"Driver Version:\s*([0-9.]+)", out)
            result["driver_cuda_version"] = cuda.group(1) if cuda else None
            result["driver_version"] = driver.group(1) if driver else None
        rc, out = _run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
        if rc == 0:
            result["compute_caps"] = [line.strip() for line in out.splitlines() if line.strip()]
    module.exit_json(**result)


if __name__ == "__main__":
    main()
