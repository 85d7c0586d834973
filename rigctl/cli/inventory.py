"""``rigctl inventory check``."""

from __future__ import annotations

import typer

from rigctl.cli.common import console, err_console, load_inventory

app = typer.Typer(no_args_is_help=True, help="The inventory: validate it.")


@app.command("check")
def inventory_check() -> None:
    """Validate the inventory: types, required keys, unique ports, models and profiles defined, pins."""
    from rigctl.fleet.deploy import roles_paths
    from rigctl.inventory.check import check

    inv = load_inventory()
    problems = check(inv, roles_paths(inv))
    for problem in problems:
        (console if problem.severity == "warning" else err_console).print(str(problem), markup=False,
                                                                            highlight=False, soft_wrap=True)
    errors = [p for p in problems if p.severity == "error"]
    warnings = len(problems) - len(errors)
    summary = f"{inv.source}: {len(inv.hosts)} hosts, {len(errors)} errors, {warnings} warnings"
    if errors:
        err_console.print(summary, markup=False, highlight=False)
        raise typer.Exit(2)
    console.print(summary, markup=False, highlight=False)
