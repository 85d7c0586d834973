"""What every command module shares: the consoles, the global options' state, the inventory and the
options several command groups take. Imports nothing heavy: every command module imports this."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from rigctl.errors import ConfigError

if TYPE_CHECKING:
    from rigctl.inventory import Inventory
    from rigctl.inventory.preload import InventoryPreload
    from rigctl.results.store import ResultsStore

# Piped output (CI logs, `| less`) gets wide tables instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


class State:
    """The global options (``-i``, ``--debug``), set by the app's callback before any command runs."""

    inventory_source: str | None = None
    debug: bool = False
    preload: InventoryPreload | None = None  # an inventory loading in a child (preload_inventory)


state = State()


def preload_inventory() -> None:
    """Start loading the inventory in a child process (:mod:`rigctl.inventory.preload`), for a command
    that will :func:`load_inventory`: its group's callback calls this before the command's own arguments
    are parsed and its imports run. One already started by :func:`rigctl.cli.main.main` (a command line
    without ``-i``: the default inventory, as ``-i`` resolves it) is kept."""
    from rigctl.inventory.preload import InventoryPreload

    if state.preload is None:
        state.preload = InventoryPreload(state.inventory_source)


def close_preload() -> None:
    """Stop and reap a preload the command did not take (it failed first); the app's callback has every
    command end with this."""
    if state.preload is not None:
        preload, state.preload = state.preload, None
        preload.close()


def load_inventory() -> Inventory:
    """The inventory ``-i`` (or ``$RIGCTL_INVENTORY``, or ansible.cfg's) names."""
    from rigctl.inventory import Inventory

    if state.preload is not None:
        preload, state.preload = state.preload, None
        return preload.result()
    return Inventory.load(state.inventory_source)


def load_inventory_to_write(command: str) -> Inventory:
    """The inventory ``command`` writes to: only one named with ``-i`` (or ``$RIGCTL_INVENTORY``), never the
    default that ansible.cfg names, which may be another fleet's (a checkout's is the lab's)."""
    if state.inventory_source is None:
        raise ConfigError(f"{command} writes to the inventory: name it with -i DIR (or RIGCTL_INVENTORY); "
                          "rigctl never writes to an inventory it was not told about")
    return load_inventory()


def results_store(results: Path | None) -> ResultsStore:
    from rigctl.results.store import ResultsStore

    return ResultsStore(results)


LimitOption = Annotated[str | None, typer.Option("--limit", "-l", help="Hosts or groups, comma-separated.")]
CampaignArg = Annotated[Path, typer.Argument(help="Campaign file (YAML).")]
ResultsOption = Annotated[Path | None, typer.Option("--results", envvar="RIGCTL_RESULTS",
                                                    help="Results store (default ./results).")]


def finite(value: float | None) -> float | None:
    """A float option's callback: nan and inf parse as floats, yet no timeout, threshold or margin is either
    (nan compares false with every bound, inf never ends a wait)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def parse_ints(value: str | None, flag: str) -> list[int] | None:
    """``1,2,4`` as [1, 2, 4]; ConfigError naming ``flag`` otherwise."""
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: expected whole numbers separated by commas") from None


def parse_words(value: str | None) -> list[str] | None:
    """``a, b`` as ["a", "b"]."""
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]

