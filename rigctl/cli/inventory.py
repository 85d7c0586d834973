"""``rigctl inventory check``; ``rigctl init``: a starter inventory."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from rigctl.cli.common import console, err_console, load_inventory
from rigctl.errors import RigctlError

app = typer.Typer(no_args_is_help=True, help="The inventory: validate it.")


@app.command("check")
def inventory_check() -> None:
    """Validate the inventory: types, required keys, unique ports, models and profiles defined, pins."""
    from rigctl.fleet.deploy import roles_paths
    from rigctl.inventory.check import check

    inv = load_inventory()
    problems = check(inv, roles_paths())
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


def init(directory: Annotated[Path, typer.Argument(help="The new inventory's directory (new, or empty).")]) -> None:
    """Write a starter inventory to DIRECTORY (commented: the fleet's group, connection, llama.cpp pin, model
    catalog and server profile) that passes `inventory check`; then add the first host to it."""
    from rigctl.inventory import Inventory
    from rigctl.inventory.check import check
    from rigctl.inventory.starter import write_starter

    written = write_starter(directory)
    for path in written:
        console.print(f"wrote {directory / path}", markup=False, highlight=False)
    problems = [p for p in check(Inventory.load(directory)) if p.severity == "error"]
    if problems:  # the shipped starter is checked in the tests; this names a broken install
        raise RigctlError(f"{directory}: the starter inventory fails its check: {problems[0]}")
    target = shlex.quote(str(directory))
    console.print(f"next: rigctl -i {target} hosts add gpu1 ADDRESS --key ~/.ssh/id_ed25519", markup=False,
                  highlight=False)
