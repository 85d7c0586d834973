"""``rigctl servers``: the fleet's llama-server instances (state, restart, logs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from rigctl.cli.common import LimitOption, console, finite, load_inventory
from rigctl.cli.render import outside_text

if TYPE_CHECKING:  # the fleet's modules load SSH and HTTP clients: imported where used
    from rigctl.fleet.servers import ServerStatus

app = typer.Typer(no_args_is_help=False, invoke_without_command=True,
                  help="llama-server instances: state, port, model, build, health; restart; logs.")

_STATE_STYLE = {"active": "green", "failed": "red", "unreachable": "red", "activating": "yellow"}


@app.callback()
def servers_list(
    ctx: typer.Context,
    limit: LimitOption = None,
) -> None:
    """Every instance: systemd state and main PID, port, model and build (/props), health."""
    if ctx.invoked_subcommand is not None:
        return
    from rigctl.fleet.servers import list_servers

    rows = list_servers(load_inventory(), limit)
    console.print(servers_table(rows))
    if any(r.enabled and not r.healthy for r in rows):
        raise typer.Exit(1)


def servers_table(rows: list[ServerStatus]) -> Table:
    """The instances' table. What systemd, the server or the host said (state, model, build, health) is
    shown as text, styled, never read as markup."""
    table = Table(title="llama-server instances")
    for column in ("host", "server", "state", "pid", "port", "artifact", "profile", "model", "build", "health"):
        table.add_column(column)
    for row in rows:
        state = outside_text(row.state + ("" if row.enabled else " (disabled)"))
        state.stylize(_STATE_STYLE.get(row.state, "yellow"))
        if row.pending_restart:  # files a play wrote and did not get to apply: the next provision restarts it
            pending = outside_text(f" pending restart ({', '.join(row.pending_restart)})")
            pending.stylize("yellow")
            state.append(pending)
        if row.config_files:  # drift on the host: its sandbox hides them, a llama.cpp started by hand reads them
            found = outside_text(f" config file on host: {', '.join(row.config_files)}")
            found.stylize("yellow")
            state.append(found)
        if row.healthy and row.health == "ok":
            health = Text("ok", style="green")
        elif row.health == "disabled":
            health = Text("-", style="dim")
        else:
            health = outside_text(row.error or row.health)
            health.stylize("red")
        table.add_row(row.host, row.name, state, outside_text(row.main_pid or "-"), str(row.port), row.artifact,
                      row.profile, outside_text(row.model or "-"), outside_text(row.build or "-"), health)
    return table


@app.command("restart")
def servers_restart(
    host: Annotated[str, typer.Argument(help="Host from the inventory.")],
    server: Annotated[str, typer.Argument(help="Instance name (llama_server_instances).")],
    timeout: Annotated[float, typer.Option(callback=finite, help="Seconds to wait for /health 200.")] = 120.0,
) -> None:
    """Restart one instance and wait until it answers /health 200."""
    from rigctl.fleet.servers import restart

    status = restart(load_inventory(), host, server, timeout)
    console.print(outside_text(f"{status.host}/{status.name}: {status.state}, pid {status.main_pid}, {status.model} "
                               f"({status.build})"))


@app.command("logs")
def servers_logs(
    host: Annotated[str, typer.Argument(help="Host from the inventory.")],
    server: Annotated[str, typer.Argument(help="Instance name (llama_server_instances).")],
    lines: Annotated[int, typer.Option("-n", "--lines", help="Journal lines.")] = 50,
) -> None:
    """The last journal lines of one instance."""
    from rigctl.fleet.servers import logs

    console.print(outside_text(logs(load_inventory(), host, server, lines), lines=True), end="")
