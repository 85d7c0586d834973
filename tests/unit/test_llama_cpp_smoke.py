"""The llama_cpp role's smoke test and CPU probe, controller-side: the tiny model it writes (read back
with the gguf package, an independent reader), its verdict on llama-bench runs (real child processes
for crashes and hangs; captured output for the CUDA failures a GPU-less machine cannot produce), the
instruction-set key, and how `rigctl build status` names the CPU target. The lab tests run it on real
builds (tests/test_llama_cpp.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import role_modules

from rigctl.fleet.build import parse_fact

LIBRARY = Path(__file__).resolve().parents[2] / "roles" / "llama_cpp" / "library"


def _module(name: str) -> ModuleType:
    return role_modules.load(LIBRARY / f"{name}.py", name)  # module_utils imports resolve as on a host


smoke = _module("llama_cpp_smoke")
probe = _module("llama_cpp_probe")


def _bench_json(*, backends: str = "CPU", gpu_info: str = "", ngl: int = 0, pp: float = 812.5,
                tg: float = 96.1) -> str:
    common = {"build_commit": "b11434", "build_number": 11434, "backends": backends, "gpu_info": gpu_info,
              "n_gpu_layers": ngl, "model_type": "llama ?B Q4_0"}
    return json.dumps([{**common, "n_prompt": 64, "n_gen": 0, "avg_ts": pp},
                       {**common, "n_prompt": 0, "n_gen": 16, "avg_ts": tg}])


# ------------------------------------------------------------------------------------- the model


def test_tiny_model_is_a_llama_gguf_with_quantized_weights(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    data = smoke.tiny_model_gguf()
    assert data == smoke.tiny_model_gguf()  # deterministic: the same file every run
    assert data != smoke.tiny_model_gguf(seed=1)
    assert len(data) < 1 << 20
    path = tmp_path / "tiny.gguf"
    path.write_bytes(data)
    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "llama"
    assert int(reader.fields["llama.block_count"].parts[-1][0]) == smoke.N_LAYER
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 320
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 9 * smoke.N_LAYER + 1
    q = tensors["blk.1.ffn_down.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert list(q.shape) == [smoke.N_FF, smoke.N_EMBD]
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    # Every Q4_0 block's scale is the same small finite f16; the quants are random, not constant.
    blocks = q.data.reshape(-1, 18)
    assert len(set(map(bytes, blocks[:, :2]))) == 1
    assert len(set(map(bytes, blocks[:, 2:]))) > len(blocks) // 2


# ----------------------------------------------------------------------------------- the verdict


def test_a_run_that_computed_passes_with_its_rates() -> None:
    verdict = smoke.judge(0, _bench_json(), "", cuda=False, timeout=120)
    assert verdict.cause is None
    assert (verdict.prompt_ts, verdict.gen_ts, verdict.backends) == (812.5, 96.1, "CPU")


def test_a_cuda_run_on_the_gpu_passes() -> None:
    out = _bench_json(backends="CUDA", gpu_info="NVIDIA H200", ngl=99)
    assert smoke.judge(0, out, "ggml_cuda_init: found 1 CUDA devices:\n", cuda=True, timeout=120).cause is None


def test_a_real_crash_is_named_by_its_signal() -> None:
    rc, out, err = smoke.run([sys.executable, "-c",
                              "import os, signal, sys; print('GGML_ASSERT(ok) failed', file=sys.stderr); "
                              "sys.stderr.flush(); os.kill(os.getpid(), signal.SIGSEGV)"], timeout=30)
    assert rc == -11
    cause = smoke.judge(rc, out, err, cuda=False, timeout=30).cause
    assert cause == "killed by SIGSEGV (GGML_ASSERT(ok) failed)"
    assert smoke.judge(-4, "", "", cuda=False, timeout=30).cause == "killed by SIGILL"


def test_a_real_hang_is_killed_at_the_timeout() -> None:
    started = time.monotonic()
    rc, _, _ = smoke.run(["sh", "-c", "sleep 30 & sleep 30"], timeout=0.5)  # a child in the group, too
    assert rc is None and time.monotonic() - started < 10
    assert smoke.judge(rc, "", "", cuda=False, timeout=0.5).cause == "hung: no result within 0.5 s, killed"


@pytest.mark.parametrize(("rc", "stdout", "stderr", "expected"), [
    # A CUDA build for the wrong architecture: the first CUDA error line, not the abort it ends in.
    (-6, "", "ggml_cuda_init: found 1 CUDA devices:\n  Device 0: NVIDIA GeForce RTX 3090, compute capability 8.6\n"
             "CUDA error: no kernel image is available for execution on the device\n"
             "  current device: 0, in function ggml_cuda_compute_forward at ggml-cuda.cu:2713\n"
             "  err\n/src/ggml/src/ggml-cuda/ggml-cuda.cu:88: CUDA error\n",
     "CUDA error: no kernel image is available for execution on the device"),
    # No driver library (a host with no GPU), or a driver older than the toolkit: CUDA never starts and
    # llama-bench computes on the CPU instead. The cause names the missing device, in llama.cpp's words.
    (0, _bench_json(backends="CUDA"),
     "ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for CUDA runtime version\n",
     "no CUDA device: the CUDA backend found none (ggml_cuda_init: failed to initialize CUDA: CUDA driver version"
     " is insufficient for CUDA runtime version)"),
    (0, _bench_json(backends="CUDA"),
     "ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected\n",
     "no CUDA device: the CUDA backend found none (ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device"
     " is detected)"),
])
def test_cuda_errors_refuse_with_their_first_line(rc: int, stdout: str, stderr: str, expected: str) -> None:
    assert smoke.judge(rc, stdout, stderr, cuda=True, timeout=120).cause == expected


def test_a_cuda_build_that_ran_on_the_cpu_is_refused() -> None:
    cause = smoke.judge(0, _bench_json(backends="CUDA", ngl=99), "", cuda=True, timeout=120).cause
    assert cause == "no CUDA device: the CUDA build computed on the CPU (backends 'CUDA', GPUs '')"


def test_a_build_without_the_cuda_backend_is_refused_as_such() -> None:
    cause = smoke.judge(0, _bench_json(backends="CPU", ngl=99), "", cuda=True, timeout=120).cause
    assert cause == "the build has no CUDA backend (llama-bench's backends: 'CPU')"



@pytest.mark.parametrize(("rc", "stdout", "stderr", "expected"), [
    (1, "", "llama_model_load: error loading model: bad\nerror: failed to load model 'x'\nmain: done\n",
     "llama-bench exited 1: llama_model_load: error loading model: bad"),
    (0, "not json", "", "llama-bench printed no results: not json"),
    (0, json.dumps([{"n_prompt": 64, "n_gen": 0, "avg_ts": 10.0}]), "",
     "llama-bench did not report both the prompt and the generation test"),
    (0, _bench_json(tg=float("nan")).replace("NaN", "null"), "", "llama-bench measured no work (rates [812.5, None])"),
])
def test_other_failures_are_one_line(rc: int, stdout: str, stderr: str, expected: str) -> None:
    cause = smoke.judge(rc, stdout, stderr, cuda=False, timeout=120).cause
    assert cause == expected and "\n" not in cause


def test_bench_argv_offloads_every_layer_for_cuda() -> None:
    argv = smoke.bench_argv("/opt/b/bin", "/w/tiny.gguf", cuda=True, threads=0)
    assert argv[0] == "/opt/b/bin/llama-bench" and argv[argv.index("-ngl") + 1] == "99"
    assert "-t" not in argv and argv[argv.index("-o") + 1] == "json"
    cpu = smoke.bench_argv("/opt/b/bin", "/w/tiny.gguf", cuda=False, threads=2)
    assert cpu[cpu.index("-ngl") + 1] == "0" and cpu[-2:] == ["-t", "2"]


# -------------------------------------------------------------------------- the instruction set

XEON_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 hypervisor constant_tsc avx512f \
avx512bw avx512vl avx512dq avx512cd avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16 rep_good nopl
processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse sse2
"""


