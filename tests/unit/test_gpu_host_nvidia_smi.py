"""The gpu_host role's reading of nvidia-smi (roles/gpu_host/library/gpu_host_nvidia_smi.py), held to recorded
real outputs (tests/fixtures/real/nvidia-smi-query, nvidia-smi-summary): run as Ansible runs it, against a
stand-in ``nvidia-smi`` that prints what a real driver printed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import role_modules

LIBRARY = Path(__file__).resolve().parents[2] / "roles" / "gpu_host" / "library"
REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
smi = role_modules.load(LIBRARY / "gpu_host_nvidia_smi.py", "gpu_host_nvidia_smi")


def _recorded(kind: str, name: str) -> str:
    """A capture without its ``# source:`` line."""
    return (REAL / kind / f"{name}.txt").read_text().partition("\n")[2]


def _query_answer(name: str) -> str:
    """What the role's ``--query-gpu=<FIELDS> --format=csv,noheader,nounits`` gets from the GPU of a recorded
    ``--format=csv`` capture that asked more fields: the role's columns, picked by their header, in the role's
    order, without the unit ``nounits`` drops (``8192 MiB`` -> ``8192``)."""
    header, *rows = _recorded("nvidia-smi-query", name).splitlines()
    columns = [c.strip().partition(" [")[0] for c in header.split(",")]
    lines = []
    for row in rows:
        cells = [c.strip() for c in row.split(",")]
        lines.append(", ".join(cells[columns.index(f)].removesuffix(" MiB") for f in smi.FIELDS))
    return "\n".join(lines) + "\n"


def _run(tmp_path: Path, query: str, summary: str, *, query_rc: int = 0) -> dict:
    """The module run by Ansible on localhost in check mode (it must read there too), with a stand-in
    nvidia-smi first on PATH that prints ``query`` for ``--query-gpu`` and ``summary`` otherwise."""
    (tmp_path / "query.txt").write_text(query)
    (tmp_path / "summary.txt").write_text(summary)
    stand_in = tmp_path / "bin" / "nvidia-smi"
    stand_in.parent.mkdir()
    stand_in.write_text(f'#!/bin/sh\ncase "$1" in --query-gpu=*) cat {tmp_path}/query.txt; exit {query_rc};; esac\n'
                        f"cat {tmp_path}/summary.txt\n")
    stand_in.chmod(0o755)
    rc, out = role_modules.run(LIBRARY, "gpu_host_nvidia_smi", {"timeout": 30}, tmp_path, check=True,
                               env={"PATH": f"{stand_in.parent}:{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert rc == 0, out
    result, _end = json.JSONDecoder().raw_decode(out.partition(" => ")[2])  # warnings follow on stderr
    return result


NORMAL = "exporter__linux-x86_64__nvidia-l40s__595.80__idle"
R610 = "exporter__linux-x86_64__nvidia-geforce-rtx-2080-super__610.57.04__idle"


@pytest.mark.parametrize(("capture", "expected"), [
    (NORMAL, {"name": "NVIDIA L40S", "driver_version": "595.80", "compute_capability": "8.9", "vram_mib": 46068,
              "persistence_mode": "Disabled", "cuda_version": "13.2"}),
    # R610's header: `KMD Version: 610.57.04  CUDA UMD Version: 13.3`.
    (R610, {"name": "NVIDIA GeForce RTX 2080 SUPER", "driver_version": "610.57.04", "compute_capability": "7.5",
            "vram_mib": 8192, "persistence_mode": "Disabled", "cuda_version": "13.3"}),
    # A Windows driver reports persistence mode as [N/A]: not reported, not a value.
    ("exporter__windows-x86_64__nvidia-geforce-rtx-2080-super__610.62__idle",
     {"name": "NVIDIA GeForce RTX 2080 SUPER", "driver_version": "610.62", "compute_capability": "7.5",
      "vram_mib": 8192, "persistence_mode": None, "cuda_version": "13.3"}),
])
def test_the_role_reads_a_real_driver(tmp_path: Path, capture: str, expected: dict) -> None:
    result = _run(tmp_path, _query_answer(capture), _recorded("nvidia-smi-summary", capture))
    assert result["answered"] is True and result["changed"] is False
    assert result["gpu"] == expected
    assert result["gpus"] == [{k: v for k, v in expected.items() if k != "cuda_version"}]


def test_a_unified_memory_gpu_reports_no_vram_and_is_not_refused(tmp_path: Path) -> None:
    # GB10 (DGX Spark): its memory.total cell is [N/A] by design (the recorded nvitop-208 capture, which asked
    # only memory fields). The other cells of the row are the GB10 of the recorded ArcticTraining summary
    # (name, driver 580.126.09, persistence On) and GB10's compute capability 12.1; its header says CUDA 13.0.
    memory = _recorded("nvidia-smi-query", "nvitop-208__gb10-unified-memory__580.173.02").splitlines()[1]
    total = memory.split(",")[0].strip()
    assert total == "[N/A]"
    summary = _recorded("nvidia-smi-summary", "arctictraining-345__gb10-unified-memory__580.126.09")
    result = _run(tmp_path, f"NVIDIA GB10, 580.126.09, 12.1, {total}, Enabled\n", summary)
    assert result["answered"] is True
    assert result["gpu"] == {"name": "NVIDIA GB10", "driver_version": "580.126.09", "compute_capability": "12.1",
                             "vram_mib": None, "persistence_mode": "Enabled", "cuda_version": "13.0"}


def test_every_gpu_of_a_mixed_host_is_read() -> None:
    # Two GPUs of different models (recorded triton-8070 capture). It asked compute_cap, driver_version and
    # name only: the role's memory.total and persistence_mode columns are left unreported ([N/A]) here.
    header, *rows = _recorded("nvidia-smi-query", "triton-8070__titan-v-and-rtx-5880-ada__570.86.15").splitlines()
    assert header == "compute_cap, compute_mode, driver_version, name, index"
    query = "".join(f"{name}, {driver}, {cap}, [N/A], [N/A]\n"
                    for cap, _mode, driver, name, _index in (r.split(", ") for r in rows))
    gpus, cuda = smi.read(query, "")
    assert all(g["vram_mib"] is None and g["persistence_mode"] is None for g in gpus)
    assert [(g["name"], g["driver_version"], g["compute_capability"]) for g in gpus] == [
        ("NVIDIA TITAN V", "570.86.15", "7.0"), ("NVIDIA RTX 5880 Ada Generation", "570.86.15", "8.9")]
    assert cuda is None  # no summary, no CUDA version: null, the role judges


def test_a_driver_that_does_not_answer_is_named_not_raised(tmp_path: Path) -> None:
    # What nvidia-smi prints when the kernel module is not loaded, as pasted verbatim in many bug reports
    # (exit status 9, NVML_ERROR_DRIVER_NOT_LOADED).
    said = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.\n")
    result = _run(tmp_path, said, "", query_rc=9)
    assert result["answered"] is False
    assert result["said"] == said.strip()
    assert result["gpus"] == [] and result["gpu"]["driver_version"] is None


def test_a_line_that_is_not_one_gpu_is_named() -> None:
    with pytest.raises(ValueError, match=r"nvidia-smi line 1: 2 fields, expected 5"):
        smi.read("NVIDIA GB10, 12.1\n", "")
