#!/usr/bin/python3
# Part of rigctl's llama_cpp role.
"""Make a staged llama.cpp build compute before it becomes current.

A build that starts is not a build that computes: a native binary on a CPU without one of its
instructions, a CUDA build for the wrong architecture or a driver older than the toolkit all pass
``--version`` and die on the first matrix multiply. This module writes a tiny llama model with random
weights (stdlib only: the hosts have no Python packages for it) and runs the staged ``llama-bench``
on it: a prompt batch and a few generated tokens through the same backend the servers use (CPU for
CPU builds, CUDA with every layer offloaded for CUDA builds). It reports the cause when the run
crashes, hangs or prints a CUDA error; the role refuses the build then.
"""

from __future__ import annotations

DOCUMENTATION = r"""
module: llama_cpp_smoke
short_description: Run a staged llama.cpp build on a tiny random-weight model and say whether it computed
description:
  - Writes a tiny llama-architecture GGUF (2 layers, 256 wide, Q4_0 weights, random) into I(work_dir)
    and runs C(llama-bench) from I(bin_dir) on it with a timeout (C(-ngl 99) when I(cuda)).
  - Returns C(passed), a one-line C(cause) when it did not (no CUDA device, as llama.cpp's CUDA backend
    says; signal name, timeout, first CUDA error line, exit status), the measured rates, and the path of
    the run's log, kept for inspection on failure.
options:
  bin_dir: {description: The staged build's bin directory., type: path, required: true}
  work_dir: {description: Where the model and the logs go., type: path, required: true}
  name: {description: The build's name (names the log file)., type: str, required: true}
  cuda: {description: A CUDA build; every layer is offloaded and CUDA must be used., type: bool, default: false}
  timeout: {description: Seconds the run may take before it counts as hung., type: int, default: 120}
  threads: {description: CPU threads for llama-bench (0 = its default)., type: int, default: 0}
"""

import json
import math
import os
import random
import re
import signal
import struct
import subprocess
from dataclasses import dataclass

from ansible.module_utils.sandbox import clean_environment

# --------------------------------------------------------------------------------------- the model

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
GGUF_ALIGNMENT = 32
# GGUF value types and ggml tensor types used here.
_GGUF_UINT32, _GGUF_INT32, _GGUF_FLOAT32, _GGUF_STRING, _GGUF_ARRAY = 4, 5, 6, 8, 9
GGML_TYPE_F32, GGML_TYPE_Q4_0 = 0, 2
Q4_0_BLOCK = 32  # values per block: one f16 scale + 16 bytes of 4-bit quants

#: The smoke model's shape: small enough to load and run in well under a second, wide enough that the
#: quantized matrix multiplies take the same kernels as a real model (Q4_0 rows of 8 blocks and more:
#: the AVX2/AVX-512/AMX repacked paths and the CUDA MMQ/MMVQ kernels).
N_EMBD, N_FF, N_LAYER, N_HEAD, N_HEAD_KV, N_CTX = 256, 512, 2, 4, 2, 256
SMOKE_SEED = 20261201


def _vocab() -> list[tuple[str, float, int]]:
    """(token, score, type): unknown, BOS, EOS, the 256 byte tokens, then plain pieces; 320 in all."""
    tokens = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    tokens += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    tokens += [(f"\u2581t{i}", -float(i), 1) for i in range(320 - len(tokens))]
    return tokens


def _string(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, kind: int, value: object) -> bytes:
    out = _string(key) + struct.pack("<I", kind)
    if kind == _GGUF_STRING:
        return out + _string(str(value))
    if kind == _GGUF_ARRAY:
        elem_kind, items = value  # type: ignore[misc]
        out += struct.pack("<IQ", elem_kind, len(items))
        if elem_kind == _GGUF_STRING:
            return out + b"".join(_string(i) for i in items)
        return out + struct.pack(f"<{len(items)}{'f' if elem_kind == _GGUF_FLOAT32 else 'i'}", *items)
    return out + struct.pack({_GGUF_UINT32: "<I", _GGUF_INT32: "<i", _GGUF_FLOAT32: "<f"}[kind], value)


