"""The campaign report: Markdown with PNG charts, built only from pulled raw result files.

Sections: scope line (hosts, builds, dates, repeats, runs, the smallest gap each comparison can detect, what
is missing or was not measured); speed (mean t/s ± sd per test and model over the unthrottled cells, ratio
with a bootstrap interval from the per-repetition samples, cold -> steady, the throttled cells, a by-depth
table for depth sweeps, every tg figure against the memory-bandwidth bound of :mod:`rigctl.bench.bandwidth`
with impossible ones flagged instead of printed); quality (score per set and overall with intervals); the
campaign's comparisons grouped as head-to-head, quantisation cost and what QAT is worth (paired gaps in
points, McNemar's exact or a sign-flip test with the discordant counts, Holm-adjusted p-values across the
campaign's comparisons, the equivalence verdict) with a forest plot of every gap against its equivalence band;
flips (questions right -> wrong and wrong -> right, each listed with both replies in a flips file beside the
report); KL divergence against the reference (mean, 99th percentile and same top-1 with intervals over chunks,
and the paired gaps between hosts and between artifacts); drafting speedups (rigctl bench spec races); load
curves (rigctl bench load) and deployed decode over llama-bench tg; sensitivity (the gap under each switch);
answer habits; the runs used. Every number is a link to the raw file(s) it was computed from (llama-bench JSON
of each cell, ``answers.jsonl``, the race's and the load curve's ``requests.jsonl``), relative to the report,
so the report stays valid when the results tree and the report move together.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rigctl.analysis.campaign import LoadedCampaign, Located, locate
from rigctl.analysis.compare import (
    effective_flags,
    load_answers,
)
from rigctl.analysis.kld import kld_extra, load_tokens
from rigctl.analysis.report.kld import kld_section
from rigctl.analysis.report.markdown import NOT_PULLED, Links, md_table
from rigctl.analysis.report.quality import (
    Compared,
    _forest_plot,
    compared_pairs,
    comparison_sections,
    detectable_text,
    flips_section,
    habits_section,
    quality_section,
    sensitivity_section,
)
from rigctl.analysis.report.serving import (
    deployed_section,
    drafting_section,
    load_section,
    race_requests,
    read_load_run,
)
from rigctl.analysis.report.speed import bench_section
from rigctl.analysis.report.upgrade import bisect_section, upgrade_section, upgrades_section
from rigctl.bench.matrix import load_run_samples
from rigctl.errors import ConfigError, one_line
from rigctl.files import write_atomically
from rigctl.results.record import RUN_FILE
from rigctl.results.store import ResultsStore, StoredRun

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


@dataclass
class Report:
    path: Path
    markdown: str
    charts: list[Path] = field(default_factory=list)
    headline: str = ""  # the speed and quality tables, for printing after a run
    missing: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- sections


def _scope(loaded: LoadedCampaign, found: Located, missing: list[str], unreadable: list[str],
           compared: list[Compared]) -> list[str]:
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
        detectable_text(compared),
        f"Not measured: {', '.join(campaign.not_measured)}." if campaign.not_measured else "",
        f"Not pulled yet: {'; '.join(missing)}." if missing else "",
        f"Left out, their files unreadable: {'; '.join(unreadable)}." if unreadable else "",
    ]
    return [" ".join(p for p in parts if p), ""]


def _runs_section(found: Located, links: Links) -> list[str]:
    rows = []
    for run in sorted(found.runs(), key=lambda r: r.record.started):
        record = run.record
        what = (record.task.name if record.task else None) or ", ".join(a.name for a in record.artifacts)
        rows.append([f"[{run.host}/{run.id}]({links.rel(run.path / RUN_FILE)})", record.kind, what,
                     record.started[:19], record.status])
    if not rows:
        return []
    flags = [f"- **effective configuration** of {run.host}/{run.id}: {flag}"
             for run in sorted(found.runs(), key=lambda r: r.record.started) for flag in effective_flags(run)]
    return ["## Runs", "", *md_table(["run", "kind", "what", "started", "status"], rows, align="lllll"), "",
            *([*flags, ""] if flags else [])]


#: What the sections read of a run of each kind: a run whose files cannot be read is left out up front,
#: so one bad run costs its own rows and never the report.
_READERS: dict[str, Callable[[StoredRun], object]] = {
    "bench": load_run_samples, "eval": load_answers, "spec": race_requests, "load": read_load_run,
    "kld": lambda run: [load_tokens(run, model) for model in kld_extra(run)["models"]]}


def _leave_out_unreadable(found: Located) -> list[str]:
    """Each located run that its section cannot read becomes not pulled (None), with a warning naming it;
    one line per run left out, for the scope."""
    left_out = []
    for slots in (found.benches, found.evals, found.drafting, found.loads, found.klds):
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
    links = Links(out_dir, store.root)
    missing = [f"bench {b} on {h}" for (b, h), r in found.benches.items() if r is None]
    missing += [f"eval {e} {t}" for (e, t), r in found.evals.items() if r is None]
    missing += [f"drafting {d}" for d, r in found.drafting.items() if r is None]
    missing += [f"load {name}" for name, r in found.loads.items() if r is None]
    missing += [f"kld {k} on {h}" for (k, h), r in found.klds.items() if r is None]
    missing += [f"upgrade {name}" for name, r in found.upgrades.items() if r is None]
    charts: list[Path] = []
    speed: list[str] = ["## Speed", ""]
    for bench in campaign.benches:
        for host in bench.hosts:
            run = found.benches[(bench.name, host)]
            if run is None:
                speed += [f"### {bench.name} on {host}", "", NOT_PULLED, ""]
            else:
                speed += bench_section(bench, host, run, links, out_dir, loaded, charts)
    if not campaign.benches:
        speed = []
    quality = quality_section(loaded, found, links, out_dir, charts) if campaign.evals else []
    kld = kld_section(loaded, found, links)
    compared, problems = compared_pairs(loaded, found)
    load = load_section(loaded, found, links, out_dir, charts)
    forest = None
    if compared:
        forest = out_dir / "comparisons-forest.png"
        _forest_plot(forest, compared)
        charts.append(forest)
    lines = [f"# {campaign.title}", "", *_scope(loaded, found, missing, unreadable, compared), *speed, *quality,
             *comparison_sections(loaded, compared, problems, links, forest),
             *flips_section(compared, links, out_dir), *kld,
             *drafting_section(loaded, found, links), *load, *upgrades_section(found, store, links, out_dir, charts),
             *deployed_section(loaded, found, links),
             *sensitivity_section(compared, links),
             *habits_section(loaded, found, links), *_runs_section(found, links)]
    markdown = "\n".join(lines).rstrip() + "\n"
    path = out_dir / "report.md"
    write_atomically(path, markdown)
    headline = "\n".join([*speed, *quality, *comparison_sections(loaded, compared, problems, links), *kld,
                          *drafting_section(loaded, found, links), *load]).strip()
    return Report(path=path, markdown=markdown, charts=charts, headline=plain(headline), missing=missing)


def build_run_report(run: StoredRun, store: ResultsStore, out_dir: Path) -> Report:
    """``out_dir/report.md`` for one upgrade or bisect record."""
    if run.record.kind not in ("upgrade", "bisect"):
        raise ConfigError(f"{run.host}/{run.id}: a {run.record.kind} run; `rigctl report` takes a campaign file, "
                          "or an upgrade or bisect run")
    out_dir.mkdir(parents=True, exist_ok=True)
    links = Links(out_dir, store.root)
    charts: list[Path] = []
    body = upgrade_section(run, links, store, out_dir, charts, level=1) if run.record.kind == "upgrade" else \
        bisect_section(run, links, store, out_dir, charts, level=1)
    markdown = "\n".join(body).rstrip() + "\n"
    path = out_dir / "report.md"
    write_atomically(path, markdown)
    return Report(path=path, markdown=markdown, charts=charts, headline=plain(markdown))


def plain(markdown: str) -> str:
    """Markdown tables for a terminal: link text kept, link targets, superscript links and images dropped."""
    text = re.sub(r"<sup>\[\d+\]\([^)]*\)</sup>", "", markdown)
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)\n?", "", text)
    return re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)


def default_out_dir(loaded: LoadedCampaign) -> Path:
    return Path("reports") / loaded.campaign.name
