"""``rigctl build status|rollback``: the llama.cpp builds on the hosts."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from rigctl.cli.common import LimitOption, console, load_inventory
from rigctl.cli.render import about_host, print_event, print_task
from rigctl.errors import RigctlError

app = typer.Typer(no_args_is_help=True, help="llama.cpp builds on the hosts: status and rollback.")


@app.command("status")
def build_status(limit: LimitOption = None) -> None:
    """The llama.cpp build each host runs (current) and keeps for rollback (previous); a host that cannot be
    read gets a row saying why, and the command exits 1."""
    from rigctl.fleet.build import read_builds
    from rigctl.ssh import on_each_host

    table = Table(title="llama.cpp builds")
    for column in ("host", "current", "key", "CPU", "CUDA", "built on", "previous"):
        table.add_column(column)
    failed = False
    for name, builds in on_each_host(load_inventory().select(limit), read_builds,
                                     thread_name_prefix="rigctl-builds").items():
        if isinstance(builds, RigctlError):
            table.add_row(name, Text.assemble(("unreadable: ", "red"), about_host(name, builds)),
                          "-", "-", "-", "-", "-")
            failed = True
            continue
        cur = builds.current
        table.add_row(name, str(cur) if cur else "-", cur.key if cur else "-", cur.cpu if cur else "-",
                      (cur.cuda_architectures or "on") if cur and cur.cuda else "off",
                      cur.built_on if cur else "-", str(builds.previous) if builds.previous else "-")
    console.print(table)
    if failed:
        raise typer.Exit(1)


@app.command("rollback")
def build_rollback(host: Annotated[str, typer.Argument(help="Host from the inventory.")]) -> None:
    """Make HOST's previous llama.cpp build current again. The next `rigctl provision` restores the
    inventory's pin."""
    from rigctl.fleet.build import rollback

    result = rollback(load_inventory(), host, on_event=print_event, on_task=print_task)
    console.print(f"{result.host}: current is now {result.after} (was {result.before})", highlight=False)
