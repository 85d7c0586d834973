"""rigctl mcp against the lab rigs, driven by the MCP SDK's own stdio client: `rigctl mcp` runs as a subprocess
exactly as Claude Code starts it, and every call goes over JSON-RPC on its stdin/stdout.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from mcp import Client
from mcp_support import mcp_session, tool_data

from rigctl.inventory import Inventory

# ------------------------------------------------------------------------------------------------ lab


@pytest.mark.lab
def test_fleet_status_both_rigs_up_and_servers_healthy(lab_served: Inventory, tmp_path: Path):
    async def body(client: Client):
        status = tool_data(await client.call_tool("fleet_status", {}))
        health = tool_data(await client.call_tool("server_health", {"host": "laptop", "server": "smollm2"}))
        logs = tool_data(await client.call_tool("server_logs", {"host": "desktop", "server": "smollm2", "lines": 5}))
        return status, health, logs

    status, health, logs = mcp_session(tmp_path, body=body)
    for name in ("desktop", "laptop"):
        host = status["hosts"][name]
        assert host["up"] is True
        assert host["llama_cpp"]["drift"] is False and host["llama_cpp"]["pinned"] == "b11434"
        assert host["gpus"] and host["gpus"][0]["memory_total_mib"] > 0
        assert [m["drift"] for m in host["models"]] == [False] * len(host["models"])
        server = host["servers"]["smollm2"]
        assert server["state"] == {"untrusted": "active"} and server["healthy"] is True and server["main_pid"] > 0
    # What the server and the host said comes back marked as data.
    assert health["healthy"] and health["props"]["model_path"]["untrusted"].endswith(".gguf")
    assert health["props"]["build_info"]["untrusted"]
    assert logs["unit"] == "llama-server@smollm2.service" and logs["journal"]["untrusted"].strip()


@pytest.mark.lab
def test_restart_with_allow_actions_gives_a_new_main_pid(lab_served: Inventory, tmp_path: Path):
    from rigctl.ssh import SshClient, SshTarget

    async def body(client: Client):
        return tool_data(await client.call_tool("restart_server", {"host": "laptop", "server": "smollm2"}))

    restarted = mcp_session(tmp_path, "--allow-actions", body=body)
    assert restarted["main_pid_before"] > 0 and restarted["main_pid_after"] > 0
    assert restarted["main_pid_after"] != restarted["main_pid_before"]
    assert restarted["healthy"] is True
    with SshClient(SshTarget.from_host(lab_served.host("laptop"))) as ssh:
        pid = ssh.run("systemctl show --property=MainPID --value llama-server@smollm2.service", timeout=30).stdout
    assert int(pid) == restarted["main_pid_after"]


@pytest.mark.lab
def test_start_a_short_eval_and_read_its_result_through_the_tools(lab_served: Inventory, tmp_path: Path):
    questions = [("What is 2 + 3?", "5"), ("What is 10 - 4?", "6")]
    dataset = tmp_path / "arith.jsonl"
    dataset.write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n" for q, a in questions))
    task = tmp_path / "arith.yaml"
    task.write_text("name: arith\nscorer: gsm8k\ndataset:\n  path: arith.jsonl\nmax_tokens: 32\n")
    results = tmp_path / "results"

    async def body(client: Client):
        started = tool_data(await client.call_tool(
            "start_eval", {"host": "desktop", "server": "smollm2", "task": task.name, "concurrency": 2}))
        job_id = started["job"]["id"]["untrusted"]  # the host named it: data the client passes back
        deadline = time.monotonic() + 180
        while True:
            jobs = tool_data(await client.call_tool("job_status", {"host": "desktop", "job": job_id}))["jobs"]
            if jobs[0]["state"]["untrusted"] in ("done", "failed", "stopped", "lost") or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        pulled = tool_data(await client.call_tool("pull_results", {"host": "desktop"}))
        listed = tool_data(await client.call_tool("list_results", {"host": "desktop", "kind": "eval"}))
        return started, jobs[0], pulled, listed

    started, job, pulled, listed = mcp_session(results, "--allow-actions", "--task-dir", str(tmp_path), body=body)
    assert started["questions"] == len(questions)
    assert job["state"] == {"untrusted": "done"}, job
    assert job["done"] == job["total"] == len(questions)
    job_id = started["job"]["id"]["untrusted"]
    assert {"untrusted": job_id} in pulled["hosts"]["desktop"]["copied"]
    runs = [r for r in listed["runs"] if r["id"] == job_id]  # the store's layout vouches for a run's id
    assert len(runs) == 1
    run = runs[0]
    assert run["status"] == {"untrusted": "done"} and run["task"] == {"untrusted": "arith"}
    assert run["artifacts"] == [{"untrusted": "smollm2-135m-q4_1"}]
    assert run["questions"] == len(questions) and 0.0 <= run["score"] <= 1.0
    # The score the tool reports is the mean of the answers file the run wrote.
    answers_file = results / "desktop" / run["id"] / "answers.jsonl"
    answers = [json.loads(line) for line in answers_file.read_text().splitlines()]
    assert run["score"] == pytest.approx(sum(float(a["score"]) for a in answers) / len(answers))
