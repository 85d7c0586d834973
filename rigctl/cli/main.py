"""The ``rigctl`` entry point: starts what may start before the app is imported, then runs the app
(:mod:`rigctl.cli.app`). Imports nothing heavy itself."""

from __future__ import annotations

import sys


def main() -> None:
    from rigctl.cli.preloading import preloads_inventory

    preload = None
    if preloads_inventory(sys.argv[1:]):
        # A head start of a third of a second: importing the app, then parsing the arguments (typer's
        # coercion imports pydantic), run beside Ansible in the child.
        from rigctl.inventory.preload import InventoryPreload

        preload = InventoryPreload(None)
    from rigctl.cli.app import run

    run(preload)
