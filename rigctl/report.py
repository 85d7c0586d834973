"""The campaign report: Markdown with PNG charts, built only from pulled raw result files.

Sections: scope line (hosts, builds, dates, repeats, runs, the smallest gap each comparison can
detect, what is missing or was not measured); speed (mean t/s ± sd per test and model over the
unthrottled cells, ratio with a bootstrap interval from the per-repetition samples, cold -> steady,
the throttled cells, a by-depth table for depth sweeps, every tg figure against the memory-bandwidth
bound of :mod:`rigctl.bench.bandwidth` with impossible ones flagged instead of printed); quality (score per
set and overall with intervals); the campaign's comparisons grouped as head-to-head, quantisation
cost and what QAT is worth (paired gaps in points, McNemar's exact or a sign-flip test with the
discordant counts, Holm-adjusted p-values across the campaign's comparisons, the equivalence
verdict) with a forest plot of every gap against its equivalence band; flips (questions right ->
wrong and wrong -> right, each listed with both replies in a flips file beside the report); drafting
speedups (rigctl bench spec races); load curves (rigctl bench load) and deployed decode over
llama-bench tg; sensitivity (the gap under each switch); answer habits; the runs used. Every number
is a link to the raw file(s) it was computed from (llama-bench JSON of each cell, ``answers.jsonl``,
the race's and the load curve's ``requests.jsonl``), relative to the report, so the report stays
valid when the results tree and the report move together.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rigctl.bench.bandwidth import NO_FIGURE, DecodeBound, decode_bound
from rigctl.bench.matrix import BenchSample, cold_and_steady, counted, load_run_samples, throttled_cells
from rigctl.campaign import CampaignBench, LoadedCampaign, Located, locate
from rigctl.compare import (
    OVERALL,
    PairComparison,
    Scoring,
    SetGap,
    answer_habits,
    answers_path,
    check_sets,
    compare_bench,
    compare_pair,
    flip_counts,
    gap_points,
    load_answers,
    other_scores,
    p_text,
    points,
    ratio_text,
    run_scores,
    sample_file,
)
from rigctl.errors import ConfigError, RigctlError, one_line
from rigctl.evals.scorers import GSM8K_SCORES
from rigctl.files import write_atomically
from rigctl.results.record import ANSWERS_FILE, RUN_FILE
from rigctl.results.store import ResultsStore, StoredRun, read_jsonl
from rigctl.stats import Interval, holm, verdict_text

if TYPE_CHECKING:
    from rigctl.bench.drafting import RaceRequest

log = logging.getLogger(__name__)

SECTION_TITLES = {"headline": "Head to head", "quantisation": "Quantisation cost", "qat": "What QAT is worth",
                  "other": "Other comparisons"}


@dataclass
class Report:
    path: Path
    markdown: str
    charts: list[Path] = field(default_factory=list)
    headline: str = ""  # the speed and quality tables, for printing after a run
    missing: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- formatting


class _Links:
    """Markdown links relative to the report's directory."""

    def __init__(self, out_dir: Path, results_root: Path) -> None:
        self.out_dir = out_dir.resolve()
        self.root = results_root.resolve()

    def rel(self, path: Path) -> str:
        return os.path.relpath(path.resolve(), self.out_dir).replace(" ", "%20")

    def result(self, relative: str) -> Path:
        return self.root / relative

    def number(self, text: str, files: Sequence[Path]) -> str:
        """``text`` linked to the first file, the others as numbered superscript links."""
        if not files:
            return text
        first, *rest = files
        extra = "".join(f"<sup>[{i}]({self.rel(p)})</sup>" for i, p in enumerate(rest, 2))
        return f"[{text}]({self.rel(first)}){extra}"


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("\n", " ") for c in cells) + " |"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> list[str]:
    aligns = [("---:" if (align[i:i + 1] or "r") == "r" else ":---") for i in range(len(header))]
    return [_row(header), _row(aligns), *(_row(r) for r in rows)]


def _mean_sd(values: Sequence[float]) -> str:
    mean = float(np.mean(values))
    sd = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return f"{mean:.2f} ± {sd:.2f}"


# ----------------------------------------------------------------------------------------------- sections


def _detectable(compared: list[_Compared]) -> str:
    """The scope line's power clause: per comparison, the smallest gap detectable at 80 % power."""
    parts = []
    for c in compared:
        gap = c.pair.recorded.overall
        test = gap.test
        basis = f"{test.b + test.c} of {gap.n} discordant" if test and test.b is not None else f"n={gap.n}"
        detectable = gap_points(gap.detectable)
        parts.append(f"{c.name} on {c.evaluation} {detectable}{' points' if detectable.startswith('±') else ''} "
                     f"({basis})")
    if not parts:
        return ""
    return ("Smallest gap detectable at 80 % power (two-sided 5 %, from the observed discordance): "
            + "; ".join(parts) + ".")


