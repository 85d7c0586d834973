"""An upgrade's gates: what is measured, the margins, and the verdict of each measurement (pure).

The gates come from the inventory (``rigctl_upgrade_gates``, one mapping per fleet or host) with a
``--gates FILE`` laid over them section by section. Every section may be ``null`` (not measured):

``speed_margin``
    Non-inferiority margin of every speed ratio candidate/current (llama-bench's pp and tg tests, the
    server's decode and TTFT): the lower end of the ratio's interval must be at least this (0.95: at most
    5 % slower, shown at the interval's level). A ratio whose whole interval lies below the margin fails;
    one whose interval straddles it is *undecided*, and is measured more, up to the section's budget.
``bench``
    llama-bench cells alternating the two builds on the canary (``matrix``: llama-bench's; ``rounds``
    cells per build to start with, up to ``max_rounds``). Ratio intervals as ``rigctl compare`` gives
    them for bench runs: every repetition's tokens/s of each side, each side resampled on its own.
``server``
    The instance and its candidate probe (same artifact and profile, another port), asked the same
    filler prompts one after the other, alternating which goes first (``repeats`` per prompt length, up to
    ``max_repeats``): decode tokens/s and time to first token. Each pair's log ratio is paired, so load
    shared by both sides cancels; the interval is the paired bootstrap's, exponentiated (a geometric mean).
``identity``
    Greedy replies to a fixed prompt set (the drafter race's prompts): the share byte-identical between
    the builds must be at least ``floor``.
``quality``
    A short eval slice (``task``, ``limit`` questions, up to ``max_limit``) on both, paired question by
    question: TOST within ``margin`` points shows equivalence (pass); McNemar's exact test showing the
    candidate worse fails; neither is undecided.
``new_errors``
    Requests, cells or answers that failed on the candidate beyond those that failed on the current build.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError

from rigctl.errors import ConfigError, ProblemsError
from rigctl.inputs import error_lines
from rigctl.inventory import Host
from rigctl.inventory.gates import GATES_VAR, Gates
from rigctl.inventory.profiles import merge
from rigctl.stats import DEFAULT_LEVEL, DEFAULT_RESAMPLES, DEFAULT_SEED, Interval, bootstrap_mean, paired_bootstrap

Verdict = Literal["pass", "fail", "undecided"]


def parse_gates(data: Any, origin: str) -> Gates:
    """``data`` as :class:`Gates`; ProblemsError with one line per bad key, each naming ``origin``."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{origin}: expected a mapping of gates, not {type(data).__name__}")
    try:
        return Gates.model_validate(dict(data))
    except ValidationError as exc:
        raise ProblemsError(error_lines(exc, origin)) from None


def load_gates(inventory_value: Any, where: str, file: Any = None) -> Gates:
    """The gates of an upgrade: the inventory's (``where`` names the host) with ``file`` (a ``--gates``
    path) over them. Each file's problems are named against that file."""
    base = inventory_value or {}
    parse_gates(base, f"{where}: {GATES_VAR}")
    if file is None:
        return parse_gates(base, f"{where}: {GATES_VAR}")
    from pathlib import Path

    from rigctl.inputs import read_mapping

    path = Path(file)
    over = read_mapping(path, "--gates", expected="expected a mapping of gates", empty=True)
    parse_gates(over, f"--gates {path}")  # its own keys, named against the file
    return parse_gates(merge(base, over), f"--gates {path}")


def check_gates(gates: Gates, host: Host, origin: str) -> None:
    """What the schema cannot tell without the host, before anything is fetched or built: the bench's models
    are artifacts of ``host``, the server gate's instance is one of its instances, the identity gate's prompt
    kinds are shipped ones, the quality task is a shipped task or a task file that parses (its datasets are
    not fetched). ConfigError naming ``origin`` and the key."""
    from rigctl.bench.drafting import load_prompts
    from rigctl.errors import EvalError
    from rigctl.evals.tasks import find_task, parse_task
    from rigctl.inputs import read_text

    if gates.bench is not None:
        available = [a.name for a in host.artifacts]
        for index, model in enumerate(gates.bench.models):
            if model not in available:
                raise ConfigError(f"{origin}: bench.models.{index}: {model!r} is not an artifact of host {host.name} "
                                  f"(it has: {', '.join(available) or 'none'})")
    if gates.server is not None and gates.server.instance:
        try:
            host.server(gates.server.instance)
        except ConfigError as exc:
            raise ConfigError(f"{origin}: server.instance: {exc}") from None
    if gates.identity is not None and gates.identity.kinds:
        shipped = list(load_prompts())
        for index, kind in enumerate(gates.identity.kinds):
            if kind not in shipped:
                raise ConfigError(f"{origin}: identity.kinds.{index}: no prompt kind {kind!r} (kinds: "
                                  f"{', '.join(shipped)})")
    if gates.quality is not None:
        try:
            path = find_task(gates.quality.task)
            parse_task(read_text(path, "task", EvalError), str(path))
        except EvalError as exc:
            raise ConfigError(f"{origin}: quality.task: {exc}") from None


# ----------------------------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class GateResult:
    """One gate's measurement and verdict: ``figures`` is the one line a refusal quotes."""

    gate: str  # "bench tg128", "server decode", "identity", "quality", "errors"
    verdict: Verdict
    figures: str
    n: int = 0
    estimate: float | None = None
    low: float | None = None
    high: float | None = None
    threshold: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ratio_text(interval: Interval) -> str:
    return f"{interval.estimate:.3f}x [{interval.low:.3f}, {interval.high:.3f}]"


#: Fewer pairs than this decide nothing: a bootstrap interval over a handful of values is too narrow.
MIN_PAIRS = 5


