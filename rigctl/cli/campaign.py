"""``rigctl campaign run``: run what a campaign's report still lacks; the work is in :mod:`rigctl.analysis.campaign`."""

from __future__ import annotations

import typer

from rigctl.cli.common import CampaignArg, ResultsOption, console, err_console, load_inventory, results_store

app = typer.Typer(no_args_is_help=True, help="Campaign files: run what a report needs.")


@app.command("run")
def campaign_run(campaign: CampaignArg, results: ResultsOption = None) -> None:
    """Pull every host, then run the benches and evals the campaign's report still lacks (stopped eval
    runs resume). Safe to interrupt and run again."""
    from rigctl.analysis.campaign import describe, load_campaign, run_campaign

    loaded = load_campaign(campaign)
    outcomes = run_campaign(loaded, load_inventory(), results_store(results),
                            on_step=lambda line: err_console.print(line, markup=False, highlight=False))
    for line, outcome in zip(describe(outcomes), outcomes, strict=True):
        (err_console if outcome.status == "failed" else console).print(line, markup=False, highlight=False,
                                                                        soft_wrap=True)
    if any(o.status == "failed" for o in outcomes):
        raise typer.Exit(1)
