"""``rigctl models list|verify|pin|pin-revisions``: model artifacts on the hosts, model sources in the catalog."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from rigctl.cli.common import LimitOption, console, err_console, load_inventory, load_inventory_to_write
from rigctl.cli.render import outside_text
from rigctl.errors import RigctlError

app = typer.Typer(no_args_is_help=True, help="Model artifacts on the hosts: list, verify and pin hashes.")


@app.command("list")
def models_list(limit: LimitOption = None) -> None:
    """Per host: artifact, size, quantisation mix, sha256 and pin status (from the manifests)."""
    from rigctl.fleet.models import list_artifacts, rows

    table = Table(title="model artifacts")
    for column in ("host", "artifact", "size", "quant mix", "sha256", "pin"):
        table.add_column(column)
    results = list_artifacts(load_inventory(), limit)
    for row in rows(results):
        table.add_row(*(outside_text(cell) for cell in row))  # a model file's metadata, a host's error
    console.print(table)
    failed = {host: outcome for host, outcome in results.items() if isinstance(outcome, RigctlError)}
    for host, outcome in failed.items():
        text = str(outcome)
        err_console.print(outside_text(f"error: {text if text.startswith(host) else f'{host}: {text}'}"),
                          soft_wrap=True)
    if failed:  # a listing that could not see a host is not a clean listing
        raise typer.Exit(1)


@app.command("verify")
def models_verify(limit: LimitOption = None) -> None:
    """Re-hash every host's model files against their pins; rebuild nothing."""
    from rigctl.fleet.models import problems, verify

    results = verify(load_inventory(), limit)
    found = problems(results)
    for line in found:
        err_console.print(outside_text(line), soft_wrap=True)
    checked = sum(len(r) for r in results.values() if isinstance(r, list))
    summary = f"{checked} artifacts on {len(results)} hosts, {len(found)} problems"
    (err_console if found else console).print(summary, highlight=False)
    if found:
        raise typer.Exit(1)


@app.command("pin")
def models_pin(limit: LimitOption = None) -> None:
    """Write the hashes observed on each host into its host_vars (models_pins), for review with git diff."""
    from rigctl.fleet.models import pin

    for host, pins in pin(load_inventory_to_write("models pin"), limit).items():
        console.print(f"{host}: pinned {len(pins)} artifacts", highlight=False)


@app.command("pin-revisions")
def models_pin_revisions(
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for each answer of the endpoint.",
                                           min=0.1)] = 30.0,
) -> None:
    """Pin each Hugging Face source whose revision is a branch or tag (``main``) to the commit it names now,
    asked of HF_ENDPOINT's API; written round trip into the catalog's file, the branch kept as a comment."""
    from rigctl.fleet.revisions import pin_revisions

    pinned = pin_revisions(load_inventory_to_write("models pin-revisions"), timeout=timeout)
    for item in pinned:
        console.print(f"{item.model}: {item.repo}@{item.revision} -> {item.commit} ({item.file})", markup=False,
                      highlight=False)
    console.print(f"pinned {len(pinned)} sources" if pinned else "every hf source is pinned to a commit already",
                  highlight=False)
