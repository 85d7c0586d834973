"""The gpu_host role's CUDA toolkit from wheels: the controller's fetch of a pinned wheel (sdist_fetch's
fetch_wheel, against a package index on loopback) and the host's layout of the wheels as a toolkit tree
(library/gpu_host_cuda_wheels.py), with wheels made here in the shape NVIDIA's CUDA 13 wheels have."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import role_modules
from package_index import PackageIndex

from rigctl.hostside.sdist_fetch import SdistFetchError, fetch_wheel

REPO = Path(__file__).resolve().parents[2]

LIBRARY = REPO / "roles" / "gpu_host" / "library"
layout = role_modules.load(LIBRARY / "gpu_host_cuda_wheels.py", "gpu_host_cuda_wheels")

X86 = "py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64"
ARM = "py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64"


def wheel(name: str, version: str, members: dict[str, bytes | tuple[bytes, int]]) -> bytes:
    """A wheel of ``name`` ``version`` holding ``members`` (bytes, or (bytes, unix mode)) and its dist-info."""
    buffer = io.BytesIO()
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(buffer, "w") as archive:
        for member, content in {**members, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\n"
                                f"Version: {version}\n".encode()}.items():
            data, mode = content if isinstance(content, tuple) else (content, 0o100644)
            info = zipfile.ZipInfo(member)
            info.external_attr = mode << 16
            archive.writestr(info, data)
    return buffer.getvalue()


def toolkit_wheels() -> dict[str, tuple[str, bytes]]:
    """{name: (version, wheel bytes)}: a CUDA 13-shaped toolkit in six wheels, all under nvidia/cu13/."""
    exe = 0o100755
    return {
        "nvidia-cuda-nvcc": ("13.0.88", wheel("nvidia-cuda-nvcc", "13.0.88", {
            "nvidia/cu13/bin/nvcc": (b"#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n", exe),
            "nvidia/cu13/bin/cudafe++": (b"\x7fELF", exe), "nvidia/cu13/bin/fatbinary": (b"\x7fELF", exe),
            "nvidia/cu13/bin/ptxas": (b"\x7fELF", exe), "nvidia/cu13/bin/nvcc.profile": b"TOP = $(_HERE_)/..\n",
            "nvidia/cu13/include/fatbinary_section.h": b"/* fatbin */\n", "nvidia/__init__.py": b"",
            "nvidia/cu13/.metadata/provenance.txt": b"build info\n"})),
        "nvidia-nvvm": ("13.0.88", wheel("nvidia-nvvm", "13.0.88", {
            "nvidia/cu13/nvvm/bin/cicc": (b"\x7fELF", exe), "nvidia/cu13/lib/libnvvm.so.4": b"\x7fELF",
            "nvidia/__init__.py": b""})),
        "nvidia-cuda-crt": ("13.0.88", wheel("nvidia-cuda-crt", "13.0.88", {
            "nvidia/cu13/include/crt/host_config.h": b"/* crt */\n"})),
        "nvidia-cuda-runtime": ("13.0.96", wheel("nvidia-cuda-runtime", "13.0.96", {
            "nvidia/cu13/include/cuda_runtime.h": b"/* runtime */\n", "nvidia/cu13/lib/libcudart.so.13": b"\x7fELF"})),
        "nvidia-cublas": ("13.1.0.3", wheel("nvidia-cublas", "13.1.0.3", {
            "nvidia/cu13/include/cublas_v2.h": b"/* cublas */\n", "nvidia/cu13/lib/libcublas.so.13": b"\x7fELF",
            "nvidia/cu13/lib/libcublasLt.so.13": b"\x7fELF"})),
        "nvidia-cuda-cccl": ("13.0.85", wheel("nvidia-cuda-cccl", "13.0.85", {
            "nvidia/cu13/include/cccl/cub/cub.cuh": b"/* cub */\n"})),
    }


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def filename(name: str, version: str, tags: str = X86) -> str:
    return f"{name.replace('-', '_')}-{version}-{tags}.whl"


@pytest.fixture
def wheel_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "transfer"
    directory.mkdir()
    for name, (version, data) in toolkit_wheels().items():
        (directory / filename(name, version)).write_bytes(data)
    return directory


def pins(wheels: dict[str, tuple[str, bytes]] | None = None) -> list[dict[str, str]]:
    return [{"name": name, "version": version, "sha256": sha(data)}
            for name, (version, data) in (wheels or toolkit_wheels()).items()]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# -------------------------------------------------------------------------------------- the layout


def test_the_wheels_make_a_toolkit_tree_as_nvidia_lays_it_out(wheel_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "cuda-13.0-wheels-x"
    result = layout.lay_out(pins(), str(wheel_dir), str(root), "x86_64")
    assert result["target"] == "x86_64-linux"
    assert sorted(result["library_links"]) == ["libcublas.so", "libcublasLt.so", "libcudart.so", "libnvvm.so"]
    # targets/x86_64-linux/{include,lib}, which nvcc.profile reads, and the links FindCUDAToolkit searches.
    assert os.readlink(root / "include") == "targets/x86_64-linux/include"
    assert os.readlink(root / "lib64") == "targets/x86_64-linux/lib" == os.readlink(root / "lib")
    assert (root / "include" / "cccl" / "cub" / "cub.cuh").is_file()
    assert (root / "include" / "crt" / "host_config.h").is_file()
    assert os.readlink(root / "lib64" / "libcublas.so") == "libcublas.so.13"
    assert (root / "bin" / "nvcc").stat().st_mode & 0o777 == 0o755
    assert (root / "include" / "cuda_runtime.h").stat().st_mode & 0o777 == 0o644
    # The wheels' own metadata and Python package files are not part of a toolkit.
    assert not [p for p in tree(root) if "dist-info" in p or "__init__" in p or ".metadata" in p]
    record = json.loads((root / ".rigctl-toolkit.json").read_text())
    assert record["wheels"] == sorted(pins(), key=lambda p: p["name"])
    assert not (tmp_path / "cuda-13.0-wheels-x.partial").exists()


def test_the_module_lays_out_links_the_home_and_then_changes_nothing(wheel_dir: Path, tmp_path: Path) -> None:
    root, home = tmp_path / "cuda-13.0-wheels-x", tmp_path / "cuda"
    args = {"wheels": pins(), "wheel_dir": str(wheel_dir), "root": str(root), "link": str(home)}
    rc, out = role_modules.run(LIBRARY, "gpu_host_cuda_wheels", args, tmp_path)
    assert rc == 0 and '"changed": true' in out, out
    assert os.readlink(home) == str(root) and (home / "bin" / "nvcc").is_file()
    # In place: no wheel is read again (they may be gone from the host), nothing changes.
    for path in wheel_dir.iterdir():
        path.unlink()
    rc, out = role_modules.run(LIBRARY, "gpu_host_cuda_wheels", args, tmp_path)
    assert rc == 0 and '"changed": false' in out, out


def test_a_new_set_of_pins_is_laid_out_beside_and_the_home_switched(wheel_dir: Path, tmp_path: Path) -> None:
    home = tmp_path / "cuda"
    old, new = tmp_path / "cuda-old", tmp_path / "cuda-new"
    layout.lay_out(pins(), str(wheel_dir), str(old), "x86_64")
    assert layout.point(str(home), str(old))
    layout.lay_out(pins(), str(wheel_dir), str(new), "x86_64")
    assert layout.point(str(home), str(new)) and os.readlink(home) == str(new)
    assert not layout.point(str(home), str(new))
    assert (old / "bin" / "nvcc").is_file()  # kept: builds made with it may load its libraries


def test_a_toolkit_home_that_is_a_directory_is_not_taken_over(tmp_path: Path) -> None:
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    with pytest.raises(layout.LayoutError, match="is a directory or file rigctl did not make"):
        layout.point(str(home), str(tmp_path / "cuda-13.0-wheels-x"))
    assert (home / "bin").is_dir()


def test_a_wheel_that_is_not_the_pin_is_refused_before_anything_is_unpacked(wheel_dir: Path, tmp_path: Path) -> None:
    wheels = pins()
    wheels[-1] = {**wheels[-1], "sha256": "0" * 64}
    root = tmp_path / "cuda"
    with pytest.raises(layout.LayoutError, match=rf"no wheel of nvidia-cuda-cccl 13\.0\.85 with the pinned sha256 "
                                                 rf"{'0' * 64} in {wheel_dir} \(nvidia_cuda_cccl-13\.0\.85-.*\.whl "
                                                 r"has sha256 [0-9a-f]{64}\)"):
        layout.lay_out(wheels, str(wheel_dir), str(root), "x86_64")
    assert not root.exists() and not Path(f"{root}.partial").exists()


def test_a_wheel_whose_metadata_is_not_the_pinned_version_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "transfer"
    directory.mkdir()
    data = wheel("nvidia-cublas", "13.1.1.3", {"nvidia/cu13/lib/libcublas.so.13": b"x"})
    (directory / filename("nvidia-cublas", "13.1.0.3")).write_bytes(data)  # renamed to pass for the pin
    with pytest.raises(layout.LayoutError, match="is nvidia-cublas 13.1.1.3, not the pinned nvidia-cublas 13.1.0.3"):
        layout.lay_out([{"name": "nvidia-cublas", "version": "13.1.0.3", "sha256": sha(data)}], str(directory),
                       str(tmp_path / "cuda"), "x86_64")


@pytest.mark.parametrize(("member", "mode", "expected"), [
    ("nvidia/cu13/../../escape.h", 0o100644, "leaves the toolkit directory"),
    ("/etc/cron.d/evil", 0o100644, "leaves the toolkit directory"),
    ("nvidia/cu13/lib/libcudart.so", 0o120777, "is a link"),
])
def test_a_hostile_member_fails_and_leaves_nothing(tmp_path: Path, member: str, mode: int, expected: str) -> None:
    wheels = toolkit_wheels()
    version, _ = wheels["nvidia-cuda-runtime"]
    wheels["nvidia-cuda-runtime"] = (version, wheel("nvidia-cuda-runtime", version, {
        "nvidia/cu13/include/cuda_runtime.h": b"/* runtime */\n", member: (b"../../../etc/passwd", mode)}))
    directory = tmp_path / "transfer"
    directory.mkdir()
    for name, (v, data) in wheels.items():
        (directory / filename(name, v)).write_bytes(data)
    root = tmp_path / "cuda"
    with pytest.raises(layout.LayoutError, match=expected):
        layout.lay_out(pins(wheels), str(directory), str(root), "x86_64")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transfer"]


def test_two_wheels_that_disagree_about_a_file_fail(tmp_path: Path) -> None:
    wheels = toolkit_wheels()
    wheels["nvidia-cuda-crt"] = ("13.0.88", wheel("nvidia-cuda-crt", "13.0.88", {
        "nvidia/cu13/include/crt/host_config.h": b"/* crt */\n", "nvidia/cu13/include/cuda_runtime.h": b"other\n"}))
    directory = tmp_path / "transfer"
    directory.mkdir()
    for name, (v, data) in wheels.items():
        (directory / filename(name, v)).write_bytes(data)
    with pytest.raises(layout.LayoutError, match="cuda_runtime.h differs from the one another wheel gave"):
        layout.lay_out(pins(wheels), str(directory), str(tmp_path / "cuda"), "x86_64")


def test_wheels_without_a_compiler_are_no_toolkit(tmp_path: Path) -> None:
    """CUDA 12's nvcc wheel carries ptxas and libnvvm, not nvcc itself: no toolkit to build with."""
    wheels = toolkit_wheels()
    wheels["nvidia-cuda-nvcc"] = ("12.9.86", wheel("nvidia-cuda-nvcc", "12.9.86", {
        "nvidia/cuda_nvcc/bin/ptxas": (b"\x7fELF", 0o100755)}))
    directory = tmp_path / "transfer"
    directory.mkdir()
    for name, (v, data) in wheels.items():
        (directory / filename(name, v)).write_bytes(data)
    with pytest.raises(layout.LayoutError, match=r"no complete toolkit: no bin/nvcc, bin/cudafe\+\+, bin/fatbinary"):
        layout.lay_out(pins(wheels), str(directory), str(tmp_path / "cuda"), "x86_64")
    assert not (tmp_path / "cuda").exists()


