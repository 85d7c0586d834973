"""``rigctl mcp``: the fleet as MCP tools over stdio (a long-running service)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rigctl.cli.common import ResultsOption, load_inventory


def mcp(
    allow_actions: Annotated[bool, typer.Option("--allow-actions",
                                                help="Allow the tools that change things: restart a server, "
                                                     "start a bench or an eval, pull results.")] = False,
    results: ResultsOption = None,
    task_dirs: Annotated[list[Path] | None, typer.Option(
        "--task-dir", help="A directory start_eval may take task files from (besides the shipped tasks).")] = None,
) -> None:
    """Serve the fleet as MCP tools over stdio (for Claude Code or any MCP client); read-only unless
    --allow-actions."""
    from rigctl.services.mcp_server import build_server

    build_server(load_inventory(), allow_actions=allow_actions, results_root=results,
                 task_dirs=task_dirs or ()).run("stdio")
