"""The command line of a shipped host-side module: ``<command> [args...]`` runs that command and prints its
answer as one JSON document on stdout, which the controller parses; an unknown command exits 2 naming it.
Standard library only (it runs on hosts)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from typing import Any


def answer(module: str, argv: list[str], commands: Mapping[str, Callable[[list[str]], Any]]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    run = commands.get(command)
    if run is None:
        print(f"{module}: unknown command {command!r}", file=sys.stderr)
        return 2
    print(json.dumps(run(args)))
    return 0