def test_a_malformed_pin_is_one_line(tmp_path: Path) -> None:
    rc, out = role_modules.run(LIBRARY, "gpu_host_cuda_wheels", {
        "wheels": [{"name": "nvidia-cublas", "version": "13.1.0.3", "sha256": "{{ lookup('pipe', 'id') }}"}],
        "wheel_dir": str(tmp_path), "root": str(tmp_path / "cuda-x"), "link": str(tmp_path / "cuda")}, tmp_path)
    assert rc != 0 and "needs name, version and a sha256 of 64 hex digits" in out, out
    assert not (tmp_path / "cuda").exists()


# --------------------------------------------------------------------------------------- the fetch


@pytest.fixture
def cublas_index() -> Iterator[tuple[PackageIndex, bytes]]:
    x86 = wheel("nvidia-cublas", "13.1.0.3", {"nvidia/cu13/lib/libcublas.so.13": b"x86"})
    arm = wheel("nvidia-cublas", "13.1.0.3", {"nvidia/cu13/lib/libcublas.so.13": b"arm"})
    newer = wheel("nvidia-cublas", "13.1.1.3", {"nvidia/cu13/lib/libcublas.so.13": b"new"})
    files = {filename("nvidia-cublas", "13.1.0.3", ARM): arm, filename("nvidia-cublas", "13.1.0.3"): x86,
             filename("nvidia-cublas", "13.1.1.3"): newer}
    with PackageIndex("nvidia-cublas", files) as served:
        yield served, x86


