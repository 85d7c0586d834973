"""The report section of an ``upgrade`` or ``bisect`` record: both builds, every gate's figures with links to
the raw files they came from, the flags checked, the verdict and the rollout; a bisect's steps. Rendered alone
(``rigctl report RUN``, :func:`rigctl.analysis.report.build.build_run_report`) or inside a campaign's report
(a campaign's ``upgrades``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rigctl.analysis.campaign import Located
from rigctl.analysis.report.markdown import Links, md_table
from rigctl.charts import new_figure, save_png
from rigctl.errors import ConfigError
from rigctl.results.record import ANSWERS_FILE
from rigctl.results.store import ResultsStore, StoredRun


def _num(value: Any, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _build_row(label: str, build: Mapping[str, Any] | None, how: str = "") -> list[str]:
    if not build:
        return [label, "-", "-", "-", "-", "-", how]
    flags = " ".join(f for f in build.get("cmake_flags") or [] if "BUILD_TYPE" in f or "NATIVE" in f)
    return [label, str(build.get("name")), str(build.get("version")), str(build.get("build_number")),
            str(build.get("key")), flags or "-", how]


def _gate_files(run: StoredRun, result: Mapping[str, Any], links: Links, store: ResultsStore) -> list[Path]:
    detail = result.get("detail") or {}
    if result["gate"].startswith("bench "):
        return [links.result(f) for f in detail.get("files") or []]
    if detail.get("file"):
        return [run.path / str(detail["file"])]
    if result["gate"] == "quality":
        paths = []
        for ref in detail.get("runs") or []:
            try:
                paths.append(store.find(ref).path / ANSWERS_FILE)
            except ConfigError:
                continue
        return paths
    return []


def _measured(extra: Mapping[str, Any]) -> str:
    """The instances the gates measured, with their profiles (a record from before: its one instance)."""
    rows = extra.get("instances")
    if isinstance(rows, list) and rows:
        return "instances " + ", ".join(f"{r.get('instance')} ({r.get('profile')})" for r in rows
                                        if isinstance(r, Mapping))
    return f"instance {extra.get('instance')}"


def _interval(result: Mapping[str, Any]) -> str:
    if result.get("estimate") is None:
        return "-"
    if result["gate"] == "quality":
        return (f"{result['estimate'] * 100:+.1f} points [{_num((result.get('low') or 0) * 100, 1)}, "
                f"{_num((result.get('high') or 0) * 100, 1)}]")
    if result["gate"] == "identity":
        return f"{result['estimate']:.0%} [{_num(result.get('low'), 2)}, {_num(result.get('high'), 2)}]"
    if result["gate"] == "errors":
        return f"{result['estimate']:+.0f}"
    return f"{result['estimate']:.3f}x [{_num(result.get('low'))}, {_num(result.get('high'))}]"


def _threshold(result: Mapping[str, Any]) -> str:
    threshold = result.get("threshold")
    if threshold is None:
        return "-"
    if result["gate"] == "quality":
        return f"±{threshold * 100:g} points"
    if result["gate"] == "identity":
        return f">= {threshold:.0%}"
    if result["gate"] == "errors":
        return f"<= {threshold:g} new"
    return f"low >= {threshold:g}x"


def _gatesmd_table(run: StoredRun, results: Sequence[Mapping[str, Any]], links: Links,
                 store: ResultsStore) -> list[str]:
    rows = []
    for result in results:
        files = _gate_files(run, result, links, store)
        where = f"{result['instance']} ({result.get('profile')})" if result.get("instance") else "extra point"
        rows.append([where, result["gate"], result["verdict"], links.number(_interval(result), files),
                     str(result.get("n")), _threshold(result), result["figures"]])
    # One row per instance and gate: what each deployed instance, at its own profile, measured.
    return md_table(["instance (profile)", "gate", "verdict", "ratio or share [interval]", "n", "threshold",
                     "figures"], rows, "lllrrll")


def _ratio_chart(path: Path, rows: Sequence[tuple[str, Mapping[str, Any]]], threshold: float, threshold_label: str,
                 title: str, xlabel: str) -> bool:
    """Each labelled gate result's estimate with its interval, coloured by verdict, against ``threshold``."""
    rows = [(label, r) for label, r in rows  # a low end of 0 is a figure (an identity share), not a missing one
            if r.get("estimate") is not None and r.get("low") is not None and not math.isnan(r["low"])]
    if not rows:
        return False
    fig, ax = new_figure(figsize=(7, 0.5 * len(rows) + 1.2))
    for y, (_, r) in enumerate(rows):
        colour = {"pass": "tab:green", "fail": "tab:red"}.get(r["verdict"], "tab:orange")
        ax.errorbar([r["estimate"]], [y], xerr=[[r["estimate"] - r["low"]], [r["high"] - r["estimate"]]], fmt="o",
                    color=colour, capsize=4)
    ax.axvline(threshold, color="grey", linestyle="--", label=threshold_label)
    ax.axvline(1.0, color="black", linewidth=0.5)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(loc="best")
    save_png(fig, path, dpi=100)
    return True


