#!/usr/bin/python3
# Part of rigctl's llama_server role.
"""VRAM preflight: what one llama-server instance needs on the GPU against what the GPU has."""

from __future__ import annotations

DOCUMENTATION = r"""
module: llama_server_vram
short_description: Estimate a llama-server instance's VRAM need before it is started
description:
  - Weights come from the artifact's manifest (bytes per ggml type); which of them land on the GPU
    comes from the GGUF header's tensor table (C(-ngl) counts blocks from the end, C(-ot ...=CPU)
    patterns keep matching tensors on the CPU, the input embeddings always stay on the CPU).
  - The KV cache is sized for the context at the chosen cache types, for the layers that have one
    (recurrent layers and layers sharing another layer's cache have none; sliding-window layers keep
    only their window). The compute buffer is estimated from the batch, vocabulary and width.
  - When the need exceeds the GPU's memory less a reserve, suggests the largest C(-c) that fits and the
    fewest trailing blocks to keep on the CPU with C(-ot). An estimate, not an allocation; reads only.
options:
  model: {description: The artifact's GGUF file (its manifest is <model>.manifest.json)., type: path, required: true}
  draft_model: {description: A drafter GGUF loaded beside it (its weights and cache count too)., type: path, default: ""}
  ctx_size: {description: Context size (C(-c)); 0 takes the model's trained context., type: int, default: 0}
  cache_type_k: {description: K cache type., type: str, default: f16}
  cache_type_v: {description: V cache type., type: str, default: f16}
  flash_attn: {description: Flash attention on (no full attention matrix in the compute buffer)., type: bool, default: true}
  n_gpu_layers: {description: C(-ngl); negative means all., type: int, default: -1}
  n_gpu_layers_draft: {description: C(-ngld) for the drafter; negative means all., type: int, default: -1}
  override_tensor: {description: C(-ot) patterns (pattern=buffer type)., type: list, elements: str, default: []}
  n_ubatch: {description: Physical batch size (llama-server's default 512)., type: int, default: 512}
  vram_mib: {description: The GPU's memory., type: int, required: true}
  reserve_mib: {description: Memory the driver, CUDA context and display keep., type: int, default: 350}
"""

import json
import re

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.gguf import GGUFError, read_header
from ansible.module_utils.model_files import manifest_path

MIB = 1024 * 1024
# Bytes per element of the KV cache types llama-server accepts.
CACHE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
               "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}
_BLOCK = re.compile(r"^blk\.(\d+)\.")
#: Blocks (layers) a model may claim; the largest have a few hundred.
MAX_BLOCKS = 1 << 16


def _header(path: str) -> dict:
    try:
        return read_header(path)
    except GGUFError as exc:
        raise GGUFError(f"{path}: {exc}") from None


def _per_layer(value, n_layer, default):
    if isinstance(value, list):
        return [int(v) for v in value[:n_layer]] + [default] * max(0, n_layer - len(value))
    return [int(value if value is not None else default)] * n_layer


def model_shape(header: dict) -> dict:
    """The hyperparameters the estimate needs, from the GGUF metadata; GGUFError when the metadata holds
    values of another shape (the file is anyone's: a string, a list or a kept-as-length value where a
    number belongs)."""
    try:
        return _shape(header)
    except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
        raise GGUFError(f"its metadata is not a model shape this estimate reads ({type(exc).__name__}: "
                        f"{exc})") from None