def _scope(loaded: LoadedCampaign, found: Located, missing: list[str], unreadable: list[str],
           compared: list[_Compared]) -> list[str]:
    campaign = loaded.campaign
    runs = found.runs()
    hosts = []
    for host in campaign.hosts:
        gpus = {str(r.record.gpu.name) for r in runs if r.host == host and r.record.gpu.name}
        hosts.append(f"{host} ({', '.join(sorted(gpus))})" if gpus else host)
    builds = sorted({r.record.llama_cpp.label for r in runs if r.record.llama_cpp.label})
    dates = sorted(r.record.started[:10] for r in runs)
    repeats = sorted({f"{b.matrix.r} repetitions x {b.rounds} cells per model" for b in campaign.benches})
    per_target: dict[str, int] = {}
    for (name, _), run in found.evals.items():
        if run is not None:
            per_target[name] = per_target.get(name, 0) + 1
    parts = [
        f"**Scope.** Hosts: {', '.join(hosts)}.",
        f"Builds: {', '.join(builds) or 'none pulled'}.",
        f"Measured: {dates[0]} to {dates[-1]}." if dates else "Measured: nothing pulled yet.",
        f"Speed: {'; '.join(repeats)}." if repeats else "",
        "Runs per eval target: 1 (the newest finished run)." if per_target else "",
        _detectable(compared),
        f"Not measured: {', '.join(campaign.not_measured)}." if campaign.not_measured else "",
        f"Not pulled yet: {'; '.join(missing)}." if missing else "",
        f"Left out, their files unreadable: {'; '.join(unreadable)}." if unreadable else "",
    ]
    return [" ".join(p for p in parts if p), ""]


def _bench_section(bench: CampaignBench, host: str, run: StoredRun, links: _Links, out_dir: Path,
                   loaded: LoadedCampaign, charts: list[Path]) -> list[str]:
    campaign = loaded.campaign
    samples = load_run_samples(run)
    models = [m for m in bench.models if any(s.model == m for s in samples)]
    lines = [f"### {bench.name} on {host}", ""]
    if not models:
        return [*lines, "No llama-bench results in this run.", ""]
    by_key: dict[tuple[str, str, int], dict[str, list[BenchSample]]] = {}
    for s in samples:
        by_key.setdefault((s.test, s.config, s.flash_attn), {}).setdefault(s.model, []).append(s)
    bounds = _bounds(run, by_key)
    first = models[0]
    header = ["test", "settings", *(f"{campaign.label(m)} t/s" for m in models),
              *(f"{campaign.label(first)} / {campaign.label(m)}" for m in models[1:]), "cold -> steady t/s"]
    rows = []
    chart_rows: list[tuple[str, dict[str, tuple[float, float]]]] = []
    for key, per_model in by_key.items():
        test, config, fa = key
        row = [test, f"{config} fa{fa}"]
        stats: dict[str, tuple[float, float]] = {}
        steady = []
        for m in models:
            group = counted(per_model.get(m, []))
            values = [v for s in group for v in s.samples_ts]
            files = [links.result(sample_file(s)) for s in group]
            bound = bounds.get((key, m))
            if bound is not None and bound.impossible:
                row.append(links.number("impossible (see the bandwidth bound)", files))
            else:
                note = " THROTTLED" if group and all(s.throttled for s in group) else ""
                left_out = len(per_model.get(m, [])) - len(group)
                note += f" ({left_out} throttled cell{'s' if left_out > 1 else ''} left out)" if left_out else ""
                row.append(links.number(_mean_sd(values), files) + note if values else "-")
                if values:
                    stats[m] = (float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0)
            cold, warm = cold_and_steady([s.samples_ts for s in group])
            steady.append(f"{cold:.2f} -> {warm:.2f}" if group and not math.isnan(warm) else "-")
        for m in models[1:]:
            ratio = compare_bench(m, per_model.get(m, []), first, per_model.get(first, []),
                                  resamples=campaign.resamples, seed=campaign.seed)
            if ratio.ratios:
                r = ratio.ratios[0]
                row.append(links.number(ratio_text(r.ratio), [links.result(f) for f in r.files]))
            else:
                row.append("-")
        row.append(", ".join(steady))
        rows.append(row)
        chart_rows.append((f"{test}\n{config} fa{fa}" if len(by_key) > 1 and len({k[1:] for k in by_key}) > 1
                           else test, stats))
    lines += _table(header, rows, align="ll")
    lines += ["", "Cold: each cell's first repetition, right after the cool-down; steady: the later ones.", ""]
    throttled = throttled_cells(samples)
    if throttled:
        lines += ["Throttled cells (their clocks fell or a thermal/power reason was active; left out of the means "
                  "where unthrottled cells exist):", "", *(f"- {t}" for t in throttled), ""]
    chart = out_dir / f"speed-{bench.name}-{host}.png"
    _speed_chart(chart, chart_rows, models, campaign.label, f"{bench.name} on {host}: tokens/s (mean ± sd)")
    charts.append(chart)
    lines += [f"![{bench.name} on {host}]({chart.name})", ""]
    lines += _depth_table(bench, host, by_key, models, campaign, links, out_dir, charts)
    lines += _bound_table(by_key, bounds, models, campaign, links)
    return lines


def _bounds(run: StoredRun, by_key: dict[tuple[str, str, int], dict[str, list[BenchSample]]]
            ) -> dict[tuple[tuple[str, str, int], str], DecodeBound]:
    """Every tg figure's decode bound, by (test key, model)."""
    artifacts = {a.name: a for a in run.record.artifacts}
    bandwidth = run.record.gpu.bandwidth_gbs
    out = {}
    for key, per_model in by_key.items():
        for model, group in per_model.items():
            s = group[0]
            if s.n_gen == 0 or s.n_prompt != 0:
                continue
            values = [v for c in counted(group) for v in c.samples_ts]
            out[(key, model)] = decode_bound(
                float(np.mean(values)), bandwidth_gbs=float(bandwidth) if bandwidth is not None else None,
                artifact=dataclasses.asdict(artifacts[model]) if model in artifacts else {},
                entry={"n_gen": s.n_gen, "n_depth": s.depth, "n_gpu_layers": s.ngl, "type_k": s.type_k,
                       "type_v": s.type_v})
    return out


