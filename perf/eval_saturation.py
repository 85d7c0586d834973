#!/usr/bin/env python3
"""Does the eval client keep a `--parallel 1` llama-server busy, and what does it cost per request?

Runs the eval runner itself (rigctl.evals.runner: async httpx, 8 requests in flight, one flushed JSON line
per answer) on GSM8K-style questions against one server and prints, side by side:

    busy/wall     the server's prompt + generation seconds (its /metrics counters, read before and after)
                  over the run's wall time: 1.0 means the server never waited for the client
    client CPU    this process's CPU time (all threads) per request, after one warm-up request (imports
                  and the client's TLS context are a one-off cost, printed apart)

and, as a yardstick measured the same way on the same questions, a bare httpx client that only sends
the requests and decodes the answers (no scoring, no answers file).

Aim: busy/wall >= 0.99 and client CPU <= 3 ms per request. Default target: the lab's `smollm2` instance
on the desktop rig (RIGCTL_LAB_SLOT picks the lab; the rigs serve with --parallel 1); `--url` takes any
llama-server started with --metrics.

    RIGCTL_LAB_SLOT=2 .venv/bin/python perf/eval_saturation.py [--requests 60] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from gsm8k_load import gsm8k_task

from rigctl.evals import runner
from rigctl.evals.target import inventory_target, url_target
from rigctl.hostside import scorers
from rigctl.inventory import Inventory
from rigctl.llama_http import AsyncServerClient, Endpoint, ServerClient
from rigctl.results.store import ResultsStore, read_jsonl

REPO = Path(__file__).resolve().parent.parent
AIM_BUSY, AIM_CPU_MS = 0.99, 3.0


async def warm_up(endpoint: Endpoint) -> None:
    async with AsyncServerClient(endpoint) as client:
        await client.health()


async def bare_httpx(endpoint: Endpoint, bodies: list[dict], concurrency: int) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=endpoint.url, headers=endpoint.headers(), timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(body: dict) -> None:
            async with gate:
                response = await client.post("/v1/chat/completions", json=body)
                response.raise_for_status()
                json.loads(response.content)

        await asyncio.gather(*(one(b) for b in bodies))


def measure(endpoint: Endpoint, work) -> tuple[float, float, float]:
    """(wall s, client CPU s, server busy s) of ``work()``."""
    with ServerClient(endpoint) as client:
        before = client.metrics().busy_seconds
        cpu0, wall0 = time.process_time(), time.perf_counter()
        work()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        return wall, cpu, client.metrics().busy_seconds - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="llama-server base URL (default: the lab inventory's server)")
    parser.add_argument("--host", default="desktop")
    parser.add_argument("--server", default="smollm2")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    if args.url:
        target = url_target(args.url, host="bench")
    else:
        inventory = Inventory.load(os.environ.get("RIGCTL_INVENTORY") or REPO / "inventory" / "lab")
        target = inventory_target(inventory.host(args.host), args.server, facts=False)
    with ServerClient(target.endpoint) as client:
        props = client.props()
        if props.total_slots != 1:
            print(f"warning: {target.endpoint} has {props.total_slots} slots; the aim is for --parallel 1")

    with tempfile.TemporaryDirectory(prefix="eval-saturation-") as tmp:
        task = gsm8k_task(Path(tmp), "saturation", args.requests, args.max_tokens)
        options = runner.Options(concurrency=args.concurrency)
        run = runner.start_run(task, target.endpoint, ResultsStore(Path(tmp) / "results"), target.host,
                               options=options)
        warm0 = time.process_time()
        asyncio.run(warm_up(target.endpoint))
        warm_ms = 1000 * (time.process_time() - warm0)
        wall, cpu, busy = measure(target.endpoint,
                                  lambda: runner.run(task, target.endpoint, run, options))
        answers = len(read_jsonl(run.path / "answers.jsonl"))
        bodies = [scorers.chat_request("gsm8k", {**q.data, "prompt": f"[bare] {q.data['prompt']}"}, task.request)
                  for q in task.questions]
        bare_wall, bare_cpu, bare_busy = measure(
            target.endpoint, lambda: asyncio.run(bare_httpx(target.endpoint, bodies, args.concurrency)))

    ratio, cpu_ms = busy / wall, 1000 * cpu / answers
    print(f"server      {target.endpoint} ({props.build_info}, {props.total_slots} slot(s))")
    print(f"requests    {answers} at concurrency {args.concurrency}, max_tokens {args.max_tokens}")
    print(f"{'':12}{'rigctl eval':>14}{'bare httpx':>14}")
    print(f"{'wall s':12}{wall:14.2f}{bare_wall:14.2f}")
    print(f"{'busy s':12}{busy:14.2f}{bare_busy:14.2f}")
    print(f"{'busy/wall':12}{ratio:14.4f}{bare_busy / bare_wall:14.4f}   aim >= {AIM_BUSY}: "
          f"{'ok' if ratio >= AIM_BUSY else 'MISSED'}")
    print(f"{'CPU ms/req':12}{cpu_ms:14.2f}{1000 * bare_cpu / len(bodies):14.2f}   aim <= {AIM_CPU_MS}: "
          f"{'ok' if cpu_ms <= AIM_CPU_MS else 'MISSED'}")
    print(f"one-off warm-up (imports, TLS context): {warm_ms:.0f} ms CPU")
    return 0 if answers == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