def upgrade_section(run: StoredRun, links: Links, store: ResultsStore, out_dir: Path,
                    charts: list[Path], level: int = 2) -> list[str]:
    # rigctl.upgrade's modules bring the fleet, SSH and HTTP clients: a second of every report's start, imported
    # only where a campaign has an upgrade or bisect run to show.
    from rigctl.upgrade.paired import IDENTITY_FILE, SERVER_FILE
    from rigctl.upgrade.record import checked_extra
    from rigctl.upgrade.upgrade import HELP_DIR

    record = run.record
    extra = checked_extra(run)
    head = "#" * level
    verdict = extra.get("verdict") or record.status
    title = f"{head} Upgrade {extra.get('from')} -> {extra.get('label') or extra.get('to')} on {record.host}: {verdict}"
    measurement = extra.get("measurement") or {}
    results = measurement.get("results") or []
    record_link = links.number(f"{run.host}/{run.id}", [run.path / "run.json"])
    lines = [title, "",
             f"Canary {extra.get('canary')} ({_measured(extra)}), scope "
             f"{', '.join(extra.get('scope') or [])}; {record.started} to {record.ended or '-'}; record {record_link}.",
             ""]
    for problem in extra.get("problems") or []:
        lines += [f"**Refused:** {problem}", ""]
    if extra.get("error"):
        lines += [f"**Stopped by an error:** {extra['error']}", ""]
    candidate = extra.get("candidate") or {}
    lines += md_table(["side", "build", "version", "build number", "key", "CMake", "how built"],
                    [_build_row("current", extra.get("current")),
                     _build_row("candidate", candidate, f"{candidate.get('plan', '-')} "
                                f"{_num(candidate.get('seconds'), 0)} s" if candidate else "")], "llrrlll") + [""]
    help_dir = run.path / HELP_DIR
    if help_dir.is_dir():
        helps = sorted(help_dir.iterdir())
        lines += ["Flags: every profile of the scope's servers checked against "
                  + ", ".join(links.number(p.stem + " --help", [p]) for p in helps)
                  + (f"; unknown: {len(extra['problems'])}" if extra.get("refused_by") == "flags" else "; all known")
                  + ".", ""]
    if results:
        gates = extra.get("gates") or {}
        chart = out_dir / f"upgrade-{run.id}.png"
        speed = [(f"{r['gate']} {r.get('instance') or ''}".strip(), r) for r in results
                 if r["gate"].startswith(("bench ", "server "))]
        margin = float(gates.get("speed_margin") or 0.95)
        if _ratio_chart(chart, speed, margin, f"margin {margin:g}x", f"{run.host}/{run.id}",
                        "candidate / current (speed; 95% interval)"):
            charts.append(chart)
            lines += [f"![speed ratios]({links.rel(chart)})", ""]
        lines += _gatesmd_table(run, results, links, store) + [""]
        bench = measurement.get("bench_runs") or []
        evals = measurement.get("eval_runs") or {}
        raw = [links.number(ref, [store.find(ref).path / "run.json"]) for ref in bench if _exists(store, ref)]
        raw += [links.number(f"{label}: {ref}", [store.find(ref).path / "run.json"]) for label, ref in evals.items()
                if _exists(store, ref)]
        for name in (SERVER_FILE, IDENTITY_FILE):
            if (run.path / name).is_file():
                raw.append(links.number(name, [run.path / name]))
        lines += [f"Raw measurements: {', '.join(raw)}.", ""]
    rollout = extra.get("rollout") or []
    if rollout:
        lines += [f"{head}# Rollout", ""]
        lines += md_table(["host", "ok", "current", "seconds", "servers"],
                        [[r["host"], "yes" if r["ok"] else f"no: {r.get('error')}", str(r.get("current")),
                          _num(r.get("seconds"), 0),
                          ", ".join(f"{s['server']} ({s.get('build_info')})" for s in r.get("servers") or [])]
                         for r in rollout], "lllrl") + [""]
    if extra.get("written"):
        lines += [f"Pin written to {', '.join(extra['written'])}.", ""]
    return lines