def _bound_table(by_key, bounds, models, campaign, links: _Links) -> list[str]:
    if not bounds:
        return []
    if all(b.fraction is None for b in bounds.values()):
        reasons = sorted({str(b.reason) for b in bounds.values()})
        return [f"Bandwidth bound: {NO_FIGURE} ({'; '.join(reasons)}).", ""]
    rows = []
    for (key, model), bound in bounds.items():
        files = [links.result(sample_file(s)) for s in counted(by_key[key][model])]
        shown = "-" if bound.impossible else links.number(f"{bound.tokens_per_s:.2f}", files)
        per_token = f"{bound.bytes_per_token / 1e6:.1f} MB" if bound.bytes_per_token else "-"
        rows.append([key[0], f"{key[1]} fa{key[2]}", campaign.label(model), shown, per_token,
                     f"{bound.bound_tokens_per_s:.1f}" if bound.bound_tokens_per_s else "-",
                     links.number(bound.text(), files)])
    return ["Decode against the memory-bandwidth bound (weights from the manifest plus the KV cache at the depth, "
            "read once per token; over 100 % is impossible and is not shown as a result):", "",
            *_table(["test", "settings", "model", "t/s", "read per token", "bound t/s", "share of the bound"], rows,
                    align="lll"), ""]


def _depth_table(bench: CampaignBench, host: str, by_key, models, campaign, links: _Links, out_dir: Path,
                 charts: list[Path]) -> list[str]:
    """pp/tg at each context depth of the matrix, models side by side, and how the first one's lead moves."""
    depths = sorted({s.depth for per_model in by_key.values() for g in per_model.values() for s in g})
    if len(depths) < 2:
        return []
    series: dict[tuple[str, str, int], dict[int, dict[str, list[BenchSample]]]] = {}
    for (test, config, fa), per_model in by_key.items():
        base = test.split(" @ ")[0]
        depth = next(iter(per_model.values()))[0].depth
        series.setdefault((base, config, fa), {})[depth] = per_model
    header = ["test", "settings", "model", *(f"d{d}" for d in depths)]
    rows = []
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for (base, config, fa), at in series.items():
        for m in models:
            cells = []
            for d in depths:
                group = counted(at.get(d, {}).get(m, []))
                values = [v for s in group for v in s.samples_ts]
                cells.append(links.number(f"{np.mean(values):.2f}", [links.result(sample_file(s)) for s in group])
                             if values else "-")
                if values:
                    curve = curves.setdefault(f"{base} {config} fa{fa}", {}).setdefault(m, [])
                    curve.append((d, float(np.mean(values))))
            rows.append([base, f"{config} fa{fa}", campaign.label(m), *cells])
        for m in models[1:]:
            cells = []
            for d in depths:
                ratio = compare_bench(m, at.get(d, {}).get(m, []), models[0], at.get(d, {}).get(models[0], []),
                                      resamples=campaign.resamples, seed=campaign.seed)
                found = ratio.ratios[0] if ratio.ratios else None
                cells.append(links.number(ratio_text(found.ratio), [links.result(f) for f in found.files])
                             if found else "-")
            rows.append([base, f"{config} fa{fa}", f"{campaign.label(models[0])} / {campaign.label(m)}", *cells])
    chart = out_dir / f"depth-{bench.name}-{host}.png"
    _depth_chart(chart, curves, campaign.label, f"{bench.name} on {host}: tokens/s by context depth")
    charts.append(chart)
    return ["By context depth (tokens already in the context, llama-bench -d):", "",
            *_table(header, rows, align="lll"), "", f"![{bench.name} on {host} by depth]({chart.name})", ""]


