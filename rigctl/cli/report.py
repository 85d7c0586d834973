"""``rigctl report``: a campaign's Markdown report from pulled results."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rigctl.cli.common import ResultsOption, console, err_console, results_store
from rigctl.cli.render import outside_text


def report(
    campaign: Annotated[Path, typer.Argument(help="Campaign file (YAML), or an upgrade or bisect run "
                                                  "(host/run id).")],
    results: ResultsOption = None,
    out: Annotated[Path | None, typer.Option("--out", help="Report directory (default reports/<campaign name>, "
                                                           "reports/<run id>).")] = None,
) -> None:
    """Build the campaign's Markdown report with PNG charts from pulled results: speed with ratios,
    quality with intervals, comparisons, sensitivity, answer habits and a scope line; every number
    links to its raw files. Given an upgrade or bisect run instead: its builds, gates, verdict and rollout."""
    from rigctl.analysis.campaign import load_campaign
    from rigctl.analysis.report import build_report, default_out_dir

    if not campaign.is_file() and campaign.suffix not in (".yml", ".yaml"):
        from rigctl.analysis.report.build import build_run_report

        store = results_store(results)
        run = store.find(str(campaign))
        built = build_run_report(run, store, out or Path("reports") / run.id)
        # An upgrade's or a bisect's record: versions, hosts and gate figures as the rigs wrote them.
        console.print(outside_text(built.headline, lines=True), soft_wrap=True)
        console.print(outside_text(f"\nreport: {built.path} ({len(built.charts)} charts)", lines=True))
        return
    loaded = load_campaign(campaign)
    built = build_report(loaded, results_store(results), out or default_out_dir(loaded))
    console.print(outside_text(built.headline, lines=True), soft_wrap=True)
    console.print(outside_text(f"\nreport: {built.path} ({len(built.charts)} charts)", lines=True))
    if built.missing:
        err_console.print(outside_text(f"not pulled yet: {'; '.join(built.missing)} (rigctl campaign run {campaign})"),
                          soft_wrap=True)
