"""perf/gpu_check.py's parts that need no GPU: its options, its refusal on a machine without a working card
(run as the command it is, nothing built), the random model's tensor plan and the GGUF it becomes (read back by
rigctl's own GGUF reader), the archive pin and the CMake entries it takes from the llama_cpp role. The steps on a
build (smoke, bench cell, server decode) are checked against a real CPU build by hand (docs/benchmarks.md,
`make gpu-check`)."""

from __future__ import annotations

import importlib.util
import math
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from rigctl.errors import ConfigError
from rigctl.hostside import gguf as gguf_reader

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "perf" / "gpu_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


gpu_check = _load()
VOCAB = gpu_check.load_smoke_module()._vocab()


def _refusal(tmp_path: Path, path_dirs: list[Path], *args: str) -> subprocess.CompletedProcess[str]:
    """The script run as `make gpu-check` runs it, with PATH limited to ``path_dirs`` and the system's."""
    env = {**os.environ, "PATH": os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"])}
    return subprocess.run([sys.executable, str(SCRIPT), "--work", str(tmp_path / "work"), *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def _built_anything(work: Path) -> list[str]:
    return sorted(p.name for p in work.iterdir()) if work.exists() else []


@pytest.mark.skipif(any((Path(d) / "nvidia-smi").exists() for d in ("/usr/bin", "/bin")),
                    reason="this machine has nvidia-smi")
def test_without_a_gpu_it_refuses_in_one_line_before_building(tmp_path: Path) -> None:
    done = _refusal(tmp_path, [])
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "error: gpu-check needs an NVIDIA GPU and its driver: there is no nvidia-smi on PATH (nothing was built)"]
    assert _built_anything(tmp_path / "work") == []


#: nvidia-smi on a machine whose driver is not loaded, as a user pasted it
#: (https://github.com/lyulyul/shine-cluster/issues/50); nvidia-smi(1) gives exit status 9 for it.
DRIVER_NOT_LOADED = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that "
                     "the latest NVIDIA driver is installed and running.\n")


@pytest.mark.skipif(any((Path(d) / "nvidia-smi").exists() for d in ("/usr/bin", "/bin")),
                    reason="this machine has nvidia-smi")
def test_a_driver_that_is_not_loaded_is_refused_by_the_probe_before_building(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "answer.txt").write_text(DRIVER_NOT_LOADED)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat '{bin_dir / 'answer.txt'}'\nexit 9\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    done = _refusal(tmp_path, [bin_dir])
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: localhost: probe: gpus: nvidia-smi failed: NVIDIA-SMI has failed because")
    # the probe ran in the work dir's file system (df), and nothing else was made there
    assert _built_anything(tmp_path / "work") == []


@pytest.mark.parametrize(("args", "names"), [
    (["--model-mib", "5"], "--model-mib: 5 is outside 32..8192"),
    (["--model-mib", "big"], "--model-mib: 'big' is not a whole number"),
    (["--tokens", "0"], "--tokens: 0 is outside 16..4096"),
    (["--bandwidth-gbs", "nan"], "--bandwidth-gbs: 'nan' is not a positive number"),
    (["--bandwidth-gbs", "-3"], "--bandwidth-gbs: '-3' is not a positive number"),
    (["--cpu"], "--cpu needs --bin-dir"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_a_bad_option_is_one_error_naming_it(args: list[str], names: str) -> None:
    with pytest.raises(ConfigError, match="^gpu-check: ") as caught:
        gpu_check.parse_args(args)
    assert names in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_bin_dir_without_the_binaries_is_refused(tmp_path: Path) -> None:
    (tmp_path / "llama-bench").write_text("")
    (tmp_path / "llama-bench").chmod(0o755)
    with pytest.raises(ConfigError, match=r"--bin-dir .*: no executable llama-server$"):
        gpu_check.parse_args(["--cpu", "--bin-dir", str(tmp_path)])


def test_the_defaults_build_a_few_hundred_mb_model_with_every_core() -> None:
    args = gpu_check.parse_args([])
    assert (args.model_mib, args.tokens, args.cpu, args.bin_dir) == (512, 128, False, None)
    assert args.jobs == (os.cpu_count() or 1)


@pytest.mark.parametrize("size_mib", [32, 64, 300, 512, 2048])
def test_the_plan_comes_within_a_layer_of_the_size_asked(size_mib: int) -> None:
    plan = gpu_check.model_plan(size_mib, len(VOCAB))
    one_layer = sum(t.nbytes for t in plan.tensors if t.name.startswith("blk.0."))
    assert plan.n_layer >= 1
    assert abs(plan.nbytes - size_mib * 2**20) <= one_layer / 2


def test_the_plan_is_a_llama_model_llama_cpp_can_load() -> None:
    plan = gpu_check.model_plan(512, len(VOCAB))
    names = [t.name for t in plan.tensors]
    per_layer = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")
    assert names == ["token_embd.weight",
                     *(f"blk.{i}.{part}.weight" for i in range(plan.n_layer) for part in per_layer),
                     "output_norm.weight", "output.weight"]
    assert 400 * 2**20 < plan.nbytes < 600 * 2**20 and plan.n_layer == 20
    n_kv = plan.n_embd // plan.n_head * plan.n_head_kv
    dims = {t.name: t.dims for t in plan.tensors}
    assert dims["blk.0.attn_k.weight"] == (plan.n_embd, n_kv)
    assert dims["blk.0.ffn_down.weight"] == (plan.n_ff, plan.n_embd)
    assert dims["output.weight"] == (plan.n_embd, len(VOCAB))
    for tensor in plan.tensors:
        assert tensor.kind == ("F32" if tensor.name.endswith("norm.weight") else "Q4_0")
        assert tensor.kind == "F32" or tensor.dims[0] % 32 == 0  # whole Q4_0 blocks per row


def test_the_written_model_is_the_plan(tmp_path: Path) -> None:
    """Written with the gguf package (the dev install here; the archive's gguf-py on the GPU machine), read back
    with rigctl's own reader: every tensor of the plan, at its size, and the shape the bandwidth bound needs."""
    import gguf

    plan = gpu_check.model_plan(32, len(VOCAB))
    path = tmp_path / "random.gguf"
    gpu_check.write_model(gguf, plan, VOCAB, path)
    header = gguf_reader.read_header(str(path))
    assert [t.name for t in header["tensors"]] == [t.name for t in plan.tensors]
    assert {t.name: t.bytes for t in header["tensors"]} == {t.name: t.nbytes for t in plan.tensors}
    assert gguf_reader.type_summary(header)["Q4_0"]["bytes"] == sum(t.nbytes for t in plan.tensors
                                                                     if t.kind == "Q4_0")
    assert gpu_check.gguf_shape(str(path)) == {
        "architecture": "llama", "block_count": plan.n_layer, "embedding_length": 2048,
        "attention.head_count": 16, "attention.head_count_kv": 8, "context_length": 4096}
    assert header["meta"]["tokenizer.ggml.model"] == "llama"
    # random, but not degenerate: Q4_0 blocks carry the chosen scale and differing quants
    first = next(t for t in header["tensors"] if t.name == "blk.0.attn_q.weight")
    with path.open("rb") as f:
        f.seek(header["data_start"] + first.offset)
        block = f.read(36)
    (scale,) = struct.unpack("<e", block[:2])
    assert scale == pytest.approx(1 / (4.6 * math.sqrt(2048)), rel=1e-2)
    assert block[2:18] != block[20:36]


def test_the_bound_is_rigctls_and_a_cpu_run_has_none(tmp_path: Path) -> None:
    import gguf

    plan = gpu_check.model_plan(32, len(VOCAB))
    path = tmp_path / "random.gguf"
    gpu_check.write_model(gguf, plan, VOCAB, path)
    # 100 GB/s over the weights (plus a KV cache of 64 tokens on average): the bound, and a share of it
    text = gpu_check.bound_text(1000.0, 100.0, path, cuda=True, context=0, generated=128)
    kv_per_token = 1 * 8 * (128 * 2 + 128 * 2)
    bound = 100e9 / (plan.nbytes + kv_per_token * 64)
    assert text == f"{1000.0 / bound:.1%} of the {bound:.1f} t/s that 100 GB/s allows"
    assert gpu_check.bound_text(10.0, None, path, cuda=False, context=0, generated=128) == (
        "no bandwidth figure (--cpu: no card, so no bandwidth to hold it against)")
    # a bandwidth given for a CPU run: rigctl's bound has no figure for -ngl 0 either
    assert gpu_check.bound_text(10.0, 50.0, path, cuda=False, context=0, generated=128) == (
        "no bandwidth figure (a CPU run (-ngl 0))")


def test_the_pin_is_the_lab_inventorys_archive_in_the_cache(tmp_path: Path) -> None:
    pin = gpu_check.read_pin(cache=tmp_path)
    lab = yaml.safe_load(gpu_check.PIN_FILE.read_text())
    assert pin.sha256 == lab["llama_cpp_archive"]["sha256"]
    assert pin.archive == tmp_path / "sources" / Path(lab["llama_cpp_archive"]["path"]).name
    assert (pin.version, pin.subdir) == (lab["llama_cpp_version"], "llama.cpp")


def test_an_archive_that_is_not_the_pin_is_refused(tmp_path: Path) -> None:
    pin = gpu_check.read_pin(cache=tmp_path)
    with pytest.raises(ConfigError, match="is missing"):
        gpu_check.check_archive(pin)
    pin.archive.parent.mkdir(parents=True)
    pin.archive.write_bytes(b"not the archive")
    with pytest.raises(ConfigError, match=f"has sha256 [0-9a-f]{{64}}, the pin is {pin.sha256}$"):
        gpu_check.check_archive(pin)


def test_a_pin_file_without_a_pin_is_one_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "llama_cpp.yml"
    bad.write_text("llama_cpp_version: b1\n")
    with pytest.raises(ConfigError, match=f"^{bad}: no llama_cpp_archive pin readable"):
        gpu_check.read_pin(bad, cache=tmp_path)


def test_the_build_takes_the_roles_cmake_entries_and_only_the_present_arch(tmp_path: Path) -> None:
    role = yaml.safe_load(gpu_check.ROLE_VARS.read_text())["_llama_cpp_cmake_base"]
    pin = gpu_check.read_pin(cache=tmp_path)
    entries = gpu_check.cmake_entries("90", "/usr/local/cuda/bin/nvcc", Path("/usr/local/cuda"), pin)
    fixed = {k: v for k, v in role.items() if "{{" not in str(v)}
    assert fixed and all(entries[k] == str(v) for k, v in fixed.items())
    assert entries["CMAKE_BUILD_TYPE"] == "Release" and entries["LLAMA_BUILD_TESTS"] == "OFF"
    assert entries["GGML_CUDA"] == "ON" and entries["CMAKE_CUDA_ARCHITECTURES"] == "90"
    assert entries["GGML_NATIVE"] == "ON" and entries["LLAMA_OPENSSL"] == "OFF"
    assert gpu_check.TARGETS == ("llama-server", "llama-bench")
