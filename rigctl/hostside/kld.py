"""KL divergence of a quantised model against its reference, as llama.cpp's ``llama-perplexity`` computes it.
Standard library only: the KLD job (:mod:`rigctl.hostside.kld_task`) runs it on the host, the controller reads
the same files with it.

**The instrument** (``tools/perplexity/perplexity.cpp`` at the pinned build, b11434). The text is tokenized
whole and cut into ``n_chunk`` chunks of ``n_ctx`` tokens (BOS in place of each chunk's first token where the
vocabulary adds one); in every chunk the next-token distribution is scored at the last ``n_ctx - 1 - n_ctx/2``
positions, so each scored token has at least half a context before it. ``--kl-divergence-base FILE`` on the
reference model writes every scored position's log-probabilities to FILE (below); ``--kl-divergence`` with
that file on the quantised model then computes, per scored token,

    KLD = sum over the vocabulary where log p_ref > -16 of  p_ref * (log p_ref - log p_q)

(the reference's log-probabilities as stored, the quantised model's from its float logits), and whether
both models' most likely token is the same (the first of equal maxima, each side). It prints the mean KLD
with its standard error, percentiles of the sorted per-token values (``percentile``: linear between order
statistics at ``fraction * (n - 1)``), and "Same top p" with its binomial standard error; only the summary,
never the per-token values, and nothing at all below 100 scored tokens. It returns 0 even when it fails
half-way (it logs and returns), so a run is judged by what it printed (:func:`parse_output`).

**The per-token values** an interval needs come from a second file of the same layout written by the
quantised model (``--kl-divergence-base`` in perplexity mode, through a FIFO: it never touches the disk):
:func:`token_values` applies llama.cpp's formula to the two files. The one difference is that the quantised
side is llama.cpp's stored log-probability, rounded to 1/65535 of its row's range (at most 16 nats: about
1.2e-4 nats) and floored 16 nats below its top, where llama.cpp uses the float logits; the mean and
percentiles agree with llama-perplexity's to about 1e-4 (the job records both and the difference).

**The logits file** (little-endian), as llama-perplexity writes it::

    "_logits_"  uint32 n_ctx  int32 n_vocab  int32 n_chunk  int32 tokens[n_chunk * n_ctx]
    per chunk, per scored position: float scale, float min_log_prob, uint16 q[nv - 4]
        (nv = 2 * ((n_vocab + 1) / 2) + 4; log p_i = scale * q_i + min_log_prob; q = 0 below the floor)

so it holds ``n_chunk * (n_ctx - 1 - n_ctx/2) * nv * 2`` bytes besides its header (:func:`logits_file_bytes`):
98 KB a scored token over a 49k vocabulary (25 MB a chunk at llama-perplexity's default ``-c 512``), 500 KB
over a 248k one (127 MB a chunk).
"""

from __future__ import annotations

import math
import re
import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import compress, repeat
from operator import mul
from typing import Any, BinaryIO

MAGIC = b"_logits_"
#: llama.cpp sums the reference's probability mass only where its log-probability is above this.
LOG_PROB_FLOOR = -16.0
#: Fewer scored tokens than this and llama-perplexity prints no statistics.
MIN_SCORED_TOKENS = 100
_HEAD = struct.Struct("<Iii")
_ROW_HEAD = struct.Struct("<ff")


class LogitsFileError(ValueError):
    """A logits file that is not what llama-perplexity writes, or two that do not pair."""


def scored_per_chunk(n_ctx: int) -> int:
    """Positions scored in each chunk: the second half of the context, less the last token."""
    return n_ctx - 1 - n_ctx // 2