@pytest.mark.parametrize("json_api", [True, False], ids=["pep691-json", "pep503-html"])
def test_the_pinned_wheel_is_the_file_whose_sha256_is_the_pin(cublas_index: tuple[PackageIndex, bytes],
                                                              tmp_path: Path, json_api: bool) -> None:
    index, x86 = cublas_index
    index.json = json_api
    got = fetch_wheel("nvidia-cublas==13.1.0.3", tmp_path / "wheels", sha(x86), machine="aarch64",
                      index_urls=[index.url])
    assert got == tmp_path / "wheels" / filename("nvidia-cublas", "13.1.0.3") and got.read_bytes() == x86
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == [got.name]
    # A second fetch finds it in the directory and asks no index.
    asked = len(index.requests)
    assert fetch_wheel("nvidia-cublas==13.1.0.3", tmp_path / "wheels", sha(x86), machine="x86_64",
                       index_urls=[]) == got
    assert len(index.requests) == asked


def test_an_index_without_hashes_gives_the_machines_wheel_checked_against_the_pin(
        cublas_index: tuple[PackageIndex, bytes], tmp_path: Path) -> None:
    index, x86 = cublas_index
    index.hashes = False
    got = fetch_wheel("nvidia-cublas==13.1.0.3", tmp_path, sha(x86), machine="x86_64", index_urls=[index.url])
    assert got.read_bytes() == x86
    with pytest.raises(SdistFetchError, match=r"sha256 [0-9a-f]{64} but the pin is"):
        fetch_wheel("nvidia-cublas==13.1.0.3", tmp_path / "arm", sha(x86), machine="aarch64", index_urls=[index.url])
    assert not (tmp_path / "arm").exists() or list((tmp_path / "arm").iterdir()) == []


