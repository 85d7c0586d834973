#!/usr/bin/env python3
"""How much faster is one eval fanned out over two servers than the same eval on one of them?

Runs the eval runner itself (rigctl.evals.runner) on the same GSM8K-style questions twice, side by side
in one invocation: once against one server, once fanned out over that server and a second one serving
the same artifact with the same build (checked as `rigctl eval run` checks it: sha256 of the model file
and llama.cpp build from each host, `/props` build of each server). Prints both wall times, the wall
ratio (one server over two: 2.0 is perfect sharing), and how many questions each server answered. The
two kinds of run alternate (``--repeats`` pairs) so that a load change on the machine hits both alike.

Default: the lab's `smollm2` instance on the desktop and laptop rigs (RIGCTL_LAB_SLOT picks the lab;
each serves with --parallel 1). The two lab rigs share this machine's CPU cores, so their ratio says
how well the client deals questions more than what two real GPUs would gain; on real hosts it is the
speed-up of a fan-out.

    RIGCTL_LAB_SLOT=5 .venv/bin/python perf/eval_fanout.py [--requests 24] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from gsm8k_load import gsm8k_task

from rigctl.evals import runner
from rigctl.evals.fanout import FanOut
from rigctl.evals.target import inventory_targets
from rigctl.inventory import Inventory
from rigctl.results.store import ResultsStore, read_jsonl

REPO = Path(__file__).resolve().parent.parent


def timed_run(task, fanout: FanOut, store: ResultsStore, options: runner.Options) -> tuple[float, Counter]:
    """Wall seconds of one eval run over the fan-out's servers, and the answers per server."""
    run = runner.start(task, fanout.targets, store, options=options)
    started = time.perf_counter()
    runner.run(task, fanout.endpoints, run, options)
    wall = time.perf_counter() - started
    return wall, answers_by_server(task, run.path)


def answers_by_server(task, run_path: Path) -> Counter:
    """How many of the run's answers each server gave; SystemExit unless every question was answered once."""
    rows = read_jsonl(run_path / "answers.jsonl")
    if sorted((r["set"], r["id"]) for r in rows) != sorted((q.set, q.id) for q in task.questions):
        raise SystemExit(f"{run_path}: the questions were not each answered once")
    return Counter(r["server"] for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", default="desktop/smollm2", help="HOST/SERVER of the one-server run")
    parser.add_argument("--second", default="laptop/smollm2", help="HOST/SERVER added for the fan-out")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight per server")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2, help="one-server / fan-out pairs, alternating")
    args = parser.parse_args()

    inventory = Inventory.load(os.environ.get("RIGCTL_INVENTORY") or REPO / "inventory" / "lab")
    targets = inventory_targets([(inventory.host(ref.split("/")[0]), ref.split("/")[1])
                                 for ref in (args.first, args.second)])
    both = FanOut.of(targets)  # refuses mixed artifacts or builds
    one = FanOut.of(targets[:1])

    with tempfile.TemporaryDirectory(prefix="eval-fanout-") as tmp:
        task = gsm8k_task(Path(tmp), "fanout", args.requests, args.max_tokens)
        options = runner.Options(concurrency=args.concurrency)
        store = ResultsStore(Path(tmp) / "results")
        timed_run(task, both, store, options)  # warm both servers (model pages, first-request costs)
        one_walls, two_walls, shares = [], [], Counter()
        for _ in range(args.repeats):
            one_walls.append(timed_run(task, one, store, options)[0])
            wall, answered = timed_run(task, both, store, options)
            two_walls.append(wall)
            shares.update(answered)
    one_wall, two_wall = sum(one_walls), sum(two_walls)

    print(f"questions   {args.requests} (gsm8k-style, max_tokens {args.max_tokens}), {args.concurrency} in flight "
          "per server")
    stamp = both.first.provenance()
    print(f"artifact    {both.first.artifact} sha256 {stamp.artifacts[0].sha256[:12]}, build {stamp.llama_cpp.commit}")
    print(f"{'one server':12}" + "".join(f"{w:8.2f} s" for w in one_walls) + f"   {args.first}")
    print(f"{'fan-out':12}" + "".join(f"{w:8.2f} s" for w in two_walls) + "   answers: "
          + ", ".join(f"{k} {v}" for k, v in sorted(shares.items())))
    print(f"wall ratio  {one_wall / two_wall:.2f} over {args.repeats} alternating pairs "
          "(one server / two; 2.00 would be perfect sharing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