def _exists(store: ResultsStore, ref: str) -> bool:
    try:
        store.find(ref)
    except ConfigError:
        return False
    return True


def bisect_section(run: StoredRun, links: Links, store: ResultsStore, out_dir: Path, charts: list[Path],
                   level: int = 2) -> list[str]:
    from rigctl.upgrade.bisect import STEPS_FILE  # imported here as in upgrade_section
    from rigctl.upgrade.record import checked_extra, checked_steps

    record = run.record
    extra = checked_extra(run)
    head = "#" * level
    steps = checked_steps(run.path / STEPS_FILE)
    found = (f"first bad build **{extra['first_bad']}**, last good {extra.get('last_good')}" if extra.get("first_bad")
             else f"undecided between {', '.join(extra.get('undecided_between') or [])}"
             if extra.get("undecided_between") else record.status)
    lines = [f"{head} Bisect {extra.get('good')} .. {extra.get('bad')} on {record.host} by {extra.get('gate')}: "
             f"{found}", "", f"Builds in order: {', '.join(extra.get('builds') or [])}; measured against the good end "
             f"{extra.get('good')}; record {links.number(f'{run.host}/{run.id}', [run.path / 'run.json'])}"
             + (f", resumed {len(extra['resumed'])} time(s)" if extra.get("resumed") else "") + ".", ""]
    rows = []
    order = {label: i for i, label in enumerate(extra.get("builds") or [])}
    steps = sorted(steps, key=lambda s: order.get(s["label"], 0))
    measured = [(s["label"], s.get("gate") or {}) for s in steps]
    threshold = next((gate["threshold"] for _, gate in measured if gate.get("threshold") is not None), None)
    chart = out_dir / f"{run.id}.png"
    speed = str(extra.get("gate") or "").startswith(("bench ", "server "))
    # Reversed: the chart's rows count up from the bottom, so it reads top-down in build order like the table.
    if threshold is not None and _ratio_chart(
            chart, measured[::-1], float(threshold), f"margin {threshold:g}x" if speed else f"floor {threshold:g}",
            f"{run.host}/{run.id}", f"{extra.get('gate')}: each build against {extra.get('good')} (95% interval)"):
        charts.append(chart)
        lines += [f"![each build against the good end]({links.rel(chart)})", ""]
    for step in steps:
        gate = step.get("gate") or {}
        files = [links.result(f) for f in (gate.get("detail") or {}).get("files") or []]
        rows.append([step["label"], step["verdict"], links.number(_interval(gate), files), str(gate.get("n")),
                     f"{step['plan']} {_num(step.get('build_s'), 0)} s", step["build"]])
    lines += md_table(["build", "verdict", "ratio against the good end [interval]", "n", "how built", "install"], rows,
                    "llrrll") + [""]
    if (run.path / STEPS_FILE).is_file():
        lines += [f"Steps: {links.number(STEPS_FILE, [run.path / STEPS_FILE])}.", ""]
    return lines


def upgrades_section(found: Located, store: ResultsStore, links: Links, out_dir: Path,
                     charts: list[Path]) -> list[str]:
    """A campaign's upgrade steps, each its record's section."""
    if not found.upgrades:
        return []
    lines = ["## Upgrades", ""]
    for name, run in found.upgrades.items():
        if run is None:
            lines += [f"### {name}", "", "Not run yet.", ""]
        else:
            lines += upgrade_section(run, links, store, out_dir, charts, level=3)
    return lines