def _q4_0(rng: random.Random, n: int) -> bytes:
    """n random Q4_0 values: every block scaled by 1/64, so activations stay finite through the layers."""
    scale = struct.pack("<e", 1.0 / 64)
    return b"".join(scale + rng.randbytes(Q4_0_BLOCK // 2) for _ in range(n // Q4_0_BLOCK))


def tiny_model_gguf(seed: int = SMOKE_SEED) -> bytes:
    """A complete llama-architecture GGUF with random Q4_0 weights (deterministic for a seed)."""
    rng = random.Random(seed)
    vocab = _vocab()
    n_vocab, n_embd_kv = len(vocab), N_EMBD // N_HEAD * N_HEAD_KV
    metadata = [
        ("general.architecture", _GGUF_STRING, "llama"),
        ("general.name", _GGUF_STRING, "rigctl smoke test (random weights)"),
        ("general.alignment", _GGUF_UINT32, GGUF_ALIGNMENT),
        ("llama.context_length", _GGUF_UINT32, N_CTX),
        ("llama.embedding_length", _GGUF_UINT32, N_EMBD),
        ("llama.block_count", _GGUF_UINT32, N_LAYER),
        ("llama.feed_forward_length", _GGUF_UINT32, N_FF),
        ("llama.attention.head_count", _GGUF_UINT32, N_HEAD),
        ("llama.attention.head_count_kv", _GGUF_UINT32, N_HEAD_KV),
        ("llama.rope.dimension_count", _GGUF_UINT32, N_EMBD // N_HEAD),
        ("llama.attention.layer_norm_rms_epsilon", _GGUF_FLOAT32, 1e-5),
        ("llama.vocab_size", _GGUF_UINT32, n_vocab),
        ("tokenizer.ggml.model", _GGUF_STRING, "llama"),
        ("tokenizer.ggml.tokens", _GGUF_ARRAY, (_GGUF_STRING, [t for t, _, _ in vocab])),
        ("tokenizer.ggml.scores", _GGUF_ARRAY, (_GGUF_FLOAT32, [s for _, s, _ in vocab])),
        ("tokenizer.ggml.token_type", _GGUF_ARRAY, (_GGUF_INT32, [k for _, _, k in vocab])),
        ("tokenizer.ggml.unknown_token_id", _GGUF_UINT32, 0),
        ("tokenizer.ggml.bos_token_id", _GGUF_UINT32, 1),
        ("tokenizer.ggml.eos_token_id", _GGUF_UINT32, 2),
    ]
    # (name, dims as ggml orders them: row length first, type)
    shapes: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (N_EMBD, n_vocab), GGML_TYPE_Q4_0)]
    for i in range(N_LAYER):
        shapes += [
            (f"blk.{i}.attn_norm.weight", (N_EMBD,), GGML_TYPE_F32),
            (f"blk.{i}.attn_q.weight", (N_EMBD, N_EMBD), GGML_TYPE_Q4_0),
            (f"blk.{i}.attn_k.weight", (N_EMBD, n_embd_kv), GGML_TYPE_Q4_0),
            (f"blk.{i}.attn_v.weight", (N_EMBD, n_embd_kv), GGML_TYPE_Q4_0),
            (f"blk.{i}.attn_output.weight", (N_EMBD, N_EMBD), GGML_TYPE_Q4_0),
            (f"blk.{i}.ffn_norm.weight", (N_EMBD,), GGML_TYPE_F32),
            (f"blk.{i}.ffn_gate.weight", (N_EMBD, N_FF), GGML_TYPE_Q4_0),
            (f"blk.{i}.ffn_up.weight", (N_EMBD, N_FF), GGML_TYPE_Q4_0),
            (f"blk.{i}.ffn_down.weight", (N_FF, N_EMBD), GGML_TYPE_Q4_0),
        ]
    shapes += [("output_norm.weight", (N_EMBD,), GGML_TYPE_F32), ("output.weight", (N_EMBD, n_vocab), GGML_TYPE_Q4_0)]

    infos, blobs, offset = [], [], 0
    for name, dims, kind in shapes:
        count = math.prod(dims)
        data = struct.pack(f"<{count}f", *([1.0] * count)) if kind == GGML_TYPE_F32 else _q4_0(rng, count)
        data += b"\0" * (-len(data) % GGUF_ALIGNMENT)
        infos.append(_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset))
        blobs.append(data)
        offset += len(data)
    header = GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(shapes), len(metadata))
    header += b"".join(_kv(*item) for item in metadata) + b"".join(infos)
    header += b"\0" * (-len(header) % GGUF_ALIGNMENT)
    return header + b"".join(blobs)


# ------------------------------------------------------------------------------------ the verdict

#: Lines the CUDA backend prints when it found no device to run on: ggml_cuda_init could not even count
#: the devices (no driver library, no GPU, a driver older than the runtime: "failed to initialize CUDA: CUDA
#: driver version is insufficient for CUDA runtime version", "...: no CUDA-capable device is detected"),
#: or counted none.
_CUDA_NO_DEVICE = re.compile(r"ggml_cuda_init: failed to initialize|ggml_cuda_init: found 0 |no CUDA-capable device")
#: Lines the CUDA backend prints when it cannot run on the device it found: a kernel error ("CUDA error: no
#: kernel image is available for execution on the device"), a failed allocation.
_CUDA_ERROR = re.compile(r"CUDA error|cudaError|ggml_cuda_init: failed|failed to initialize CUDA"
                         r"|CUDA driver version is insufficient")
_ERROR_LINE = re.compile(r"GGML_ASSERT|error|failed|Illegal|Segmentation|terminate called|Aborted", re.IGNORECASE)


@dataclass(frozen=True)
class SmokeVerdict:
    cause: str | None  # None: it computed
    prompt_ts: float = 0.0  # tokens/s of the prompt batch
    gen_ts: float = 0.0  # tokens/s generating
    backends: str = ""
    gpu_info: str = ""