def test_a_pin_no_file_of_the_version_has_is_one_line_and_fetches_nothing(
        cublas_index: tuple[PackageIndex, bytes], tmp_path: Path) -> None:
    index, _ = cublas_index
    with pytest.raises(SdistFetchError, match=r"wheel nvidia-cublas==13\.1\.0\.3: no file on the index has the pinned "
                                              rf"sha256 {'1' * 64} \(it lists nvidia_cublas-13\.1\.0\.3-"):
        fetch_wheel("nvidia-cublas==13.1.0.3", tmp_path, "1" * 64, machine="x86_64", index_urls=[index.url])
    assert list(tmp_path.iterdir()) == [] and not any(r.startswith("/files/") for r in index.requests)


def test_a_tampered_mirror_leaves_nothing(cublas_index: tuple[PackageIndex, bytes], tmp_path: Path) -> None:
    index, x86 = cublas_index
    index.served[filename("nvidia-cublas", "13.1.0.3")] = x86 + b"tampered"
    with pytest.raises(SdistFetchError, match="but the pin is"):
        fetch_wheel("nvidia-cublas==13.1.0.3", tmp_path, sha(x86), machine="x86_64", index_urls=[index.url])
    assert list(tmp_path.iterdir()) == []


def test_a_cached_file_that_is_not_the_pin_is_not_taken(cublas_index: tuple[PackageIndex, bytes],
                                                       tmp_path: Path) -> None:
    index, x86 = cublas_index
    stale = tmp_path / filename("nvidia-cublas", "13.1.0.3")
    stale.write_bytes(b"something else")
    got = fetch_wheel("nvidia-cublas==13.1.0.3", tmp_path, sha(x86), machine="x86_64", index_urls=[index.url])
    # Fetched from the index and renamed over the stale file: the directory holds the pinned bytes only.
    assert got == stale and stale.read_bytes() == x86 and stat.S_IMODE(stale.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == [stale.name]


# ----------------------------------------------------------------------------------------------- the module


def _module_env(index: PackageIndex) -> dict[str, str]:
    """pip's configuration as the controller's would be: the test's index, nothing of this machine's."""
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index.url}


