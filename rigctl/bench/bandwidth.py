"""The memory-bandwidth bound on decode speed: what a tg figure claims of the card.

Generating one token reads every weight once and the KV cache of every token already in the
context, so ``bandwidth / bytes read per token`` is the fastest decode the card can physically do.
A measured tg figure is reported as a share of that bound; above 100 % it is impossible (a
measurement or inventory error) and is flagged, never printed as a result.

* weights: every tensor's bytes from the artifact's manifest (``types``), as llama.cpp reads them
  per token (an untied token embedding, read one row a token, makes this a slight over-count);
* KV per token of context: ``n_layer x n_head_kv x (key_length x bytes(type_k) + value_length x
  bytes(type_v))`` from the GGUF shape the bench task recorded, with the cache types llama-bench ran;
* the context while a tg test generates: its depth plus, on average, half the tokens it generates;
* the bandwidth: the inventory's ``gpu_host_gpu.bandwidth_gbs`` (GB/s, 10^9 bytes), recorded in the run.

There is no figure (and the reason says why) for a run without a bandwidth, a CPU run
(``-ngl 0``), a model only partly offloaded, or an artifact without manifest or shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Bytes per element of llama.cpp's KV cache types (block formats: bytes per block / 32 elements).
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                    "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}
NO_FIGURE = "no bandwidth figure"


@dataclass(frozen=True)
class DecodeBound:
    """One tg figure against the bound; ``fraction`` None (and ``reason`` set) where there is no figure."""

    tokens_per_s: float
    bandwidth_gbs: float | None = None
    weights_bytes: int | None = None
    kv_bytes_per_token: float | None = None  # per token of context
    context_tokens: float = 0.0
    bytes_per_token: float | None = None
    bound_tokens_per_s: float | None = None
    fraction: float | None = None
    reason: str | None = None

    @property
    def impossible(self) -> bool:
        return self.fraction is not None and self.fraction > 1.0

    def text(self) -> str:
        """``23.1 % of 224 GB/s``, ``IMPOSSIBLE: 134 % of ...`` or ``no bandwidth figure (why)``."""
        if self.fraction is None:
            return f"{NO_FIGURE} ({self.reason})"
        share = f"{self.fraction:.1%} of the {self.bound_tokens_per_s:.1f} t/s that {self.bandwidth_gbs:g} GB/s allows"
        return f"IMPOSSIBLE: {share} (a measurement or inventory error)" if self.impossible else share


def weights_bytes(artifact: Mapping[str, Any]) -> int | None:
    """Every tensor's bytes from a run record's artifact entry (its manifest's ``types``)."""
    manifest = artifact.get("manifest") or {}
    types = manifest.get("types") if isinstance(manifest, Mapping) else None
    if not isinstance(types, Mapping) or not types:
        return None
    try:
        return sum(int(t["bytes"]) for t in types.values())
    except (KeyError, TypeError, ValueError):
        return None


def _per_layer(value: Any, layers: int) -> list[float] | None:
    if isinstance(value, list):
        return [float(v) for v in value] if len(value) == layers else None
    return [float(value)] * layers if isinstance(value, int | float) else None


def kv_bytes_per_token(shape: Mapping[str, Any] | None, type_k: str, type_v: str) -> float | None:
    """KV-cache bytes each token of context takes, from the GGUF shape; None when it cannot be told."""
    if not shape or type_k not in CACHE_TYPE_BYTES or type_v not in CACHE_TYPE_BYTES:
        return None
    try:
        layers = int(shape["block_count"])
        heads = shape["attention.head_count"]
        head_dim = float(shape["embedding_length"]) / float(heads if isinstance(heads, int | float) else max(heads))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    kv_heads = _per_layer(shape.get("attention.head_count_kv", heads), layers)
    if kv_heads is None:
        return None
    key = float(shape.get("attention.key_length", head_dim))
    value = float(shape.get("attention.value_length", head_dim))
    per_head = key * CACHE_TYPE_BYTES[type_k] + value * CACHE_TYPE_BYTES[type_v]
    return sum(kv_heads) * per_head


def decode_bound(tokens_per_s: float, *, bandwidth_gbs: float | None, artifact: Mapping[str, Any],
                 entry: Mapping[str, Any]) -> DecodeBound:
    """A tg figure against the bound; ``artifact``: the run record's entry (manifest, gguf shape);
    ``entry``: llama-bench's test object (n_gen, n_depth, n_gpu_layers, type_k, type_v)."""
    if bandwidth_gbs is None:
        return DecodeBound(tokens_per_s, reason="the inventory gives this GPU no gpu_host_gpu.bandwidth_gbs")
    shape = artifact.get("gguf") or {}
    ngl = int(entry.get("n_gpu_layers", 0) or 0)
    if ngl == 0:
        return DecodeBound(tokens_per_s, bandwidth_gbs, reason="a CPU run (-ngl 0)")
    layers = shape.get("block_count")
    if isinstance(layers, int) and ngl < layers + 1 and ngl < 99:
        return DecodeBound(tokens_per_s, bandwidth_gbs, reason=f"only {ngl} of {layers + 1} layers on the GPU")
    weights = weights_bytes(artifact)
    if weights is None:
        return DecodeBound(tokens_per_s, bandwidth_gbs, reason="the artifact has no manifest with tensor sizes")
    kv = kv_bytes_per_token(shape, str(entry.get("type_k", "f16")), str(entry.get("type_v", "f16")))
    if kv is None:
        return DecodeBound(tokens_per_s, bandwidth_gbs, weights, reason="the model's attention shape is unknown")
    context = float(entry.get("n_depth", 0) or 0) + float(entry.get("n_gen", 0) or 0) / 2
    per_token = weights + kv * context
    bound = bandwidth_gbs * 1e9 / per_token
    return DecodeBound(tokens_per_s, bandwidth_gbs, weights, kv, context, per_token, bound, tokens_per_s / bound)