def _first(pattern: re.Pattern[str], lines: list[str]) -> str | None:
    return next((line for line in lines if pattern.search(line)), None)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def judge(rc: int | None, stdout: str, stderr: str, *, cuda: bool, timeout: float) -> SmokeVerdict:
    """What one llama-bench run (``-o json``) says about the build. ``rc`` None: killed at the timeout;
    negative: killed by that signal (subprocess's convention)."""
    lines = [line.strip() for line in (stderr + "\n" + stdout).splitlines() if line.strip()]
    no_device = _first(_CUDA_NO_DEVICE, lines) if cuda else None
    if no_device:
        return SmokeVerdict(cause=f"no CUDA device: the CUDA backend found none ({no_device[:240]})")
    cuda_error = _first(_CUDA_ERROR, lines)
    if cuda_error:
        return SmokeVerdict(cause=cuda_error[:300])
    if rc is None:
        return SmokeVerdict(cause=f"hung: no result within {timeout:g} s, killed")
    hint = _first(_ERROR_LINE, lines)
    if rc < 0:
        return SmokeVerdict(cause=f"killed by {_signal_name(-rc)}" + (f" ({hint[:200]})" if hint else ""))
    if rc != 0:
        return SmokeVerdict(cause=f"llama-bench exited {rc}: {(hint or (lines[-1] if lines else 'no output'))[:200]}")
    try:
        results = json.loads(stdout)
    except ValueError:
        results = None
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        return SmokeVerdict(cause=f"llama-bench printed no results: {(lines[-1] if lines else 'no output')[:200]}")
    prompt = [r for r in results if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0]
    gen = [r for r in results if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not prompt or not gen:
        return SmokeVerdict(cause="llama-bench did not report both the prompt and the generation test")
    rates = [prompt[0].get("avg_ts"), gen[0].get("avg_ts")]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in rates):
        return SmokeVerdict(cause=f"llama-bench measured no work (rates {rates})")
    backends, gpu_info = str(prompt[0].get("backends", "")), str(prompt[0].get("gpu_info", ""))
    verdict = SmokeVerdict(cause=None, prompt_ts=float(rates[0]), gen_ts=float(rates[1]),
                           backends=backends, gpu_info=gpu_info)
    if cuda and "CUDA" not in backends:
        return SmokeVerdict(cause=f"the build has no CUDA backend (llama-bench's backends: '{backends}')")
    if cuda and (not gpu_info.strip() or int(prompt[0].get("n_gpu_layers", 0)) <= 0):
        return SmokeVerdict(cause="no CUDA device: the CUDA build computed on the CPU "
                                  f"(backends '{backends}', GPUs '{gpu_info}')")
    return verdict


def bench_argv(bin_dir: str, model: str, *, cuda: bool, threads: int) -> list[str]:
    """A prompt batch of 64 and 16 generated tokens, once, after llama-bench's own warm-up run."""
    argv = [os.path.join(bin_dir, "llama-bench"), "-m", model, "-p", "64", "-n", "16", "-r", "1",
            "-ngl", "99" if cuda else "0", "-o", "json"]
    return argv + (["-t", str(threads)] if threads > 0 else [])


def run(argv: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Run in its own process group, killed as a group at the timeout (rc None then), without the variables
    llama.cpp reads from the environment (llama-bench reads no config file)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, errors="replace", start_new_session=True,
                            env=clean_environment(os.environ))
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def _write_atomic(path: str, data: bytes, mode: int = 0o644) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def main() -> None:
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(
        argument_spec={
            "bin_dir": {"type": "path", "required": True},
            "work_dir": {"type": "path", "required": True},
            "name": {"type": "str", "required": True},
            "cuda": {"type": "bool", "default": False},
            "timeout": {"type": "int", "default": 120},
            "threads": {"type": "int", "default": 0},
        },
        supports_check_mode=False,
    )
    p = module.params
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", p["name"]):
        module.fail_json(msg=f"build name {p['name']!r} is not a plain file name")
    os.makedirs(p["work_dir"], mode=0o755, exist_ok=True)
    model = os.path.join(p["work_dir"], "tiny-random.gguf")
    _write_atomic(model, tiny_model_gguf())
    argv = bench_argv(p["bin_dir"], model, cuda=p["cuda"], threads=p["threads"])
    rc, out, err = run(argv, p["timeout"])
    verdict = judge(rc, out, err, cuda=p["cuda"], timeout=p["timeout"])
    log = os.path.join(p["work_dir"], f"{p['name']}.log")
    if verdict.cause is None:
        if os.path.exists(log):
            os.remove(log)
    else:
        status = "timeout" if rc is None else (f"signal {_signal_name(-rc)}" if rc < 0 else f"exit {rc}")
        _write_atomic(log, f"$ {' '.join(argv)}\n# {status}\n# stderr\n{err}\n# stdout\n{out}\n".encode())
    module.exit_json(changed=False, passed=verdict.cause is None, cause=verdict.cause or "", argv=argv,
                     prompt_ts=verdict.prompt_ts, gen_ts=verdict.gen_ts, backends=verdict.backends,
                     gpu_info=verdict.gpu_info, log=log if verdict.cause else "")


if __name__ == "__main__":
    main()
