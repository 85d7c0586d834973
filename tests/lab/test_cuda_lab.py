"""The pinned llama.cpp built WITH CUDA on a lab rig, then refused there for lack of a GPU (issue 30).

The lab rigs have no GPU and no driver; NVIDIA's CUDA wheels are enough to compile. On the desktop rig:

1. roles/gpu_host installs the toolkit from the wheels the lab inventory pins (``gpu_host_cuda_source:
   wheels``): the controller fetches them into its cache, the rig gets them from there and lays them out;
2. roles/llama_cpp builds the pin with ``llama_cpp_cuda`` for the fleet's architectures (75;86, the union
   of the rigs' compute capabilities, ``llama_cpp_cuda_fleet_build``), without a driver library to link
   (``GGML_CUDA_NO_VMM``), and publishes it in the controller's cache like any build;
3. the smoke test runs it with every layer offloaded, llama.cpp's CUDA backend finds no device, and the
   build is refused in one line; the CPU build stays current and the servers keep answering.

The compile is the expensive part (see docs/builds.md's figures): this module runs it only under
``make cuda-check`` (RIGCTL_CUDA_CHECK=1). Otherwise it runs only when the controller's cache has the
wheels and the CUDA build already (a machine that ran ``make cuda-check``), and then compiles nothing; on
any other machine it skips, saying why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from labrigs_support import check_mode_play, wait_healthy
from test_llama_cpp_lab import ccache_counters, compilations, current_target, ssh
from test_refusals_lab import build_status, serves

from rigctl.fleet.build import read_builds
from rigctl.fleet.deploy import DeployResult, run_playbook
from rigctl.hostside.sdist_fetch import canonical_name
from rigctl.inventory import Inventory
from rigctl.lab.rigs import Lab
from rigctl.ssh import SshClient, SshTarget

REPO = Path(__file__).resolve().parents[2]
CONTROLLER_CACHE = Path(os.environ.get("RIGCTL_CACHE_DIR") or "~/.cache/rigctl").expanduser()
OPTED_IN = os.environ.get("RIGCTL_CUDA_CHECK") == "1"
#: A cold CUDA compile of the pin for two architectures on two shared cores takes hours.
CUDA_BUILD_TIMEOUT = 5 * 3600
#: CUDA on for the play; the desktop builds for every rig's architecture.
CUDA_VARS: dict[str, Any] = {"gpu_host_cuda": True, "llama_cpp_cuda": True, "llama_cpp_cuda_fleet_build": True}
#: The stand-in nvidia-smi reports a driver of CUDA 13.0's branch (the toolkit's preflight wants the driver
#: to support the toolkit). No driver library exists on the rig all the same: llama.cpp finds no device.
DRIVER = {"driver_version": "580.95.05", "cuda_version": "13.0"}
TOOLKIT_HOME = "/usr/local/cuda"
INSTALL_ROOT = "/opt/llama.cpp"

pytestmark = [pytest.mark.lab, pytest.mark.timeout(CUDA_BUILD_TIMEOUT)]


@dataclass
class CudaRun:
    """The CUDA provision of the desktop: its result, how long it took, and what it compiled."""

    result: DeployResult
    seconds: float
    compilations: int
    messages: list[str]
    #: Wall seconds of the role's compile task (None: nothing was compiled).
    compile_seconds: float | None


def wheel_pins(inv: Inventory) -> list[dict[str, str]]:
    return list(inv.host("desktop").vars["gpu_host_cuda_wheels"])


def cached_wheels_missing(inv: Inventory) -> list[str]:
    """The pinned wheels the controller's cache does not hold (name==version), by name and version only:
    the role checks every sha256 when it uses them."""
    have = {p.name for p in (CONTROLLER_CACHE / "wheels").glob("*.whl")}
    return [f"{w['name']}=={w['version']}" for w in wheel_pins(inv)
            if not any(n.startswith(f"{canonical_name(w['name']).replace('-', '_')}-{w['version']}-") for n in have)]


def cached_cuda_builds() -> list[str]:
    """The CUDA builds of the pin in the controller's cache, by their manifests: a cheap first look, before the
    toolkit goes onto a rig for the role to say which build its key names."""
    found = []
    for artifact in sorted((CONTROLLER_CACHE / "builds").glob("b11434-*.tar.gz")):
        proc = subprocess.run(["tar", "-xzOf", str(artifact), "./build.json"], capture_output=True, text=True,
                              timeout=300, check=False)
        try:
            manifest = json.loads(proc.stdout)
        except ValueError:
            continue
        if isinstance(manifest, dict) and manifest.get("cuda") is True:
            found.append(str(manifest.get("name")))
    return found


def planned(inv: Inventory) -> str:
    """The llama_cpp role's plan line for the desktop's CUDA build (check mode: nothing changes)."""
    stdout = check_mode_play(inv, CUDA_VARS)
    match = re.search(r"desktop: would (build|copy from the controller cache) llama\.cpp (b11434-[0-9a-f]{12}) "
                      r"\([^)]*CUDA ([0-9;]+),", stdout)
    assert match, stdout[-3000:]
    return match.group(0)


def provision_cuda(inv: Inventory, tags: tuple[str, ...]) -> CudaRun:
    desktop = inv.host("desktop")
    before = compilations(ccache_counters(desktop))
    messages: list[str] = []
    tasks: list[tuple[float, str]] = []
    started = time.monotonic()
    result = run_playbook(inv, "site.yml", limit="desktop", tags=tags, extravars=CUDA_VARS,
                          timeout=CUDA_BUILD_TIMEOUT, on_event=lambda event: messages.append(event.message or ""),
                          on_task=lambda name: tasks.append((time.monotonic(), name)))
    seconds = time.monotonic() - started
    compile_seconds = next((tasks[i + 1][0] - at for i, (at, name) in enumerate(tasks[:-1])
                            if name.endswith("Compile the fleet's binaries")), None)
    return CudaRun(result, seconds, compilations(ccache_counters(desktop)) - before, messages, compile_seconds)


@pytest.fixture(scope="module")
def cuda_lab(lab_served: Inventory) -> Iterator[Inventory]:
    """The served lab, its desktop's stand-in reporting a CUDA 13 driver, its toolkit installed from the wheels;
    skipped (with the reason) where this machine would have to fetch the wheels or compile the CUDA build
    and `make cuda-check` did not ask for it."""
    inv = lab_served
    if not OPTED_IN:
        if not cached_cuda_builds():
            pytest.skip("no CUDA build of the pin in the controller's cache: `make cuda-check` compiles it "
                        "(hours on two cores; docs/builds.md has the figures)")
        missing = cached_wheels_missing(inv)
        if missing:
            pytest.skip(f"the CUDA wheels are not in the controller's cache ({', '.join(missing)}); "
                        "`make cuda-check` fetches them")
    lab = Lab.from_inventory(inv)
    original = lab.gpu_state("desktop")
    lab.set_gpu("desktop", **DRIVER)
    try:
        toolkit = run_playbook(inv, "site.yml", limit="desktop", tags=("gpu_host",), extravars=CUDA_VARS,
                               timeout=1800)
        assert toolkit.succeeded, toolkit.failures()
        plan = planned(inv)
        if "would build" in plan and not OPTED_IN:
            pytest.skip(f"the CUDA build is not in the controller's cache ({plan}); `make cuda-check` compiles it")
        yield inv
    finally:
        # The desktop as the other modules know it: no toolkit (a bad-input test wants none), no CUDA artifact,
        # the stand-in's driver, the gpu_host fact rewritten without CUDA.
        desktop = inv.host("desktop")
        keep = {ssh(desktop, f"readlink {INSTALL_ROOT}/{link} || true").strip() for link in ("current", "previous")}
        ssh(desktop, f"rm -rf {TOOLKIT_HOME} {TOOLKIT_HOME}-*-wheels-* /var/cache/rigctl-cuda-wheels", timeout=300)
        for artifact in ssh(desktop, "ls /var/cache/llama.cpp/artifacts").split():
            if artifact.removesuffix(".tar.gz") not in keep:
                ssh(desktop, f"rm -f /var/cache/llama.cpp/artifacts/{artifact}")
        lab.set_gpu("desktop", driver_version=original.driver_version, cuda_version=original.cuda_version)
        restored = run_playbook(inv, "site.yml", limit="desktop", tags=("gpu_host",), timeout=600)
        assert restored.succeeded, restored.failures()


@pytest.fixture(scope="module")
def refused(cuda_lab: Inventory) -> Iterator[tuple[Inventory, CudaRun, str]]:
    """The desktop's CUDA build (compiled, or taken from the controller's cache), refused by its smoke test."""
    desktop = cuda_lab.host("desktop")
    before = current_target(desktop)
    run = provision_cuda(cuda_lab, ("gpu_host", "llama_cpp"))
    print(f"\nCUDA provision of desktop: {run.seconds:.0f} s, compile {run.compile_seconds or 0:.0f} s, "
          f"{run.compilations} compilations through ccache ({os.cpu_count()} cores)")
    yield cuda_lab, run, before


def test_the_toolkit_is_laid_out_from_the_pinned_wheels(cuda_lab: Inventory) -> None:
    desktop = cuda_lab.host("desktop")
    fact = ssh(desktop, "cat /etc/ansible/facts.d/gpu_host.fact")
    assert "source = wheels" in fact and "nvcc_version = 13.0" in fact, fact
    wheels = " ".join(f"{w['name']}=={w['version']}" for w in wheel_pins(cuda_lab))
    assert f"wheels = {wheels}" in fact, fact
    root = ssh(desktop, f"readlink {TOOLKIT_HOME}").strip()
    assert re.fullmatch(r"/usr/local/cuda-13\.0-wheels-[0-9a-f]{12}", root), root
    assert "release 13.0, V13.0.88" in ssh(desktop, f"{TOOLKIT_HOME}/bin/nvcc --version")
    # The layout NVIDIA's installers make, which nvcc.profile and FindCUDAToolkit read.
    listing = ssh(desktop, f"cd {root} && readlink include lib64 && ls lib64/ && ls include/cublas_v2.h "
                           "include/cccl/cub/cub.cuh nvvm/bin/cicc bin/fatbinary")
    assert "targets/x86_64-linux/include\ntargets/x86_64-linux/lib\n" in listing
    for name in ("libcudart.so", "libcublas.so", "libcublasLt.so"):
        assert f"\n{name}\n" in listing, listing
    # What the layout records: the pins, checked again on every run.
    record = json.loads(ssh(desktop, f"cat {root}/.rigctl-toolkit.json"))
    assert sorted((w["name"], w["version"], w["sha256"]) for w in record["wheels"]) == \
        sorted((w["name"], w["version"], w["sha256"]) for w in wheel_pins(cuda_lab))
    # The copies of the wheels are gone from the rig; the controller's cache keeps them.
    assert ssh(desktop, "ls -A /var/cache/rigctl-cuda-wheels 2>/dev/null || true").strip() == ""
    assert cached_wheels_missing(cuda_lab) == []


def test_a_second_toolkit_run_changes_nothing(cuda_lab: Inventory) -> None:
    again = run_playbook(cuda_lab, "site.yml", limit="desktop", tags=("gpu_host",), extravars=CUDA_VARS, timeout=600)
    assert again.succeeded and again.hosts["desktop"].changed == 0, again.hosts["desktop"]


def test_the_cuda_build_is_refused_in_one_line_and_the_cpu_build_stays(refused: tuple[Inventory, CudaRun, str]) -> None:
    inv, run, before = refused
    desktop = inv.host("desktop")
    outcome = run.result.hosts["desktop"]
    assert not run.result.succeeded and outcome.failed, outcome
    failure = outcome.failure or ""
    assert "\n" not in failure
    match = re.fullmatch(r"desktop: llama\.cpp (b11434-[0-9a-f]{12}) refused, current stays: llama-bench on a tiny "
                         r"model \(CUDA, -ngl 99\): no CUDA device: the CUDA backend found none "
                         r"\(ggml_cuda_init: failed to initialize CUDA: .+\) \(log: .+\.log\)", failure)
    assert match, failure
    # current is the CPU build still, and build status says so.
    assert current_target(desktop) == before
    builds = read_builds(desktop)
    assert builds.current is not None and builds.current.name == before and not builds.current.cuda
    status = build_status(inv)
    assert before in status and match.group(1) not in status, status
    row = next(line for line in status.splitlines() if "desktop" in line)
    assert " off " in row, row
    # Nothing of the refused build is left to run by mistake.
    assert match.group(1) not in ssh(desktop, f"ls -A {INSTALL_ROOT}")
    # The servers answer, on the CPU build.
    wait_healthy(inv, timeout=120)
    assert serves(desktop)


def test_the_cuda_build_is_cached_for_75_and_86_with_the_cuda_backend_and_cublas(
        refused: tuple[Inventory, CudaRun, str]) -> None:
    inv, run, _ = refused
    desktop = inv.host("desktop")
    name = re.search(r"llama\.cpp (b11434-[0-9a-f]{12}) refused", run.result.hosts["desktop"].failure or "").group(1)
    artifact = CONTROLLER_CACHE / "builds" / f"{name}.tar.gz"
    assert artifact.is_file(), f"{artifact}: the CUDA build is not in the controller's cache"
    manifest = json.loads(subprocess.run(["tar", "-xzOf", str(artifact), "./build.json"], check=True,
                                         capture_output=True, text=True).stdout)
    assert manifest["cuda"] is True and manifest["cuda_architectures"] == "75;86"
    assert manifest["cuda_version"] == "13.0"
    assert manifest["cmake"]["GGML_CUDA"] == "ON" and manifest["cmake"]["CMAKE_CUDA_ARCHITECTURES"] == "75;86"
    # No libcuda.so at link time on a rig without a driver: the documented option, in the key's inputs.
    assert manifest["cmake"]["GGML_CUDA_NO_VMM"] == "ON"
    assert "GGML_CUDA_FA_ALL_QUANTS" not in manifest["cmake"]
    assert sorted(manifest["binaries"]) == sorted(manifest["targets"])
    # The binaries, unpacked on the rig (where the toolkit's libraries are): linked to CUDA's runtime and
    # cuBLAS from the wheels' toolkit, and with the CUDA backend in them.
    unpacked = "/var/tmp/rigctl-cuda-build"
    ssh(desktop, f"rm -rf {unpacked} && mkdir -p {unpacked}")
    with SshClient(SshTarget.from_host(desktop)) as client:
        client.put(artifact, f"{unpacked}.tar.gz", timeout=600)
    try:
        ssh(desktop, f"tar -xzf {unpacked}.tar.gz -C {unpacked}")
        ldd = ssh(desktop, f"ldd {unpacked}/bin/llama-server")
        root = ssh(desktop, f"readlink {TOOLKIT_HOME}").strip()
        for library in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"):
            assert re.search(rf"{re.escape(library)} => \S*(/usr/local/cuda|{re.escape(root)})/", ldd), ldd
        assert "not found" not in ldd and "libcuda.so" not in ldd, ldd
        version = ssh(desktop, f"{unpacked}/bin/llama-server --version 2>&1")
        assert "build 11434, commit b11434)" in version, version
        devices = ssh(desktop, f"{unpacked}/bin/llama-server --list-devices 2>&1 || true")
        assert "ggml_cuda_init: failed to initialize CUDA" in devices, devices
    finally:
        ssh(desktop, f"rm -rf {unpacked} {unpacked}.tar.gz")


def test_a_rerun_takes_the_cached_build_compiles_nothing_and_refuses_again(
        refused: tuple[Inventory, CudaRun, str]) -> None:
    inv, first, before = refused
    rerun = provision_cuda(inv, ("gpu_host", "llama_cpp"))
    print(f"\nCUDA provision rerun of desktop: {rerun.seconds:.0f} s, {rerun.compilations} compilations")
    assert rerun.compilations == 0 and rerun.compile_seconds is None
    assert any("copy from the controller cache llama.cpp" in m for m in rerun.messages), rerun.messages
    assert rerun.result.hosts["desktop"].failure == first.result.hosts["desktop"].failure
    assert current_target(inv.host("desktop")) == before


def test_a_rebuild_with_a_new_stamp_is_ccache_warm(refused: tuple[Inventory, CudaRun, str]) -> None:
    """A new build key whose flags are the same (a new stamp): every CUDA object comes from the compiler cache
    under the cache dir; only what the stamp touches is compiled. Opt-in only: on a machine whose lab slot
    has a cold compiler cache this is a whole CUDA compile again."""
    if not OPTED_IN:
        pytest.skip("a CUDA rebuild compiles (ccache-warm where this lab slot compiled it before): `make cuda-check`")
    inv, first, before = refused
    desktop = inv.host("desktop")
    misses_before = ccache_counters(desktop).get("cache_miss", 0)
    started = time.monotonic()
    tasks: list[tuple[float, str]] = []
    result = run_playbook(inv, "site.yml", limit="desktop", tags=("llama_cpp",),
                          extravars={**CUDA_VARS, "llama_cpp_build_commit": "cudawarm"}, timeout=CUDA_BUILD_TIMEOUT,
                          on_task=lambda name: tasks.append((time.monotonic(), name)))
    compile_seconds = next(tasks[i + 1][0] - at for i, (at, name) in enumerate(tasks[:-1])
                           if name.endswith("Compile the fleet's binaries"))
    misses = ccache_counters(desktop).get("cache_miss", 0) - misses_before
    print(f"\nCUDA rebuild with a new stamp: {time.monotonic() - started:.0f} s, compile {compile_seconds:.0f} s, "
          f"{misses} ccache misses (the cold compile: {first.compile_seconds or 0:.0f} s)")
    failure = result.hosts["desktop"].failure or ""
    assert "refused, current stays" in failure and "no CUDA device" in failure, failure
    assert misses <= 5, misses
    assert current_target(desktop) == before
    stamped = re.search(r"llama\.cpp (b11434-[0-9a-f]{12}) refused", failure).group(1)
    (CONTROLLER_CACHE / "builds" / f"{stamped}.tar.gz").unlink(missing_ok=True)  # this test's alone
