"""``rigctl provision``: the site playbook through ansible-runner."""

from __future__ import annotations

from typing import Annotated

import typer

from rigctl.cli.common import LimitOption, load_inventory
from rigctl.cli.render import print_deploy_summary, print_event, print_task


def provision(
    limit: LimitOption = None,
    tags: Annotated[list[str] | None, typer.Option("--tags", "-t", help="Only tasks with these tags.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Report what would change; change nothing.")] = False,
    playbook: Annotated[str, typer.Option(help="Playbook under playbooks/.")] = "site.yml",
    serial: Annotated[str | None, typer.Option(
        "--serial", help="Roll out in batches: hosts or a percentage of them per batch (1, 25%, or 1,50% for one "
                         "host first); a failure stops the rest. Default: the inventory's rigctl_serial, else "
                         "all at once.")] = None,
) -> None:
    """Run playbooks/site.yml through ansible-runner; per-task progress, then a per-host summary (with each
    host's batch, and the batch that stopped a rolling rollout). A llama.cpp pin inside a published advisory's
    range (the CVE floor), and a server flag of the dangerous-flag policy the inventory does not allow, are
    refused before anything runs."""
    from rigctl.fleet.deploy import rollout_serial, run_playbook
    from rigctl.inventory.advisories import refuse_vulnerable_pins
    from rigctl.inventory.flag_policy import refuse_dangerous_flags

    inventory = load_inventory()
    refuse_vulnerable_pins(inventory.select(limit))
    refuse_dangerous_flags(inventory.select(limit))
    result = run_playbook(inventory, playbook, limit=limit, tags=tags or (), check=check,
                          on_event=print_event, on_task=print_task,
                          serial=rollout_serial(inventory.select(limit), serial))
    print_deploy_summary(result, f"{playbook}{' (check mode)' if check else ''}")
    result.raise_for_failures()
