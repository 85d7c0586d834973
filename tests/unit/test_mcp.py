"""rigctl mcp, driven by the MCP SDK's own stdio client: `rigctl mcp` runs as a subprocess exactly as
Claude Code starts it, and every call goes over JSON-RPC on its stdin/stdout."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

REPO = Path(__file__).resolve().parents[2]
RIGCTL = Path(sys.executable).with_name("rigctl")
LAB_INVENTORY = REPO / "inventory" / "lab"

READ_ONLY = {"list_hosts", "fleet_status", "server_health", "server_logs", "job_status", "list_results",
             "compare_runs"}
ACTIONS = {"restart_server", "start_bench", "start_eval", "pull_results"}


def _params(results: Path, *extra: str) -> StdioServerParameters:
    env = {"RIGCTL_RESULTS": str(results), "RIGCTL_LAB_SLOT": os.environ.get("RIGCTL_LAB_SLOT", "0")}
    return StdioServerParameters(command=str(RIGCTL), args=["-i", str(LAB_INVENTORY), "mcp", *extra], env=env,
                                 cwd=str(REPO))


def _session(results: Path, *extra: str, body: Callable[[Client], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with Client(_params(results, *extra), read_timeout_seconds=300) as client:
            return await body(client)

    return asyncio.run(main())


def _text(result) -> str:
    return "\n".join(c.text for c in result.content if getattr(c, "type", "") == "text")


def _data(result) -> dict[str, Any]:
    assert not result.is_error, _text(result)
    return result.structured_content if result.structured_content is not None else json.loads(_text(result))


def test_tools_listed_actions_refused_and_bad_input_are_tool_errors_not_crashes(tmp_path: Path):
    """One read-only server: every tool listed with its hint; actions refused; bad input answered as tool
    errors, after which it still serves."""

    async def body(client: Client):
        tools = (await client.list_tools()).tools
        refused = await client.call_tool("restart_server", {"host": "desktop", "server": "smollm2"})
        refused_eval = await client.call_tool("start_eval", {"host": "desktop", "server": "smollm2", "task": "x"})
        unknown_host = await client.call_tool("server_logs", {"host": "nowhere", "server": "smollm2"})
        unknown_server = await client.call_tool("server_health", {"host": "desktop", "server": "nope"})
        bad_lines = await client.call_tool("server_logs", {"host": "desktop", "server": "smollm2", "lines": 0})
        bad_name = await client.call_tool("server_logs", {"host": "desktop; reboot", "server": "smollm2"})
        missing_run = await client.call_tool("compare_runs", {"run_a": "desktop/eval-20261130T051200Z-0000",
                                                             "run_b": "desktop/eval-20261130T051200Z-0001"})
        still_serving = await client.call_tool("list_hosts", {})
        return tools, refused, refused_eval, unknown_host, unknown_server, bad_lines, bad_name, missing_run, \
            still_serving

    (tools, refused, refused_eval, unknown_host, unknown_server, bad_lines, bad_name, missing_run,
     still_serving) = _session(tmp_path, body=body)
    by_name = {t.name: t for t in tools}
    assert set(by_name) == READ_ONLY | ACTIONS
    for name in READ_ONLY:
        assert by_name[name].annotations.read_only_hint is True, name
    for name in ACTIONS:
        assert by_name[name].annotations.read_only_hint is False, name
        assert "--allow-actions" in by_name[name].description
    assert by_name["server_logs"].input_schema["properties"]["lines"]["maximum"] == 2000
    for result in (refused, refused_eval):
        assert result.is_error and "refused" in _text(result) and "--allow-actions" in _text(result)
    assert unknown_host.is_error and "unknown host 'nowhere'" in _text(unknown_host)
    assert unknown_server.is_error and "no llama_server instance 'nope'" in _text(unknown_server)
    assert bad_lines.is_error and "lines" in _text(bad_lines)
    assert bad_name.is_error and "host" in _text(bad_name)
    assert missing_run.is_error and "not found" in _text(missing_run)
    hosts = _data(still_serving)["hosts"]
    assert sorted(h["name"] for h in hosts) == ["desktop", "laptop"]
    assert hosts[0]["servers"][0]["name"] == "smollm2"