def _shape(header: dict) -> dict:
    meta = header["meta"]
    arch = str(meta.get("general.architecture", ""))

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    n_layer = int(key("block_count", 0))
    if not 0 <= n_layer <= MAX_BLOCKS:  # the estimate makes a list per layer: a claimed 2**62 is no model
        raise ValueError(f"block_count {n_layer} (at most {MAX_BLOCKS})")
    nextn = int(key("nextn_predict_layers", 0) or 0)
    n_embd = int(key("embedding_length", 0))
    n_head = key("attention.head_count", 1)
    n_head0 = int(n_head[0] if isinstance(n_head, list) else n_head) or 1
    n_head_kv = _per_layer(key("attention.head_count_kv"), n_layer, n_head0)
    k_len = int(key("attention.key_length", n_embd // n_head0 if n_head0 else 0))
    v_len = int(key("attention.value_length", k_len))
    k_len_swa = int(key("attention.key_length_swa", k_len))
    v_len_swa = int(key("attention.value_length_swa", v_len))
    swa_pattern = key("attention.sliding_window_pattern")
    is_swa = [bool(x) for x in swa_pattern][:n_layer] if isinstance(swa_pattern, list) else [False] * n_layer
    is_swa += [False] * (n_layer - len(is_swa))
    recurrent = key("attention.recurrent_layers")
    if isinstance(recurrent, list):
        is_recurrent = [bool(x) for x in recurrent][:n_layer] + [False] * max(0, n_layer - len(recurrent))
    elif key("ssm.state_size") is not None:  # hybrid: one full-attention layer every `interval`
        interval = int(key("full_attention_interval", 4) or 4)
        is_recurrent = [(i < n_layer - nextn) and (i + 1) % interval != 0 for i in range(n_layer)]
    else:
        is_recurrent = [False] * n_layer
    shared = int(key("attention.shared_kv_layers", 0) or 0)
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = int(tokens["length"] if isinstance(tokens, dict) else len(tokens or []) or key("vocab_size", 0) or 0)
    kv_layers = []
    for i in range(n_layer):
        # Multi-token-prediction blocks (nextn) only hold a cache when they draft; not counted here.
        if is_recurrent[i] or n_head_kv[i] == 0 or i >= n_layer - shared or i >= n_layer - nextn:
            continue
        swa = is_swa[i]
        kv_layers.append({"k": n_head_kv[i] * (k_len_swa if swa else k_len),
                          "v": n_head_kv[i] * (v_len_swa if swa else v_len), "swa": swa})
    return {"arch": arch, "n_layer": n_layer, "n_block": n_layer - nextn, "n_embd": n_embd, "n_head": n_head0,
            "n_vocab": n_vocab, "kv_layers": kv_layers, "n_swa": int(key("attention.sliding_window", 0) or 0),
            "n_ctx_train": int(key("context_length", 0) or 0)}


def _on_cpu(name: str, patterns: list) -> bool:
    for pattern in patterns:
        regex, _, buft = pattern.rpartition("=")
        if buft.upper() == "CPU" and re.search(regex, name):
            return True
    return False


def gpu_weight_bytes(header: dict, shape: dict, n_gpu_layers: int, patterns: list) -> int:
    """Bytes of weights on the GPU: the last ``n_gpu_layers`` blocks, the output head when all
    blocks are offloaded, never the input embeddings, minus what the -ot patterns keep on the CPU."""
    n_layer = shape["n_layer"]
    ngl = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    first_gpu_block = max(0, n_layer - ngl)
    names = {tensor.name for tensor in header["tensors"]}
    total = 0
    for name, _type, _offset, nbytes in header["tensors"]:
        match = _BLOCK.match(name)
        if match:
            on_gpu = int(match.group(1)) >= first_gpu_block
        elif name.startswith("output") or (name == "token_embd.weight" and "output.weight" not in names):
            on_gpu = ngl > n_layer  # the output head (a tied head is a copy of the embeddings)
        else:
            on_gpu = False  # input embeddings and other input-side tensors stay on the CPU
        if on_gpu and not _on_cpu(name, patterns):
            total += nbytes
    return total


def kv_bytes(shape: dict, ctx: int, type_k: str, type_v: str, n_gpu_layers: int) -> float:
    bk, bv = CACHE_BYTES[type_k], CACHE_BYTES[type_v]
    layers = shape["kv_layers"]
    if n_gpu_layers >= 0:  # only offloaded layers keep their cache on the GPU
        layers = layers[max(0, len(layers) - n_gpu_layers):] if n_gpu_layers < shape["n_layer"] else layers
    total = 0.0
    for layer in layers:
        cells = min(ctx, shape["n_swa"] + 512) if layer["swa"] and shape["n_swa"] else ctx
        total += cells * (layer["k"] * bk + layer["v"] * bv)
    return total


def compute_bytes(shape: dict, ctx: int, n_ubatch: int, flash_attn: bool) -> float:
    # Logits and activations for one micro-batch; without flash attention the full attention
    # matrix of one layer is materialised too.
    out = 4.0 * n_ubatch * (shape["n_vocab"] + 4 * shape["n_embd"])
    if not flash_attn:
        out += 4.0 * n_ubatch * shape["n_head"] * ctx
    return out


def estimate(main: dict, draft: dict | None, p: dict) -> dict:
    """The estimate in MiB with suggestions, from parsed headers and the module's parameters."""
    shape = model_shape(main)
    ctx = p["ctx_size"] or shape["n_ctx_train"] or 4096
    ngl = p["n_gpu_layers"]
    patterns = list(p["override_tensor"])
    offloaded = ngl != 0

    def need(ctx_, patterns_):
        weights = gpu_weight_bytes(main, shape, ngl, patterns_)
        kv = kv_bytes(shape, ctx_, p["cache_type_k"], p["cache_type_v"], ngl) if offloaded else 0.0
        compute = compute_bytes(shape, ctx_, p["n_ubatch"], p["flash_attn"]) if offloaded else 0.0
        extra = 0.0
        if draft is not None and p["n_gpu_layers_draft"] != 0:
            dshape = model_shape(draft)
            extra = gpu_weight_bytes(draft, dshape, p["n_gpu_layers_draft"], [])
            extra += kv_bytes(dshape, ctx_, p["cache_type_k"], p["cache_type_v"], p["n_gpu_layers_draft"])
        return {"weights": weights, "kv": kv, "compute": compute, "draft": extra,
                "total": weights + kv + compute + extra}

    parts = need(ctx, patterns)
    budget = (p["vram_mib"] - p["reserve_mib"]) * MIB
    fits = parts["total"] <= budget
    suggestions = []
    if not fits and offloaded:
        per_token = parts["kv"] / ctx if ctx else 0.0
        fixed = parts["total"] - parts["kv"]
        if per_token > 0 and fixed < budget:
            best = int((budget - fixed) / per_token) // 1024 * 1024
            if best >= 1024:
                suggestions.append(f"-c {best}")
        blocks = shape["n_block"]
        for k in range(1, blocks + 1):
            chosen = list(range(blocks - k, blocks))
            pattern = "blk\\.(" + "|".join(str(i) for i in chosen) + ")\\.=CPU"
            if need(ctx, [*patterns, pattern])["total"] <= budget:
                suggestions.append(f"-ot '{pattern}' (the last {k} of {blocks} blocks on the CPU)")
                break
    mib = {k: round(v / MIB, 1) for k, v in parts.items()}
    return {"arch": shape["arch"], "ctx_size": ctx, "need_mib": mib, "budget_mib": p["vram_mib"] - p["reserve_mib"],
            "vram_mib": p["vram_mib"], "fits": fits, "suggestions": suggestions}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "model": {"type": "path", "required": True},
            "draft_model": {"type": "path", "default": ""},
            "ctx_size": {"type": "int", "default": 0},
            "cache_type_k": {"type": "str", "default": "f16", "choices": sorted(CACHE_BYTES)},
            "cache_type_v": {"type": "str", "default": "f16", "choices": sorted(CACHE_BYTES)},
            "flash_attn": {"type": "bool", "default": True},
            "n_gpu_layers": {"type": "int", "default": -1},
            "n_gpu_layers_draft": {"type": "int", "default": -1},
            "override_tensor": {"type": "list", "elements": "str", "default": []},
            "n_ubatch": {"type": "int", "default": 512},
            "vram_mib": {"type": "int", "required": True},
            "reserve_mib": {"type": "int", "default": 350},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        with open(manifest_path(p["model"]), encoding="utf-8") as f:
            manifest = json.load(f)
        main_header = _header(p["model"])
        draft_header = _header(p["draft_model"]) if p["draft_model"] else None
    except (OSError, ValueError, GGUFError) as exc:
        module.fail_json(msg=f"cannot read the artifact: {exc}")
    manifest_bytes = sum(int(t["bytes"]) for t in manifest.get("types", {}).values())
    header_bytes = sum(tensor.bytes for tensor in main_header["tensors"])
    if manifest_bytes and manifest_bytes != header_bytes:
        module.fail_json(msg=f"{p['model']}: the manifest says {manifest_bytes} bytes of weights, the file has "
                             f"{header_bytes}; the models role should remake it")
    try:
        result = estimate(main_header, draft_header, p)
    except GGUFError as exc:
        module.fail_json(msg=f"{p['model']}: {exc}")
    result["weights_total_mib"] = round(header_bytes / MIB, 1)
    result["sha256"] = manifest.get("sha256", "")
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