def test_the_wheel_module_fetches_the_pin_and_refuses_another_in_one_line(
        cublas_index: tuple[PackageIndex, bytes], tmp_path: Path) -> None:
    """gpu_host_wheel through sdist_fetch's module face (its shared options, the failure line), run by Ansible."""
    index, x86 = cublas_index
    args = {"requirement": "nvidia-cublas==13.1.0.3", "sha256": sha(x86), "dest_dir": str(tmp_path / "wheels"),
            "machine": "x86_64", "host": "rig"}
    rc, out = role_modules.run(LIBRARY, "gpu_host_wheel", args, tmp_path, _module_env(index))
    got = tmp_path / "wheels" / filename("nvidia-cublas", "13.1.0.3")
    assert rc == 0 and f'"path": "{got}"' in out and got.read_bytes() == x86, out
    rc, out = role_modules.run(LIBRARY, "gpu_host_wheel", {**args, "sha256": "1" * 64,
                                                          "dest_dir": str(tmp_path / "other")}, tmp_path,
                               _module_env(index))
    assert rc != 0 and "rig: gpu_host_cuda_wheels: wheel nvidia-cublas==13.1.0.3: no file on the index has the " \
        f"pinned sha256 {'1' * 64}" in out, out
    assert not (tmp_path / "other").exists() or list((tmp_path / "other").iterdir()) == []
    rc, out = role_modules.run(LIBRARY, "gpu_host_wheel", {**args, "timeout": "soon"}, tmp_path, _module_env(index))
    assert rc != 0 and "timeout" in out, out
