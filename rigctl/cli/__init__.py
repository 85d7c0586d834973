"""The ``rigctl`` command: argument parsing, rendering and exit codes only; the work is in the library.

One module per command group; each imports :mod:`rigctl.cli.common` (consoles, global options,
inventory) and never this package. :mod:`rigctl.cli.app` puts the groups together. Command modules
import the libraries a command needs inside that command, so that ``rigctl --help`` and each command
pay only for what they use. This module itself imports nothing heavy: :func:`main` may start loading
the inventory before the app (typer, rich and every command module) is imported.
"""

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