def test_native_key_holds_the_instruction_set_not_the_model_string() -> None:
    model, isa = probe.cpu_info(XEON_AMX, "x86_64")
    assert model == "Intel(R) Xeon(R) Processor"
    assert "amx_tile" in isa and "avx512f" in isa and isa == sorted(isa)
    assert not {"hypervisor", "constant_tsc", "rep_good", "nopl", "fpu", "vme"} & set(isa)
    # A twin whose VM hides AMX: same model string, another key.
    _, twin = probe.cpu_info(XEON_AMX.replace(" amx_tile amx_int8 amx_bf16", ""), "x86_64")
    assert probe.isa_hash("x86_64", isa) != probe.isa_hash("x86_64", twin)
    # Flags that are not instruction sets do not split the key.
    _, same = probe.cpu_info(XEON_AMX.replace("hypervisor constant_tsc ", ""), "x86_64")
    assert probe.isa_hash("x86_64", same) == probe.isa_hash("x86_64", isa)
    assert len(probe.isa_hash("x86_64", isa)) == 12


def test_arm_features_are_the_instruction_set() -> None:
    model, isa = probe.cpu_info("processor\t: 0\nFeatures\t: fp asimd sve i8mm dotprod\nCPU part\t: 0xd4f\n", "aarch64")
    # No implementer line: the part alone names no core.
    assert (model, isa) == ("unknown", ["asimd", "dotprod", "fp", "i8mm", "sve"])
    assert probe.isa_hash("aarch64", isa) != probe.isa_hash("x86_64", isa)