def row_values(n_vocab: int) -> int:
    """uint16 values per scored position in the file (two floats, the vocabulary padded to even)."""
    return 2 * ((n_vocab + 1) // 2) + 4


def logits_file_bytes(n_ctx: int, n_vocab: int, n_chunk: int) -> int:
    """The size of the file llama-perplexity writes for these dimensions: header, tokens, log-probabilities."""
    return len(MAGIC) + _HEAD.size + 4 * n_chunk * n_ctx + n_chunk * scored_per_chunk(n_ctx) * row_values(n_vocab) * 2


@dataclass(frozen=True)
class LogitsHeader:
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: array  # int32, n_chunk * n_ctx

    @property
    def scored(self) -> int:
        return scored_per_chunk(self.n_ctx)

    def scored_tokens(self, chunk: int) -> array:
        """The tokens whose probability is scored in ``chunk``: each scored position predicts the next one."""
        start = chunk * self.n_ctx + self.n_ctx // 2 + 1
        return self.tokens[start:start + self.scored]


def read_header(stream: BinaryIO, origin: str) -> LogitsHeader:
    """The header of a logits file (or FIFO) at ``stream``'s start; LogitsFileError naming ``origin``."""
    if _read_exactly(stream, len(MAGIC), origin) != MAGIC:
        raise LogitsFileError(f"{origin}: not a llama-perplexity logits file (no {MAGIC.decode()} magic)")
    n_ctx, n_vocab, n_chunk = _HEAD.unpack(_read_exactly(stream, _HEAD.size, origin))
    if not (4 <= n_ctx <= 1 << 22 and 1 <= n_vocab <= 1 << 24 and 1 <= n_chunk <= 1 << 20):
        raise LogitsFileError(f"{origin}: implausible header n_ctx={n_ctx} n_vocab={n_vocab} n_chunk={n_chunk}")
    tokens = _values("i", _read_exactly(stream, 4 * n_ctx * n_chunk, origin))
    return LogitsHeader(n_ctx, n_vocab, n_chunk, tokens)


def _read_exactly(stream: BinaryIO, size: int, origin: str) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise LogitsFileError(f"{origin}: ends after {len(data)} of {size} bytes (the writer stopped early)")
    return data


def _values(code: str, data: bytes) -> array:
    """``data`` as an array of ``code``: llama.cpp writes its native order, and it runs little-endian."""
    values = array(code)
    values.frombytes(data)
    return values


def check_pair(reference: LogitsHeader, quantised: LogitsHeader, origin: str) -> None:
    """The two files must score the same tokens of the same text with the same vocabulary."""
    for field in ("n_ctx", "n_vocab", "n_chunk"):
        if getattr(reference, field) != getattr(quantised, field):
            raise LogitsFileError(f"{origin}: {field} {getattr(quantised, field)} but the reference's is "
                                  f"{getattr(reference, field)}")
    if reference.tokens != quantised.tokens:
        raise LogitsFileError(f"{origin}: the text tokenizes differently than for the reference "
                              "(another tokenizer: KLD is only defined over one token stream)")


def read_chunk(stream: BinaryIO, header: LogitsHeader, origin: str) -> array:
    """One chunk's log-probability rows (uint16, ``scored * nv``)."""
    return _values("H", _read_exactly(stream, header.scored * row_values(header.n_vocab) * 2, origin))


@dataclass(frozen=True)
class TokenValue:
    """What llama.cpp computes for one scored token (its ``log_softmax`` with a base row)."""

    kld: float
    same_top: bool
    nll: float  # -log p_q(next token)
    nll_base: float


def token_value(base: array, quant: array, offset: int, n_vocab: int, token: int) -> TokenValue:
    """llama.cpp's per-token KLD and top-1 agreement from the rows at ``offset`` of a reference and a
    quantised chunk (:func:`read_chunk`), in C-speed passes (bytes, ``map``) rather than a Python loop over
    the vocabulary. The sum runs over the tokens whose reference log-probability is above
    :data:`LOG_PROB_FLOOR`: stored values are monotone in it, so those are the ``q`` above one threshold; and
    with ``log p_ref = scale * q + min``, ``sum p_ref * (log p_ref - log p_q)`` is ``e^min`` times sums over
    ``e^(scale * q)``."""
    scale_b, min_b = _ROW_HEAD.unpack(base[offset:offset + 4].tobytes())
    scale_q, min_q = _ROW_HEAD.unpack(quant[offset:offset + 4].tobytes())
    b = base[offset + 4:offset + 4 + n_vocab]
    q = quant[offset + 4:offset + 4 + n_vocab]
    b_bytes = b.tobytes()
    if scale_b > 0:
        kept = _above(b, b_bytes, math.floor((LOG_PROB_FLOOR - min_b) / scale_b))
    else:  # a flat row: llama.cpp stored zeros, every log p_ref is min_b
        kept = bytes([min_b > LOG_PROB_FLOOR]) * n_vocab
    kept_b = list(compress(b, kept))
    weights = list(map(math.exp, map(mul, kept_b, repeat(scale_b))))  # p_ref / e^min_b
    mass = math.exp(min_b)
    total = sum(weights)
    kld = mass * (scale_b * sum(map(mul, weights, kept_b)) - scale_q * sum(map(mul, weights, compress(q, kept)))
                  + (min_b - min_q) * total)
    return TokenValue(kld=kld, same_top=_top(b, b_bytes) == _top(q, q.tobytes()),
                      nll=-(scale_q * q[token] + min_q), nll_base=-(scale_b * b[token] + min_b))


#: High byte of a uint16 against a threshold's high byte: 1 above, 2 equal (decided value by value), 0 below.
_ABOVE_TABLES: dict[int, bytes] = {}


def _above(values: array, raw: bytes, threshold: int) -> bytearray:
    """1 where ``values[i] > threshold``, else 0: decided on the high bytes (``bytes.translate``), and only
    the values sharing the threshold's high byte one by one."""
    if threshold < 0:
        return bytearray(b"\1") * len(values)
    if threshold >= 0xFFFF:
        return bytearray(len(values))
    high = threshold >> 8
    table = _ABOVE_TABLES.get(high)
    if table is None:
        table = _ABOVE_TABLES[high] = bytes(0 if h < high else 2 if h == high else 1 for h in range(256))
    mask = bytearray(raw[1::2].translate(table))
    at = mask.find(2)
    while at >= 0:
        mask[at] = values[at] > threshold
        at = mask.find(2, at + 1)
    return mask


def _top(values: array, raw: bytes) -> int:
    """The index of the first maximum, as llama.cpp's loop finds it: a row's top is stored as 65535, found
    by a byte search at an even offset; any other row by ``max``."""
    at = raw.find(b"\xff\xff")
    while at >= 0 and at % 2:
        at = raw.find(b"\xff\xff", at + 1)
    return at // 2 if at >= 0 else values.index(max(values))


def chunk_values(header: LogitsHeader, base: array, quant: array, chunk: int) -> list[TokenValue]:
    nv = row_values(header.n_vocab)
    targets = header.scored_tokens(chunk)
    return [token_value(base, quant, i * nv, header.n_vocab, targets[i]) for i in range(header.scored)]


def paired_chunks(reference: BinaryIO, quantised: BinaryIO, origin: str
                  ) -> tuple[LogitsHeader, Iterator[tuple[int, list[TokenValue]]]]:
    """The header and, chunk by chunk, llama.cpp's per-token values for a reference file and a quantised
    model's file (or FIFO) of the same tokens."""
    ref_header = read_header(reference, f"{origin} (reference)")
    q_header = read_header(quantised, origin)
    check_pair(ref_header, q_header, origin)

    def chunks() -> Iterator[tuple[int, list[TokenValue]]]:
        for chunk in range(ref_header.n_chunk):
            base = read_chunk(reference, ref_header, f"{origin} (reference)")
            quant = read_chunk(quantised, q_header, origin)
            yield chunk, chunk_values(ref_header, base, quant, chunk)

    return ref_header, chunks()


# ----------------------------------------------------------------------------------------------- statistics


def percentile(sorted_values: list[float], fraction: float) -> float:
    """llama-perplexity's percentile of sorted values: linear between the order statistics around
    ``fraction * (n - 1)`` (numpy's default ``linear`` method)."""
    if fraction <= 0:
        return sorted_values[0]
    if fraction >= 1:
        return sorted_values[-1]
    position = fraction * (len(sorted_values) - 1)
    below = int(position)
    weight = position - below
    return (1 - weight) * sorted_values[below] + weight * sorted_values[min(below + 1, len(sorted_values) - 1)]


def mean_and_uncertainty(values: list[float]) -> tuple[float, float]:
    """The mean and llama.cpp's standard error of it (``sqrt((E[x^2] - E[x]^2) / (n - 1))``, 0 up to 10 values)."""
    count = len(values)
    if not count:
        return 0.0, 0.0
    mean = math.fsum(values) / count
    spread = math.fsum(v * v for v in values) / count - mean * mean
    return mean, math.sqrt(spread / (count - 1)) if spread > 0 and count > 10 else 0.0


def summarise(kld: list[float], same_top: list[int]) -> dict[str, float | int]:
    """Mean KLD (with llama.cpp's standard error), its 99th percentile, its median and maximum, and the
    same-top-1 share, as llama-perplexity computes them from its per-token values."""
    ordered = sorted(kld)
    mean, se = mean_and_uncertainty(kld)
    return {"tokens": len(kld), "kld_mean": mean, "kld_mean_se": se, "kld_p99": percentile(ordered, 0.99),
            "kld_median": percentile(ordered, 0.5), "kld_max": ordered[-1] if ordered else math.nan,
            "same_top": sum(same_top) / len(same_top) if same_top else math.nan}


# ----------------------------------------------------------------------------------------------- its output

#: The statistics of ``llama-perplexity --kl-divergence`` this module reads, by (section, label).
MEAN_KLD = ("KL divergence statistics", "Mean KLD")
P99_KLD = ("KL divergence statistics", "99.0% KLD")
SAME_TOP = ("Token probability statistics", "Same top p")
PPL_RATIO = ("Perplexity statistics", "Mean PPL(Q)/PPL(base)")
_SECTION = re.compile(r"^====== (?P<title>.+?) ======$")
_NUMBER = r"-?(?:\d+\.?\d*|nan|inf)"
_STATISTIC = re.compile(rf"^(?P<label>[^:]+?)\s*:\s*(?P<value>{_NUMBER})\s*(?:±\s*(?P<unc>{_NUMBER}))?\s*(?P<pct>%)?$")
_CHUNK = re.compile(rf"^\s*(?P<chunk>\d+)((?:\s+{_NUMBER}\s+±\s+{_NUMBER}\s*%?){{5}})\s*$")
_PAIR = re.compile(rf"({_NUMBER})\s+±\s+({_NUMBER})")
CHUNK_COLUMNS = ("ppl", "ln_ppl_ratio", "kld", "dp_rms_pct", "same_top_pct")


def parse_output(text: str) -> dict[str, Any]:
    """llama-perplexity ``--kl-divergence``'s standard output: ``chunks`` (its running table: per chunk the
    cumulative PPL(Q), ln(PPL(Q)/PPL(base)), KLD, RMS Δp and same-top %, each ``[value, uncertainty]``) and
    ``statistics`` (``{section: {label: {"value", "uncertainty", "percent"}}}``, labels with their runs of
    spaces collapsed: ``Mean KLD``, ``99.0% KLD``, ``Same top p``). ValueError when there are no statistics
    (fewer than 100 scored tokens, or a run that stopped: llama-perplexity exits 0 either way)."""
    chunks: list[dict[str, Any]] = []
    statistics: dict[str, dict[str, dict[str, Any]]] = {}
    section: dict[str, dict[str, Any]] | None = None
    for line in text.splitlines():
        line = line.rstrip()
        if match := _SECTION.match(line):
            section = statistics.setdefault(match["title"], {})
        elif section is not None and (match := _STATISTIC.match(line)):
            label = " ".join(match["label"].split())
            section[label] = {"value": float(match["value"]),
                              "uncertainty": float(match["unc"]) if match["unc"] is not None else None,
                              "percent": match["pct"] is not None}
        elif section is None and (match := _CHUNK.match(line)):
            pairs = _PAIR.findall(match[2])
            chunks.append({"chunk": int(match["chunk"]),
                           **{name: [float(v), float(u)] for name, (v, u) in zip(CHUNK_COLUMNS, pairs, strict=True)}})
    if [c["chunk"] for c in chunks] != list(range(1, len(chunks) + 1)):
        raise ValueError("the chunk table's rows are not numbered 1, 2, ...")
    for section_title, label in (MEAN_KLD, P99_KLD, SAME_TOP):
        if label not in statistics.get(section_title, {}):
            reason = "no chunk scored" if not chunks else \
                f"{len(chunks)} chunks scored, but fewer than {MIN_SCORED_TOKENS} tokens or the run stopped"
            raise ValueError(f"no '{label}' statistic in llama-perplexity's output ({reason})")
    return {"chunks": chunks, "statistics": statistics}


def statistic(parsed: dict[str, Any], key: tuple[str, str]) -> dict[str, Any]:
    return parsed["statistics"][key[0]][key[1]]


def headline(parsed: dict[str, Any]) -> dict[str, float | None]:
    """Mean KLD (and its standard error), its 99th percentile and the same-top-1 share (a fraction), as
    llama-perplexity printed them."""
    mean, p99, same = (statistic(parsed, key) for key in (MEAN_KLD, P99_KLD, SAME_TOP))
    ratio = parsed["statistics"].get(PPL_RATIO[0], {}).get(PPL_RATIO[1])
    return {"kld_mean": mean["value"], "kld_mean_se": mean["uncertainty"], "kld_p99": p99["value"],
            "same_top": same["value"] / 100, "same_top_se": (same["uncertainty"] or 0.0) / 100,
            "ppl_ratio": ratio["value"] if ratio else None}
