"""The report's speed sections: mean t/s per test and model over the unthrottled cells with a ratio and its
bootstrap interval, cold -> steady, the throttled cells, the by-depth tables of depth sweeps, every tg figure
against the memory-bandwidth bound; and their charts."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rigctl.analysis.campaign import CampaignBench, LoadedCampaign
from rigctl.analysis.format import ratio_text
from rigctl.analysis.report.markdown import Links, md_table, mean_sd
from rigctl.analysis.speed import compare_bench, sample_file
from rigctl.bench.bandwidth import NO_FIGURE, DecodeBound, decode_bound
from rigctl.bench.matrix import BenchSample, cold_and_steady, counted, load_run_samples, throttled_cells
from rigctl.charts import new_figure, save_png
from rigctl.results.store import StoredRun

if TYPE_CHECKING:
    pass


def bench_section(bench: CampaignBench, host: str, run: StoredRun, links: Links, out_dir: Path,
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
                row.append(links.number(mean_sd(values), files) + note if values else "-")
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
    lines += md_table(header, rows, align="ll")
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


def _bound_table(by_key, bounds, models, campaign, links: Links) -> list[str]:
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
            *md_table(["test", "settings", "model", "t/s", "read per token", "bound t/s", "share of the bound"], rows,
                    align="lll"), ""]


def _depth_table(bench: CampaignBench, host: str, by_key, models, campaign, links: Links, out_dir: Path,
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
            *md_table(header, rows, align="lll"), "", f"![{bench.name} on {host} by depth]({chart.name})", ""]


def _depth_chart(path: Path, curves: dict[str, dict[str, list[tuple[int, float]]]], label, title: str) -> None:
    fig, axes = new_figure(1, len(curves), figsize=(max(4, 3.6 * len(curves)), 3.4), squeeze=False)
    for ax, (test, per_model) in zip(axes[0], curves.items(), strict=True):
        for m, curve in per_model.items():
            ax.plot([d for d, _ in curve], [v for _, v in curve], marker="o", label=label(m))
        ax.set_title(test, fontsize=9)
        ax.set_xlabel("depth (tokens)")
        ax.set_ylabel("t/s")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_png(fig, path)


def _speed_chart(path: Path, rows: list[tuple[str, dict[str, tuple[float, float]]]], models: list[str],
                 label, title: str) -> None:
    fig, axes = new_figure(1, len(rows), figsize=(max(4, 2.6 * len(rows)), 3.4), squeeze=False)
    for ax, (test, stats) in zip(axes[0], rows, strict=True):
        names = [m for m in models if m in stats]
        ax.bar(range(len(names)), [stats[m][0] for m in names], yerr=[stats[m][1] for m in names], capsize=4,
               color=[f"C{models.index(m)}" for m in names])
        ax.set_xticks(range(len(names)), [label(m) for m in names], rotation=20, ha="right", fontsize=8)
        ax.set_title(test, fontsize=9)
        ax.set_ylabel("t/s")
    fig.suptitle(title, fontsize=10)
    save_png(fig, path)