def _depth_chart(path: Path, curves: dict[str, dict[str, list[tuple[int, float]]]], label, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(max(4, 3.6 * len(curves)), 3.4), squeeze=False)
    for ax, (test, per_model) in zip(axes[0], curves.items(), strict=True):
        for m, curve in per_model.items():
            ax.plot([d for d, _ in curve], [v for _, v in curve], marker="o", label=label(m))
        ax.set_title(test, fontsize=9)
        ax.set_xlabel("depth (tokens)")
        ax.set_ylabel("t/s")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _speed_chart(path: Path, rows: list[tuple[str, dict[str, tuple[float, float]]]], models: list[str],
                 label, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(max(4, 2.6 * len(rows)), 3.4), squeeze=False)
    for ax, (test, stats) in zip(axes[0], rows, strict=True):
        names = [m for m in models if m in stats]
        ax.bar(range(len(names)), [stats[m][0] for m in names], yerr=[stats[m][1] for m in names], capsize=4,
               color=[f"C{models.index(m)}" for m in names])
        ax.set_xticks(range(len(names)), [label(m) for m in names], rotation=20, ha="right", fontsize=8)
        ax.set_title(test, fontsize=9)
        ax.set_ylabel("t/s")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _quality_section(loaded: LoadedCampaign, found: Located, links: _Links, out_dir: Path,
                     charts: list[Path]) -> list[str]:
    campaign = loaded.campaign
    lines = ["## Quality", ""]
    for evaluation in campaign.evals:
        pulled = [(t, found.evals[(evaluation.name, t.id)]) for t in evaluation.runs]
        pulled = [(t, r) for t, r in pulled if r is not None]
        lines += [f"### {evaluation.name} (task {found.task_names.get(evaluation.name, evaluation.task)})", ""]
        if not pulled:
            lines += ["Nothing pulled yet.", ""]
            continue
        lines += _deviation_lines(pulled, links)
        scores = {t.id: run_scores(r, resamples=campaign.resamples, seed=campaign.seed) for t, r in pulled}
        sets = sorted({g.set for gaps in scores.values() for g in gaps if g.set != OVERALL})
        # GSM8K runs carry lm-eval's two scores beside rigctl's: each gets its own named column.
        metrics = other_scores([row for _, r in pulled for row in load_answers(r)])
        named = [f"overall ({GSM8K_SCORES['score']})"] if metrics else ["overall"]
        header = ["model", "host", *(sets if len(sets) > 1 else []), *named,
                  *(f"overall ({GSM8K_SCORES[m]})" for m in metrics), "n"]
        rows = []
        overall: list[tuple[str, Interval]] = []
        for target, run in pulled:
            by_set = {g.set: g for g in scores[target.id]}
            file = [answers_path(run)]
            cells = [links.number(ratio_text(by_set[s].gap), file) if s in by_set else "-"
                     for s in (sets if len(sets) > 1 else [])]
            total = by_set[OVERALL]
            others = [run_scores(run, resamples=campaign.resamples, seed=campaign.seed, metric=m)[-1].gap
                      for m in metrics]
            rows.append([campaign.label(target.artifact), target.host, *cells,
                         links.number(ratio_text(total.gap), file),
                         *(links.number(ratio_text(gap), file) for gap in others), links.number(str(total.n), file)])
            overall.append((campaign.target_label(target.id), total.gap))
        lines += _table(header, rows, align="ll")
        chart = out_dir / f"quality-{evaluation.name}.png"
        _quality_chart(chart, overall, f"{evaluation.name}: overall score (95% interval)")
        charts.append(chart)
        lines += ["", f"![{evaluation.name}]({chart.name})", ""]
    return lines


def _deviation_lines(pulled: Sequence[tuple[Any, StoredRun]], links: _Links) -> list[str]:
    """What the runs' records say departs from their instrument's own request (a BFCL task with a token limit,
    say): its scores are then not the instrument's, and the report says so before showing them."""
    seen: dict[str, list[StoredRun]] = {}
    for _, run in pulled:
        deviations = run.record.extra.get("deviations")
        if isinstance(deviations, dict) and deviations.get("settings"):
            text = (f"**Not {deviations.get('from', 'the instrument')}**: "
                    f"{'; '.join(map(str, deviations['settings']))}. Why: {deviations.get('reason') or 'not said'}.")
            seen.setdefault(text, []).append(run)
    return [line for text, runs in seen.items()
            for line in (f"{text} ({links.number('run record', [r.path / RUN_FILE for r in runs])})", "")]


