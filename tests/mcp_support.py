"""Helpers the MCP server's unit and lab tests share: an MCP client session over stdio and its replies."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parents[1]


RIGCTL = Path(sys.executable).with_name("rigctl")


LAB_INVENTORY = REPO / "inventory" / "lab"


def server_params(results: Path, *extra: str) -> StdioServerParameters:
    env = {"RIGCTL_RESULTS": str(results), "RIGCTL_LAB_SLOT": os.environ.get("RIGCTL_LAB_SLOT", "0")}
    return StdioServerParameters(command=str(RIGCTL), args=["-i", str(LAB_INVENTORY), "mcp", *extra], env=env,
                                 cwd=str(REPO))


def mcp_session(results: Path, *extra: str, body: Callable[[Client], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with Client(server_params(results, *extra), read_timeout_seconds=300) as client:
            return await body(client)

    return asyncio.run(main())


def tool_text(result) -> str:
    return "\n".join(c.text for c in result.content if getattr(c, "type", "") == "text")


def tool_data(result) -> dict[str, Any]:
    assert not result.is_error, tool_text(result)
    return result.structured_content if result.structured_content is not None else json.loads(tool_text(result))

