"""What a pulled KLD run says: per quantised artifact, llama-perplexity's mean KLD, its 99th percentile and the
same-top-1 share against the reference, each with a bootstrap interval; and paired differences between two
artifacts (or two hosts) scored on the same tokens.

The point estimates are llama-perplexity's own, as it printed them (``extra.kld.models[m].llama_perplexity``).
Their intervals resample the per-token values the job recomputed from the two models' logits files
(``kld/<model>.tokens.jsonl``, :mod:`rigctl.hostside.kld`), which agree with llama.cpp's to about 1e-4 on the
mean; the 99th percentile of the recomputed values runs lower, by up to half a percent (SmolLM2 Q4_0 over the
lab's text: 3.0347 against 3.0480), because the quantised model's stored log-probabilities are floored 16 nats
below its top, and the tail's tokens are where it puts less than that on what the reference expects. The run
records every difference, and the intervals are moved by it onto llama.cpp's estimates.

Tokens are resampled in whole chunks (:func:`rigctl.stats.bootstrap_clusters`): the tokens of one chunk share
one context, so they are not independent draws, and an interval over tokens would be too narrow. With few
chunks (the lab's text gives 17) the intervals are rough; ``n`` in each says how many chunks it rests on.

A paired difference (B - A) needs both sides scored on the same token stream against the same reference: the
same ``tokens_sha256`` (the token ids llama-perplexity scored), reference sha256 and context; then every token
is a pair, and the chunks are resampled alike for both.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rigctl.errors import ConfigError
from rigctl.hostside.kld_task import RAW_DIR
from rigctl.results.store import StoredRun, read_run_jsonl
from rigctl.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, Interval, bootstrap_clusters
from rigctl.trust import relative_path

log = logging.getLogger(__name__)

#: The percentile llama-perplexity prints that the summary carries (numpy's linear method is llama.cpp's).
TAIL = 99.0


def _mean(draws: np.ndarray) -> np.ndarray:
    return draws.mean(axis=1)


def _tail(draws: np.ndarray) -> np.ndarray:
    return np.percentile(draws, TAIL, axis=1)


def _mean_gap(draws: np.ndarray) -> np.ndarray:
    return draws[..., 1].mean(axis=1) - draws[..., 0].mean(axis=1)


def _tail_gap(draws: np.ndarray) -> np.ndarray:
    return np.percentile(draws[..., 1], TAIL, axis=1) - np.percentile(draws[..., 0], TAIL, axis=1)


@dataclass(frozen=True)
class TokenValues:
    """One artifact's per-token values in one run: ``(chunks, scored per chunk)`` each."""

    kld: np.ndarray
    same_top: np.ndarray


def kld_extra(run: StoredRun) -> dict[str, Any]:
    """The run's ``extra.kld``; ConfigError when it is not a finished KLD run."""
    if run.record.kind != "kld":
        raise ConfigError(f"{run.host}/{run.id} is a {run.record.kind} run, not a kld run")
    extra = run.record.extra.get("kld")
    if not isinstance(extra, dict) or not isinstance(extra.get("models"), dict):
        raise ConfigError(f"{run.host}/{run.id}: no KLD results in its record ({run.record.status})")
    return extra


def load_tokens(run: StoredRun, model: str) -> TokenValues:
    """``kld/<model>.tokens.jsonl`` of ``run`` as arrays; ConfigError naming the file when its chunks are not
    numbered 0, 1, ... or not all of the run's length."""
    # The model's name is the record's, which the host wrote: `../../<another run>` must not reach another
    # run's (or host's) files, nor may a link in the run (the store reads from its own fds, link-free).
    name = str(relative_path(f"{RAW_DIR}/{model}.tokens.jsonl", f"{run.host}/{run.id}: KLD model {model!r}"))
    path = run.path / name
    extra = kld_extra(run)
    per_chunk = extra.get("scored_per_chunk")
    rows = read_run_jsonl(run, name)
    kld_rows, same_rows = [], []
    for number, row in enumerate(rows):
        kld, same = row.get("kld"), row.get("same_top")
        if row.get("chunk") != number or not isinstance(kld, list) or not isinstance(same, list) \
                or len(kld) != per_chunk or len(same) != per_chunk:
            raise ConfigError(f"{path}: line {number + 1}: not chunk {number} with {per_chunk} kld and same_top "
                              "values")
        try:
            kld_rows.append([float(v) for v in kld])
            same_rows.append([1.0 if v == 1 else 0.0 if v == 0 else math.nan for v in same])
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: line {number + 1}: a value is not a number") from None
    values = TokenValues(np.asarray(kld_rows, dtype=np.float64).reshape(len(rows), per_chunk or 0),
                         np.asarray(same_rows, dtype=np.float64).reshape(len(rows), per_chunk or 0))
    if not np.isfinite(values.kld).all() or not np.isfinite(values.same_top).all():
        raise ConfigError(f"{path}: a kld value that is not finite, or a same_top that is not 0 or 1")
    if len(rows) != extra.get("chunks_scored"):
        raise ConfigError(f"{path}: {len(rows)} chunks, but the run scored {extra.get('chunks_scored')}")
    return values