def _quality_chart(path: Path, overall: list[tuple[str, Interval]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 1.3 + 0.45 * len(overall)))
    ys = range(len(overall))
    est = [i.estimate for _, i in overall]
    err = [[i.estimate - i.low for _, i in overall], [i.high - i.estimate for _, i in overall]]
    ax.barh(list(ys), est, xerr=err, capsize=4, color=[f"C{k}" for k in ys])
    ax.set_yticks(list(ys), [name for name, _ in overall], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("score")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class _Compared:
    name: str
    section: str
    evaluation: str
    pair: PairComparison
    holm: float = float("nan")  # the overall p-value, Holm-adjusted across the campaign's comparisons

    @property
    def verdict(self) -> str:
        """Equivalent within the margin, different (by the Holm-adjusted p), or not shown either way."""
        gap = self.pair.recorded.overall
        return verdict_text(gap.verdict(self.holm), self.pair.margin) if self.pair.margin is not None else "-"


def _comparisons(loaded: LoadedCampaign, found: Located) -> tuple[list[_Compared], list[str]]:
    campaign = loaded.campaign
    scoring = Scoring(cutoff_as_right=campaign.sensitivity.cutoff_as_right,
                      toolless_as_right=campaign.sensitivity.toolless_as_right,
                      exclude=tuple(campaign.sensitivity.exclude))
    out: list[_Compared] = []
    problems: list[str] = []
    try:  # the excluded sets are the campaign's: each must be in one of its runs, not in every pair's
        check_sets(scoring.exclude, [run for run in found.evals.values() if run is not None], "sensitivity.exclude")
    except RigctlError as exc:
        problems.append(str(exc))
    for comparison in campaign.comparisons:
        for evaluation in campaign.evals:
            if comparison.evals and evaluation.name not in comparison.evals:
                continue
            run_a = found.evals.get((evaluation.name, comparison.a))
            run_b = found.evals.get((evaluation.name, comparison.b))
            if run_a is None or run_b is None:
                continue
            replicate = found.evals.get((evaluation.name, comparison.replicate)) if comparison.replicate else None
            if comparison.replicate and replicate is None:
                problems.append(f"{comparison.name} on {evaluation.name}: its replicate {comparison.replicate} "
                                f"is not pulled yet (the gap is shown without it)")
            try:
                pair = compare_pair(run_a, run_b, scoring=scoring, resamples=campaign.resamples, seed=campaign.seed,
                                    margin=campaign.margin(comparison), replicate=replicate)
            except RigctlError as exc:  # a refusal (different tasks) is reported, not fatal to the report
                problems.append(f"{comparison.name} on {evaluation.name}: {exc}")
                continue
            out.append(_Compared(comparison.name, comparison.section, evaluation.name, pair))
    adjusted = holm([c.pair.recorded.overall.test.p if c.pair.recorded.overall.test else float("nan") for c in out])
    return [dataclasses.replace(c, holm=p) for c, p in zip(out, adjusted, strict=True)], problems


def _comparison_sections(loaded: LoadedCampaign, compared: list[_Compared], problems: list[str],
                         links: _Links, forest: Path | None = None) -> list[str]:
    lines: list[str] = []
    for section, title in SECTION_TITLES.items():
        items = [c for c in compared if c.section == section]
        if not items:
            continue
        lines += [f"## {title}", "", "A, B: the recorded score (for GSM8K rigctl's normalised one; lm-eval's "
                  "strict-match and flexible-extract gaps are under Sensitivity). "
                  "B - A in points (95% paired bootstrap interval), question by question; "
                  "b / c: questions A got right and B wrong / A wrong and B right; p: McNemar's exact test "
                  "(sign-flip permutation test for graded scores), and Holm-adjusted across all the campaign's "
                  "comparisons; verdict: TOST at 5 % against the equivalence margin, else the "
                  "Holm-adjusted test.", ""]
        replicated = any(c.pair.replicate for c in items)
        if replicated:
            lines += ["A/B disagree, replicate disagrees: the share of questions scored differently by A and B, "
                      "and by A and a second run of A (95% interval); replicate gap: that second run minus A. "
                      "A gap whose interval overlaps the replicate gap's is flagged: not clearly larger than "
                      "the noise of running twice.", ""]
        rows = []
        for c in items:
            gap = c.pair.recorded.overall
            files = list(c.pair.files)
            test = gap.test
            counts = f"{test.b} / {test.c}" if test and test.b is not None else "graded"
            verdict = c.verdict + ("; within replicate noise" if c.pair.within_noise else "")
            row = [c.name, c.evaluation, links.number(str(gap.n), files),
                   links.number(f"{gap.score_a:.3f}", files[:1]), links.number(f"{gap.score_b:.3f}", files[1:]),
                   links.number(points(gap.gap), files), links.number(counts, files),
                   links.number(p_text(test.p) if test else "-", files), p_text(c.holm)]
            if replicated:
                noise = c.pair.replicate
                replicate_files = [files[0], noise.run.path / ANSWERS_FILE] if noise else []
                row += [links.number(ratio_text(c.pair.disagreement), files) if c.pair.disagreement else "-",
                        links.number(ratio_text(noise.disagreement), replicate_files) if noise else "-",
                        links.number(points(noise.gap), replicate_files) if noise else "-"]
            rows.append([*row, verdict])
        holm_column = f"p (Holm, {len(compared)} comparison{'s' if len(compared) != 1 else ''})"
        noise_columns = ["A/B disagree", "replicate disagrees", "replicate gap, points"] if replicated else []
        lines += _table(["comparison", "eval", "n", "A", "B", "B - A, points", "b / c", "p (exact)", holm_column,
                         *noise_columns, "verdict"], rows, align="ll")
        lines.append("")
    if forest is not None:
        lines += [f"![every comparison's gap with its interval and equivalence band]({forest.name})", ""]
    if problems:
        lines += ["Comparisons not made:", "", *(f"- {p}" for p in problems), ""]
    return lines


def _forest_plot(path: Path, compared: list[_Compared]) -> None:
    """Every comparison's overall B - A (points) with its 95% bootstrap interval, the TOST's 90%
    interval where a margin is set, and the ±margin equivalence band behind it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 1.4 + 0.5 * len(compared)))
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for row, c in enumerate(reversed(compared)):
        gap = c.pair.recorded.overall
        margin = c.pair.margin
        if margin is not None:
            ax.fill_between([-margin, margin], row - 0.4, row + 0.4, color="C2", alpha=0.18, linewidth=0,
                            label=once("equivalence band (±margin)"))
        if gap.gap.empty:
            continue
        est = gap.gap.estimate * 100
        ax.errorbar([est], [row], xerr=[[est - gap.gap.low * 100], [gap.gap.high * 100 - est]], fmt="o",
                    color="C0", capsize=4, label=once("B - A, 95% bootstrap interval"))
        equivalence = gap.equivalence
        if equivalence is not None and not math.isnan(equivalence.low):
            ax.plot([equivalence.low * 100, equivalence.high * 100], [row - 0.18] * 2, color="C1", linewidth=3,
                    label=once("90% interval of the TOST"))
    ax.axvline(0, color="0.4", linewidth=0.8)
    ax.set_yticks(range(len(compared)), [f"{c.name}\n{c.evaluation}: {c.verdict}" for c in reversed(compared)],
                  fontsize=8)
    ax.set_ylim(-0.7, len(compared) - 0.3)
    ax.set_xlabel("B - A, points")
    ax.set_title("paired differences: every comparison", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _flip_file(path: Path, c: _Compared, links: _Links) -> None:
    """Every flipped question of one comparison with both replies, for the report's flips links."""
    pair = c.pair
    file_a, file_b = pair.files
    lines = [f"# Flips: {c.name} on {c.evaluation}", "",
             f"A: {pair.a.label} ([answers]({links.rel(file_a)})); B: {pair.b.label} ([answers]({links.rel(file_b)})).",
             ""]
    for direction in ("right→wrong", "wrong→right"):
        group = [f for f in pair.flips if f.direction == direction]
        lines += [f"## {direction} ({len(group)})", ""]
        for flip in group:
            lines += [f"### {flip.set} / {flip.id}", "", f"A (score {flip.score_a:g}):", "", _quoted(flip.reply_a),
                      "", f"B (score {flip.score_b:g}):", "", _quoted(flip.reply_b), ""]
    path.write_text("\n".join(lines).rstrip() + "\n")


def _quoted(text: str) -> str:
    """A reply as an indented code block: whatever the model wrote cannot break the Markdown around it."""
    return "\n".join("    " + line for line in (text or "(empty reply)").splitlines() or [""])


def _flips_section(compared: list[_Compared], links: _Links, out_dir: Path) -> list[str]:
    rows = []
    for index, c in enumerate(compared, 1):
        flips_md = out_dir / f"flips-{index}.md"
        _flip_file(flips_md, c, links)
        files = [flips_md, *c.pair.files]
        for count in flip_counts(c.pair.flips, [g.set for g in c.pair.recorded.sets]):
            rows.append([c.name, c.evaluation, count.set, links.number(str(count.right_to_wrong), files),
                         links.number(str(count.wrong_to_right), files)])
    if not rows:
        return []
    return ["## Flips", "", "Questions that changed between A and B, as recorded; each count links to the "
            "list of those questions with both replies, then to the two answer files.", "",
            *_table(["comparison", "eval", "set", "right→wrong", "wrong→right"], rows, align="lll"), ""]


def _drafting_section(loaded: LoadedCampaign, found: Located, links: _Links) -> list[str]:
    """Per race: each contender's decode t/s, speedup over the baseline (geometric mean of the per-prompt
    speedups), draft acceptance and greedy replies byte-identical to the baseline's, per temperature."""
    from rigctl.bench.drafting import REQUESTS_FILE, summarize_race

    campaign = loaded.campaign
    if not campaign.drafting:
        return []
    lines = ["## Drafting", ""]
    for race in campaign.drafting:
        run = found.drafting.get(race.name)
        lines += [f"### {race.name} on {race.host}", ""]
        if run is None:
            lines += ["Nothing pulled yet.", ""]
            continue
        path = run.path / REQUESTS_FILE
        requests = _race_requests(run)
        file = [path]
        rows = []
        for row in summarize_race(requests, race.baseline):
            if row.prompt != "overall":
                continue
            identical = f"{row.identical[0]} of {row.identical[1]}" if row.identical else "-"
            rows.append([row.contender, f"{row.temperature:g}", links.number(f"{row.tokens_per_s:.2f}", file),
                         links.number(f"{row.speedup:.3f}", file) if row.speedup is not None else "-",
                         links.number(f"{row.acceptance:.3f}", file) if row.acceptance is not None else "-",
                         links.number(identical, file) if row.identical else "-"])
        lines += _table(["contender", "temperature", "t/s", "speedup", "acceptance", "greedy identical"], rows,
                        align="ll")
        lines.append("")
    return lines


def _load_section(loaded: LoadedCampaign, found: Located, links: _Links, out_dir: Path,
                  charts: list[Path]) -> list[str]:
    """Per load curve: each level's output t/s, requests/s, TTFT and TPOT percentiles and errors, and the curve."""
    from rigctl.bench.load import REQUESTS_FILE, load_levels, to_png

    campaign = loaded.campaign
    if not campaign.loads:
        return []
    lines = ["## Load", "", "Streamed requests, a probe slot per client; TTFT and time per output token in ms.", ""]
    for load in campaign.loads:
        run = found.loads.get(load.name)
        lines += [f"### {load.name}: {load.server} on {load.host}", ""]
        if run is None:
            lines += ["Nothing pulled yet.", ""]
            continue
        levels = load_levels(run)
        file = [run.path / REQUESTS_FILE]
        rows = [[str(s.concurrency), links.number(str(s.requests), file), links.number(str(s.errors), file),
                 links.number(f"{s.output_tps:.2f}", file), links.number(f"{s.requests_per_s:.2f}", file),
                 *(links.number(_ms(s.ttft_s.get(f"p{q}")), file) for q in (50, 95, 99)),
                 *(links.number(_ms(s.tpot_s.get(f"p{q}")), file) for q in (50, 95, 99))] for s in levels]
        lines += _table(["concurrency", "requests", "errors", "output t/s", "requests/s", "TTFT p50", "TTFT p95",
                         "TTFT p99", "TPOT p50", "TPOT p95", "TPOT p99"], rows)
        chart = out_dir / f"load-{load.name}.png"
        to_png([(f"{run.host}/{run.id}", levels)], chart, f"{load.name}: {load.server} on {load.host}")
        charts.append(chart)
        lines += ["", f"![{load.name}]({chart.name})", ""]
    return lines


def _upgrades_section(found: Located, store: ResultsStore, links: _Links, out_dir: Path,
                      charts: list[Path]) -> list[str]:
    """Each upgrade step's record (rigctl.fleet.upgrade_report)."""
    from rigctl.fleet.upgrade_report import upgrade_section

    if not found.upgrades:
        return []
    lines = ["## Upgrades", ""]
    for name, run in found.upgrades.items():
        if run is None:
            lines += [f"### {name}", "", "Not run yet.", ""]
        else:
            lines += upgrade_section(run, links, store, out_dir, charts, level=3)
    return lines


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _server_flags(argv: Sequence[str]) -> dict[str, str]:
    """The llama-bench settings a server's arguments set (``-ngl -t -ctk -ctv -fa``), llama-server's
    defaults where they are absent."""
    names = {"-ngl": "ngl", "--n-gpu-layers": "ngl", "--gpu-layers": "ngl", "-t": "t", "--threads": "t",
             "-ctk": "ctk", "--cache-type-k": "ctk", "-ctv": "ctv", "--cache-type-v": "ctv", "-fa": "fa",
             "--flash-attn": "fa"}
    out = {"ngl": "auto", "t": "auto", "ctk": "f16", "ctv": "f16", "fa": "auto"}
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag in names:
            out[names[flag]] = value
    return out


def _deployed_section(loaded: LoadedCampaign, found: Located, links: _Links) -> list[str]:
    """Deployed decode (llama-server, streamed, one request at a time: the load curve's first level) over
    llama-bench's tg for the same artifact on the same host, with whether their settings agree."""
    from rigctl.bench.load import REQUESTS_FILE, load_requests
    from rigctl.bench.matrix import flash_attn_flag

    rows = []
    for load in loaded.campaign.loads:
        run = found.loads.get(load.name)
        if run is None or 1 not in load.concurrency:
            continue
        artifact = run.record.artifacts[0].name if run.record.artifacts else "None"
        decode = [r.decode_per_s for r in load_requests(run) if r.level == 1 and r.ok and r.decode_per_s]
        flags = _server_flags(run.record.server.argv if run.record.server else [])
        for (bench_name, host), bench_run in found.benches.items():
            if bench_run is None or host != load.host:
                continue
            tg = [s for s in load_run_samples(bench_run) if s.model == artifact and s.n_gen and not s.n_prompt
                  and s.depth == 0]
            for (test, config, fa) in dict.fromkeys((s.test, s.config, s.flash_attn) for s in tg):
                group = counted([s for s in tg if (s.test, s.config, s.flash_attn) == (test, config, fa)])
                values = [v for s in group for v in s.samples_ts]
                if not values or not decode:
                    continue
                sample = group[0]
                bench_flags = {"ngl": str(sample.ngl), "t": config.split()[1].removeprefix("t"),
                               "ctk": sample.type_k, "ctv": sample.type_v, "fa": str(fa)}
                differ = [f"{k} {flags[k]} vs {v}" for k, v in bench_flags.items()
                          if (flash_attn_flag(flags[k]) if k == "fa" else flags[k]) != (fa if k == "fa" else v)]
                files = [run.path / REQUESTS_FILE, *(links.result(sample_file(s)) for s in group)]
                ratio = float(np.mean(decode)) / float(np.mean(values))
                rows.append([loaded.campaign.label(artifact), host, f"{load.name} / {bench_name} {test}",
                             links.number(f"{np.mean(decode):.2f}", files[:1]),
                             links.number(f"{np.mean(values):.2f}", files[1:]), links.number(f"{ratio:.3f}", files),
                             "same" if not differ else "differ: " + ", ".join(differ)])
    if not rows:
        return []
    return ["## Deployed decode against llama-bench", "",
            "llama-server's own decode t/s, streamed, one request at a time, over llama-bench's tg of the same "
            "artifact on the same host.", "",
            *_table(["model", "host", "runs", "server t/s", "llama-bench t/s", "server / llama-bench", "settings"],
                    rows, align="lll"), ""]


def _sensitivity_section(compared: list[_Compared], links: _Links) -> list[str]:
    rows = []
    for c in compared:
        if len(c.pair.variants) < 2:
            continue
        base = c.pair.recorded.overall.gap.estimate
        files = list(c.pair.files)
        for variant in c.pair.variants:
            gap: SetGap = variant.overall
            moved = "" if variant is c.pair.recorded or gap.gap.empty else f"{(gap.gap.estimate - base) * 100:+.1f}"
            rows.append([c.name, c.evaluation, variant.label, links.number(str(gap.n), files),
                         links.number(points(gap.gap), files), moved])
    if not rows:
        return []
    return ["## Sensitivity", "", "The overall gap when the sceptic's switches are applied, and for GSM8K under "
            "lm-eval's strict-match and flexible-extract in place of rigctl's normalised score (B - A, points).", "",
            *_table(["comparison", "eval", "scoring", "n", "B - A, points", "moved"], rows, align="lll"), ""]


def _habits_section(loaded: LoadedCampaign, found: Located, links: _Links) -> list[str]:
    campaign = loaded.campaign
    rows = []
    for evaluation in campaign.evals:
        for target in evaluation.runs:
            run = found.evals.get((evaluation.name, target.id))
            if run is None:
                continue
            habits = answer_habits(run)
            file = [habits.file]
            for s in habits.sets:
                top = s.top_label
                rows.append([
                    campaign.target_label(target.id), evaluation.name, s.set, links.number(str(s.n), file),
                    links.number(f"{top[0]} {top[1]}", file) if top else "-",
                    links.number(", ".join(f"{k} {v}" for k, v in s.gold.items()), file) if s.gold else "-",
                    links.number(f"{s.cutoff}", file),
                    links.number(f"{s.toolless} of {s.tool_rows}", file) if s.tool_rows else "-",
                    links.number(str(s.missed_calls), file) if s.tool_rows else "-",
                ])
    if not rows:
        return []
    header = ["model", "eval", "set", "n", "most predicted", "gold", "cut off", "no tool call",
              "look like missed calls"]
    return ["## Answer habits", "", *_table(header, rows, align="lll"), ""]


def _runs_section(found: Located, links: _Links) -> list[str]:
    rows = []
    for run in sorted(found.runs(), key=lambda r: r.record.started):
        record = run.record
        what = (record.task.name if record.task else None) or ", ".join(a.name for a in record.artifacts)
        rows.append([f"[{run.host}/{run.id}]({links.rel(run.path / RUN_FILE)})", record.kind, what,
                     record.started[:19], record.status])
    if not rows:
        return []
    return ["## Runs", "", *_table(["run", "kind", "what", "started", "status"], rows, align="lllll"), ""]


# ----------------------------------------------------------------------------------------------- build


def _race_requests(run: StoredRun) -> list[RaceRequest]:
    """A drafting race's requests (:class:`rigctl.bench.drafting.RaceRequest` each)."""
    from rigctl.bench.drafting import REQUESTS_FILE, RaceRequest

    path = run.path / REQUESTS_FILE
    try:
        return [RaceRequest(**row) for row in read_jsonl(path)]
    except TypeError as exc:
        raise ConfigError(f"{path}: not a drafting race's requests: {exc}") from None


def _read_load_run(run: StoredRun) -> None:
    from rigctl.bench.load import load_levels, load_requests

    load_levels(run)
    load_requests(run)


#: What the sections read of a run of each kind: a run whose files cannot be read is left out up front,
#: so one bad run costs its own rows and never the report.
_READERS: dict[str, Callable[[StoredRun], object]] = {
    "bench": load_run_samples, "eval": load_answers, "spec": _race_requests, "load": _read_load_run}


def _leave_out_unreadable(found: Located) -> list[str]:
    """Each located run that its section cannot read becomes not pulled (None), with a warning naming it;
    one line per run left out, for the scope."""
    left_out = []
    for slots in (found.benches, found.evals, found.drafting, found.loads):
        for key, run in slots.items():
            if run is None:
                continue
            try:
                _READERS[run.record.kind](run)
            except Exception as exc:  # whatever a run's files provoke, the report goes on without it
                line = f"{run.host}/{run.id} ({one_line(exc)})"
                log.warning("report: leaving out %s", line)
                left_out.append(line)
                slots[key] = None
    return left_out


def build_report(loaded: LoadedCampaign, store: ResultsStore, out_dir: Path) -> Report:
    """Write ``out_dir/report.md`` and its charts from the pulled runs the campaign names."""
    campaign = loaded.campaign
    out_dir.mkdir(parents=True, exist_ok=True)
    for pattern in ("*.png", "flips-*.md"):
        for old in out_dir.glob(pattern):
            old.unlink()
    found = locate(loaded, store)
    unreadable = _leave_out_unreadable(found)
    links = _Links(out_dir, store.root)
    missing = [f"bench {b} on {h}" for (b, h), r in found.benches.items() if r is None]
    missing += [f"eval {e} {t}" for (e, t), r in found.evals.items() if r is None]
    missing += [f"drafting {d}" for d, r in found.drafting.items() if r is None]
    missing += [f"load {name}" for name, r in found.loads.items() if r is None]
    missing += [f"upgrade {name}" for name, r in found.upgrades.items() if r is None]
    charts: list[Path] = []
    speed: list[str] = ["## Speed", ""]
    for bench in campaign.benches:
        for host in bench.hosts:
            run = found.benches[(bench.name, host)]
            if run is None:
                speed += [f"### {bench.name} on {host}", "", "Nothing pulled yet.", ""]
            else:
                speed += _bench_section(bench, host, run, links, out_dir, loaded, charts)
    if not campaign.benches:
        speed = []
    quality = _quality_section(loaded, found, links, out_dir, charts) if campaign.evals else []
    compared, problems = _comparisons(loaded, found)
    load = _load_section(loaded, found, links, out_dir, charts)
    forest = None
    if compared:
        forest = out_dir / "comparisons-forest.png"
        _forest_plot(forest, compared)
        charts.append(forest)
    lines = [f"# {campaign.title}", "", *_scope(loaded, found, missing, unreadable, compared), *speed, *quality,
             *_comparison_sections(loaded, compared, problems, links, forest),
             *_flips_section(compared, links, out_dir),
             *_drafting_section(loaded, found, links), *load, *_upgrades_section(found, store, links, out_dir, charts),
             *_deployed_section(loaded, found, links),
             *_sensitivity_section(compared, links),
             *_habits_section(loaded, found, links), *_runs_section(found, links)]
    markdown = "\n".join(lines).rstrip() + "\n"
    path = out_dir / "report.md"
    write_atomically(path, markdown)
    headline = "\n".join([*speed, *quality, *_comparison_sections(loaded, compared, problems, links),
                          *_drafting_section(loaded, found, links), *load]).strip()
    return Report(path=path, markdown=markdown, charts=charts, headline=plain(headline), missing=missing)


def plain(markdown: str) -> str:
    """Markdown tables for a terminal: link text kept, link targets, superscript links and images dropped."""
    text = re.sub(r"<sup>\[\d+\]\([^)]*\)</sup>", "", markdown)
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)\n?", "", text)
    return re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)


def default_out_dir(loaded: LoadedCampaign) -> Path:
    return Path("reports") / loaded.campaign.name
