"""Which command lines load the inventory, known before the app is imported (:func:`rigctl.cli.main.main`)."""

from __future__ import annotations

#: Command groups and those of their commands that load the inventory: it starts loading in a child
#: (:mod:`rigctl.inventory.preload`) before their arguments are parsed, while this process parses and
#: imports the rest.
INVENTORY_COMMANDS = {"bench": frozenset({"run", "spec", "server", "load"})}
#: Global options that take no value: what may come before the group on a line :func:`preloads_inventory`
#: accepts.
_FLAGS = frozenset({"-v", "-vv", "--verbose", "--debug"})


def preloads_inventory(argv: list[str]) -> bool:
    """Whether ``argv`` plainly runs a command that loads the default inventory ($RIGCTL_INVENTORY, else
    ansible.cfg's): only flags, then such a group and command. Anything else (``-i``, an option not known
    here) says no, and the group's callback starts the preload once the arguments are parsed."""
    words = list(argv)
    while words and words[0] in _FLAGS:
        words.pop(0)
    return len(words) >= 2 and words[1] in INVENTORY_COMMANDS.get(words[0], ())