@dataclass(frozen=True)
class KldResult:
    """One quantised artifact against the reference, in one run on one host."""

    host: str
    run_id: str
    reference: str
    artifact: str
    corpus: str
    ctx: int
    chunks: int
    tokens: int
    tokens_sha256: str
    reference_sha256: str | None
    printed: dict[str, Any]  # llama-perplexity's: kld_mean, kld_mean_se, kld_p99, same_top, same_top_se, ppl_ratio
    difference: dict[str, float]  # recomputed - printed
    mean: Interval
    p99: Interval
    same_top: Interval

    @property
    def name(self) -> str:
        return f"{self.host}/{self.run_id}"

    @staticmethod
    def interval(estimate: float, interval: Interval) -> Interval:
        """The bootstrap ``interval`` of a recomputed statistic moved onto llama-perplexity's own ``estimate``
        (by their difference: the recomputation's bias, far below the interval's width)."""
        shift = estimate - interval.estimate if not interval.empty else 0.0
        return Interval(estimate, interval.low + shift, interval.high + shift, interval.n, interval.resamples,
                        interval.level, interval.method)


def kld_results(run: StoredRun, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED
                ) -> list[KldResult]:
    """Every quantised artifact of a KLD run, with intervals over its chunks."""
    extra = kld_extra(run)
    reference = extra.get("reference")
    ref_sha = next((a.sha256 for a in run.record.artifacts if a.name == reference), None)
    out = []
    for model, entry in extra["models"].items():
        values = load_tokens(run, model)
        out.append(KldResult(
            host=run.host, run_id=run.id, reference=str(reference), artifact=str(model),
            corpus=str((extra.get("corpus") or {}).get("name") or "?"), ctx=int(extra.get("ctx") or 0),
            chunks=values.kld.shape[0], tokens=values.kld.size, tokens_sha256=str(extra.get("tokens_sha256")),
            reference_sha256=ref_sha, printed=dict(entry.get("llama_perplexity") or {}),
            difference=dict(entry.get("difference") or {}),
            mean=bootstrap_clusters(values.kld, _mean, resamples=resamples, seed=seed),
            p99=bootstrap_clusters(values.kld, _tail, resamples=resamples, seed=seed),
            same_top=bootstrap_clusters(values.same_top, _mean, resamples=resamples, seed=seed),
        ))
    return out


@dataclass(frozen=True)
class KldGap:
    """B - A on the same tokens against the same reference: mean KLD, p99 KLD, same-top-1 share."""

    a: KldResult
    b: KldResult
    mean: Interval
    p99: Interval
    same_top: Interval


def pair_mismatch(a: KldResult, b: KldResult) -> str | None:
    """Why two results cannot be paired token by token, or None."""
    if a.tokens_sha256 != b.tokens_sha256 or a.ctx != b.ctx:
        return (f"{a.name} and {b.name} scored different tokens (text {a.corpus} / {b.corpus}, context "
                f"{a.ctx} / {b.ctx})")
    if a.reference_sha256 != b.reference_sha256:
        return f"{a.name} and {b.name} measured against different references ({a.reference} / {b.reference})"
    return None