FACT = """[current]
name = b11434-aaaaaaaaaaaa
key = aaaaaaaaaaaa
version = b11434
commit = b11434
build_number = 11434
cpu_target = native
cpu_isa_hash = 9246a338d6cf

[previous]
name = b11434-bbbbbbbbbbbb
cpu_target = portable
cpu_isa_hash =
"""


def test_build_status_names_the_cpu_target() -> None:
    builds = parse_fact(FACT, "desktop")
    assert builds.current and builds.current.cpu == "native 9246a338"
    assert builds.previous and builds.previous.cpu == "portable"
    # A fact written before the field: no claim.
    older = parse_fact("[current]\nname = b1-x\n", "desktop")
    assert older.current and older.current.cpu == "-"


REAL_VERSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "real" / "llama_version"


@pytest.mark.parametrize(("capture", "build_number", "commit", "matches"), [
    ("llama-cpp-issue14566-b5630-container.txt", 5630, "4c763c8d5e0f1a", True),  # `version: N (C)`, a longer pin
    ("llama-cpp-pr28971-llama-bench-b10991.txt", 10991, "930e2fa59", True),  # `version: X (build N, commit C)`
    ("llama-cpp-pr28971-llama-bench-b10991.txt", 10991, "0a8b29a60", False),  # another commit
    ("llama-cpp-issue14566-b5630-container.txt", 5631, "4c763c8d", False),  # another build number
])
def test_the_post_build_check_reads_either_version_generation(tmp_path: Path, capture: str, build_number: int,
                                                              commit: str, matches: bool) -> None:
    # A stand-in binary that says, on stderr as llama.cpp does, what a real build said (recorded captures);
    # the role's module run the way a host runs it.
    said = (REAL_VERSIONS / capture).read_text().partition("\n")[2]
    (tmp_path / "said.txt").write_text(said)
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\ncat {tmp_path / 'said.txt'} >&2\n")
    binary.chmod(0o755)
    rc, out = role_modules.run(LIBRARY, "llama_cpp_version",
                               {"binary": str(binary), "build_number": build_number, "commit": commit}, tmp_path)
    assert rc == 0, out
    assert f'"matches": {str(matches).lower()}' in out, out
