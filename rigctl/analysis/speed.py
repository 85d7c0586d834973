"""Speed ratios of bench runs: per test and model, b's mean t/s over a's with a bootstrap interval over the
per-repetition samples of the unthrottled cells."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rigctl.bench.matrix import RAW_DIR, BenchSample, counted, load_run_samples
from rigctl.errors import ConfigError
from rigctl.results.store import StoredRun
from rigctl.stats import (
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    Interval,
    bootstrap_ratio,
)


def sample_file(sample: BenchSample) -> str:
    """The raw llama-bench JSON a sample came from, relative to the results root (bench_task's layout)."""
    return f"{sample.host}/{sample.run_id}/{RAW_DIR}/cell-{sample.cell:03d}-{sample.model}.json"


@dataclass(frozen=True)
class SpeedRatio:
    test: str
    config: str  # llama-bench settings held equal on both sides (ngl, threads, cache types)
    flash_attn: int
    a: str  # side labels
    b: str
    mean_a: float
    mean_b: float
    ratio: Interval  # mean_b / mean_a
    files: tuple[str, ...]  # raw files (relative to the results root) the numbers came from


@dataclass(frozen=True)
class BenchComparison:
    a: str
    b: str
    ratios: tuple[SpeedRatio, ...]


def _pool(samples: Iterable[BenchSample]) -> dict[tuple[str, str, int], list[BenchSample]]:
    grouped: dict[tuple[str, str, int], list[BenchSample]] = {}
    for sample in samples:
        grouped.setdefault((sample.test, sample.config, sample.flash_attn), []).append(sample)
    return grouped


def compare_bench(a_label: str, a_samples: Sequence[BenchSample], b_label: str, b_samples: Sequence[BenchSample], *,
                  resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> BenchComparison:
    """Per test with equal settings: mean t/s of B over A; every repetition of a side's cells is pooled,
    throttled cells left out where the side has others."""
    pool_a, pool_b = _pool(a_samples), _pool(b_samples)
    ratios = []
    for key in sorted(set(pool_a) & set(pool_b), key=lambda k: (k[0], k[1], -k[2])):
        pool_a[key], pool_b[key] = counted(pool_a[key]), counted(pool_b[key])
        sa = [x for c in pool_a[key] for x in c.samples_ts]
        sb = [x for c in pool_b[key] for x in c.samples_ts]
        files = tuple(sorted({sample_file(c) for c in [*pool_a[key], *pool_b[key]]}))
        ratios.append(SpeedRatio(test=key[0], config=key[1], flash_attn=key[2], a=a_label, b=b_label,
                                 mean_a=sum(sa) / len(sa) if sa else float("nan"),
                                 mean_b=sum(sb) / len(sb) if sb else float("nan"),
                                 ratio=bootstrap_ratio(sa, sb, resamples=resamples, seed=seed), files=files))
    return BenchComparison(a=a_label, b=b_label, ratios=tuple(ratios))


def compare_bench_runs(runs: Sequence[StoredRun], *, by: str = "auto", resamples: int = DEFAULT_RESAMPLES,
                       seed: int = DEFAULT_SEED) -> BenchComparison:
    """Two sides from bench runs: two runs (``by="run"``: two hosts or builds), the two models inside
    the runs (``by="model"``: an alternating A/B bench) or two builds (``by="build"``). ``auto`` takes
    models when the runs hold exactly two, else runs. B / A with A the first in sorted order (models,
    builds) or the first run given."""
    if not runs:
        raise ConfigError("compare needs at least one bench run")
    samples = [s for run in runs for s in load_run_samples(run)]
    if not samples:
        raise ConfigError(f"no llama-bench results in {', '.join(f'{r.host}/{r.id}' for r in runs)}")
    models = sorted({s.model for s in samples})
    if by == "auto":
        by = "model" if len(models) == 2 else "run"
    if by in ("model", "build"):
        sides = models if by == "model" else sorted({s.build for s in samples})
        if len(sides) != 2:
            raise ConfigError(f"a {by} comparison needs exactly two {by}s, found {len(sides)}: {', '.join(sides)}")
        a, b = sides
        pick = (lambda s: s.model) if by == "model" else (lambda s: s.build)
        return compare_bench(a, [s for s in samples if pick(s) == a], b, [s for s in samples if pick(s) == b],
                             resamples=resamples, seed=seed)
    if by != "run":
        raise ConfigError(f"--by must be auto, run, model or build, not {by!r}")
    if len(runs) != 2:
        raise ConfigError(f"a run-against-run bench comparison needs two runs, got {len(runs)}")
    (ha, ia), (hb, ib) = (runs[0].host, runs[0].id), (runs[1].host, runs[1].id)
    return compare_bench(f"{ha}/{ia}", [s for s in samples if (s.host, s.run_id) == (ha, ia)],
                         f"{hb}/{ib}", [s for s in samples if (s.host, s.run_id) == (hb, ib)],
                         resamples=resamples, seed=seed)