def kld_gap(run_a: StoredRun, a: KldResult, run_b: StoredRun, b: KldResult, *,
            resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> KldGap:
    """The paired difference B - A; ConfigError when they did not score the same tokens."""
    problem = pair_mismatch(a, b)
    if problem:
        raise ConfigError(problem)
    values_a, values_b = load_tokens(run_a, a.artifact), load_tokens(run_b, b.artifact)
    kld = np.stack([values_a.kld, values_b.kld], axis=-1)
    same = np.stack([values_a.same_top, values_b.same_top], axis=-1)
    return KldGap(a, b, mean=bootstrap_clusters(kld, _mean_gap, resamples=resamples, seed=seed),
                  p99=bootstrap_clusters(kld, _tail_gap, resamples=resamples, seed=seed),
                  same_top=bootstrap_clusters(same, _mean_gap, resamples=resamples, seed=seed))


def kld_text(interval: Interval, digits: int = 4) -> str:
    """A KLD with its interval: ``0.2968 (0.2801 to 0.3150)``; ``-`` when empty."""
    if interval.empty:
        return "-"
    return f"{interval.estimate:.{digits}f} ({interval.low:.{digits}f} to {interval.high:.{digits}f})"


def signed_kld_text(interval: Interval, digits: int = 4) -> str:
    if interval.empty:
        return "-"
    return f"{interval.estimate:+.{digits}f} ({interval.low:+.{digits}f} to {interval.high:+.{digits}f})"


def share_text(interval: Interval, signed: bool = False) -> str:
    """A share in percent with its interval: ``70.4 % (66.1 to 74.6)``."""
    if interval.empty:
        return "-"
    sign = "+" if signed else ""
    return (f"{interval.estimate * 100:{sign}.1f} % ({interval.low * 100:{sign}.1f} to "
            f"{interval.high * 100:{sign}.1f})")


ROW_HEADER = ("host", "artifact", "vs", "chunks × tokens", "mean KLD (95%)", "p99 KLD (95%)",
              "same top-1 (95%)", "PPL(Q)/PPL(ref)")


def result_cells(result: KldResult) -> list[str]:
    """llama-perplexity's numbers, each with its bootstrap interval over chunks."""
    printed = result.printed
    ratio = printed.get("ppl_ratio")
    per_chunk = result.tokens // max(result.chunks, 1)
    return [result.host, result.artifact, result.reference, f"{result.chunks} × {per_chunk}",
            kld_text(result.interval(float(printed["kld_mean"]), result.mean)),
            kld_text(result.interval(float(printed["kld_p99"]), result.p99)),
            share_text(result.interval(float(printed["same_top"]), result.same_top)),
            "-" if ratio is None else f"{float(ratio):.4f}"]


GAP_HEADER = ("B - A", "Δ mean KLD (95%)", "Δ p99 KLD (95%)", "Δ same top-1 (95%)")


def gap_name(gap: KldGap, label: Callable[[str], str] = str) -> str:
    """``laptop - desktop (Q4_0)`` for one artifact on two hosts, ``Q4_K_M - Q4_0 (desktop)`` for two
    artifacts on one host."""
    a, b = gap.a, gap.b
    if a.artifact == b.artifact:
        return f"{b.host} - {a.host} ({label(a.artifact)})"
    if a.host == b.host:
        return f"{label(b.artifact)} - {label(a.artifact)} ({a.host})"
    return f"{b.host}:{label(b.artifact)} - {a.host}:{label(a.artifact)}"


def gap_cells(gap: KldGap, label: Callable[[str], str] = str) -> list[str]:
    return [gap_name(gap, label), signed_kld_text(gap.mean), signed_kld_text(gap.p99),
            share_text(gap.same_top, signed=True)]


def paired_gaps(scored: Sequence[tuple[StoredRun, KldResult]], *, resamples: int = DEFAULT_RESAMPLES,
                seed: int = DEFAULT_SEED) -> list[KldGap]:
    """B - A for every two results (in the given order) that scored the same tokens against the same
    reference."""
    return [kld_gap(run_a, a, run_b, b, resamples=resamples, seed=seed)
            for i, (run_a, a) in enumerate(scored) for run_b, b in scored[i + 1:] if pair_mismatch(a, b) is None]


def largest_difference(results: Sequence[KldResult]) -> float:
    """The largest gap between a recomputed statistic and llama-perplexity's (0 when none is recorded)."""
    return max((abs(float(v)) for r in results for v in r.difference.values()), default=0.0)