def speed_verdict(interval: Interval, margin: float) -> Verdict:
    """Non-inferiority of a ratio at ``margin``: its interval's lower end at or above it (pass), its upper
    end below it (fail), else undecided (as it is without data, or with fewer than :data:`MIN_PAIRS`)."""
    if interval.empty or math.isnan(interval.low) or interval.n < MIN_PAIRS:
        return "undecided"
    if interval.low >= margin:
        return "pass"
    if interval.high < margin:
        return "fail"
    return "undecided"


def speed_gate(gate: str, interval: Interval, margin: float, *, n_a: int, n_b: int, mean_a: float, mean_b: float,
               unit: str, paired: str | None = None, detail: Mapping[str, Any] | None = None) -> GateResult:
    """``paired``: what the pairs are (rounds of cells, requests), when the interval is a paired one."""
    verdict = speed_verdict(interval, margin)
    n = f"n={n_b} {paired} paired" if paired else f"n={n_b} and {n_a}"
    short = f", fewer than {MIN_PAIRS}" if interval.n < MIN_PAIRS else ""
    figures = (f"candidate/current {ratio_text(interval)} ({interval.level:.0%} interval; "
               f"{mean_b:.2f} vs {mean_a:.2f} {unit}, {n}{short}), margin {margin:g}x")
    return GateResult(gate, verdict, figures, n=min(n_a, n_b), estimate=interval.estimate, low=interval.low,
                      high=interval.high, threshold=margin, detail=dict(detail or {}))


def paired_log_ratio(current: Sequence[float], candidate: Sequence[float], *, higher_is_better: bool = True,
                     resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                     level: float = DEFAULT_LEVEL) -> Interval:
    """The speed ratio candidate/current of paired measurements (same prompt, back to back) as the geometric
    mean of the pairs' ratios with the paired bootstrap's interval on the log scale, exponentiated.
    ``higher_is_better`` False (a time: TTFT): the ratio is current/candidate, so above 1 is faster too."""
    a = np.log(np.asarray(current, dtype=np.float64))
    b = np.log(np.asarray(candidate, dtype=np.float64))
    if a.size != b.size:
        raise ValueError("paired measurements need one candidate value per current one")
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    logs = paired_bootstrap(a, b, resamples=resamples, seed=seed, level=level) if higher_is_better else \
        paired_bootstrap(b, a, resamples=resamples, seed=seed, level=level)
    if logs.empty:
        return logs
    return Interval(math.exp(logs.estimate), math.exp(logs.low), math.exp(logs.high), logs.n, logs.resamples,
                    logs.level, logs.method)


def identity_gate(identical: Sequence[bool], floor: float, *, level: float = DEFAULT_LEVEL,
                  detail: Mapping[str, Any] | None = None) -> GateResult:
    """The share of greedy replies byte-identical between the builds against ``floor`` (point estimate; the
    interval is shown for the reader)."""
    flags = [1.0 if same else 0.0 for same in identical]
    share = bootstrap_mean(flags, level=level)
    if share.empty:
        return GateResult("identity", "undecided", "no replies to compare", threshold=floor)
    verdict: Verdict = "pass" if share.estimate >= floor else "fail"
    figures = (f"{int(sum(flags))}/{len(flags)} greedy replies byte-identical ({share.estimate:.0%}, "
               f"{level:.0%} interval [{share.low:.0%}, {share.high:.0%}]), floor {floor:.0%}")
    return GateResult("identity", verdict, figures, n=len(flags), estimate=share.estimate, low=share.low,
                      high=share.high, threshold=floor, detail=dict(detail or {}))


def quality_gate(*, n: int, score_a: float, score_b: float, b: int | None, c: int | None, p: float,
                 equivalent: bool, tost_p: float, low: float, high: float, margin_points: float,
                 detail: Mapping[str, Any] | None = None) -> GateResult:
    """The eval slice's verdict: equivalent within the margin (TOST) passes, a significant loss (McNemar)
    fails, a significant gain passes (non-inferior), anything else is undecided."""
    gap = score_b - score_a
    if equivalent:
        verdict: Verdict = "pass"
    elif not math.isnan(p) and p < 0.05:
        verdict = "fail" if gap < 0 else "pass"
    else:
        verdict = "undecided"
    discordant = f"b={b} c={c}, " if b is not None else ""
    figures = (f"score {score_b:.1%} vs {score_a:.1%} on {n} paired questions (gap {gap * 100:+.1f} points; "
               f"{discordant}McNemar p={p:.3g}; TOST p={tost_p:.3g}, 90% interval [{low * 100:+.1f}, "
               f"{high * 100:+.1f}] points, margin ±{margin_points:g})")
    return GateResult("quality", verdict, figures, n=n, estimate=gap, low=low, high=high,
                      threshold=margin_points / 100.0, detail=dict(detail or {}))


def errors_gate(current: int, candidate: int, allowed: int) -> GateResult:
    new = candidate - current
    verdict: Verdict = "pass" if new <= allowed else "fail"
    return GateResult("errors", verdict, f"{candidate} failed requests or cells on the candidate, {current} on the "
                                         f"current build ({max(new, 0)} new, {allowed} allowed)",
                      n=candidate, estimate=float(new), threshold=float(allowed))


def overall(results: Sequence[GateResult]) -> Verdict:
    """Fail if any gate failed, pass if every gate passed, else undecided."""
    if any(r.verdict == "fail" for r in results):
        return "fail"
    return "pass" if results and all(r.verdict == "pass" for r in results) else "undecided"


def first_failure(results: Sequence[GateResult]) -> GateResult | None:
    """The gate a refusal names: the first that failed, else the first still undecided."""
    return next((r for r in results if r.verdict == "fail"), None) or \
        next((r for r in results if r.verdict == "undecided"), None)
