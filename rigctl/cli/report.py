"""``rigctl report``: a campaign's Markdown report from pulled results."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rigctl.cli.common import CampaignArg, ResultsOption, console, err_console, results_store


def report(
    campaign: CampaignArg,
    results: ResultsOption = None,
    out: Annotated[Path | None, typer.Option("--out", help="Report directory (default reports/<campaign name>).")
                   ] = None,
) -> None:
    """Build the campaign's Markdown report with PNG charts from pulled results: speed with ratios,
    quality with intervals, comparisons, sensitivity, answer habits and a scope line; every number
    links to its raw files."""
    from rigctl.analysis.campaign import load_campaign
    from rigctl.analysis.report import build_report, default_out_dir

    loaded = load_campaign(campaign)
    built = build_report(loaded, results_store(results), out or default_out_dir(loaded))
    console.print(built.headline, markup=False, highlight=False, soft_wrap=True)
    console.print(f"\nreport: {built.path} ({len(built.charts)} charts)", markup=False, highlight=False)
    if built.missing:
        err_console.print(f"not pulled yet: {'; '.join(built.missing)} (rigctl campaign run {campaign})",
                          markup=False, highlight=False, soft_wrap=True)
