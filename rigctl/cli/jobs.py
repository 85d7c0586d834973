"""``rigctl jobs`` and ``rigctl pull``: the detached jobs on the hosts and bringing their runs home."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from rigctl.cli.common import ResultsOption, console, err_console, load_inventory, results_store
from rigctl.cli.render import about_host, outside_text, print_pull
from rigctl.errors import RigctlError


def jobs_list(host: Annotated[str | None, typer.Argument(help="Host or group (default: all).")] = None) -> None:
    """Jobs on the hosts: state and progress, newest last."""
    from rigctl import jobs

    table = Table(title="jobs")
    for column in ("host", "job", "state", "progress", "message", "started", "ended"):
        table.add_column(column)
    failed = False
    for name, outcome in jobs.jobs_on_hosts(load_inventory().select(host, where="HOST")).items():
        if isinstance(outcome, RigctlError):
            err_console.print(about_host(name, outcome), soft_wrap=True)
            failed = True
            continue
        for info in outcome:
            table.add_row(*(outside_text(cell) for cell in (
                info.host, info.id, info.state, f"{info.done}/{info.total}" if info.total else "-",
                info.error or info.message, info.started or "-", info.ended or "-")))
    console.print(table)
    if failed:
        raise typer.Exit(1)


def pull(
    host: Annotated[str | None, typer.Argument(help="Host or group (default: all).")] = None,
    results: ResultsOption = None,
) -> None:
    """Copy finished runs home over SFTP (sha256-checked); runs already here are not copied again."""
    from rigctl import jobs

    if not print_pull(jobs.pull_hosts(load_inventory().select(host, where="HOST"), results_store(results))):
        raise typer.Exit(1)
