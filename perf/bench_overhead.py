#!/usr/bin/env python3
"""Wall time of `rigctl bench run --wait` for a small matrix against the same llama-bench commands run
directly over SSH, measured side by side (alternating, the order swapped every repeat), as a ratio.

Aim: at most 1.02x, cool-down waits excluded (the time each cell waited for the GPU, recorded in
cells.jsonl, is taken off rigctl's wall time). rigctl's time covers all it adds: CLI start-up,
inventory load, shipping the job, model hashing and facts, following progress and the
sha256-checked pull. The direct run is one `ssh` session running the commands rigctl recorded.
llama-server instances are left running in both (`--keep-servers`), so both see the same machine.
Needs the lab provisioned (`rigctl lab up && rigctl provision`).

The default matrix is llama-bench's own default test sizes (`--matrix` takes others): rigctl's fixed
cost (CLI start-up, inventory, SSH, pull: about 1.2 s here) is what the ratio shows, and it only reads
against a matrix of the size people run. On a shared machine llama-bench's own time drifts by a few
per cent between runs, more than the aim; so each repeat also times llama-bench itself in both (the
job's cells.jsonl; `date` around each direct command) and prints what each adds around it, as a
ratio on the same llama-bench time.

    RIGCTL_LAB_SLOT=N .venv/bin/python perf/bench_overhead.py [--repeats 3] [--host desktop] [--matrix "-p 64 -n 16"]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from rigctl.inventory import Inventory
from rigctl.results.store import ResultsStore

REPO = Path(__file__).resolve().parent.parent
RIGCTL = str(Path(sys.executable).parent / "rigctl")
MODELS = "smollm2-135m-q4_1,smollm2-135m-q4_0"
# llama-bench's own default test sizes (pp512, tg128, 5 repetitions), on one thread as the lab rigs have
# few cores: the smallest matrix people publish.
MATRIX = "-p 512 -n 128 -r 5 -t 1"


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def rigctl_run(host: str, inventory: str, results: Path, matrix: list[str]
               ) -> tuple[float, float, list[str], float, float, dict[str, float]]:
    """Wall time, cool-down wait, the recorded commands, the job's own time on the host (its run
    record's start to end), llama-bench's own time in it (cells.jsonl's llama_bench_s) of one
    `rigctl bench run --wait`, and where the wall time went: until the CLI said the job started, until
    it saw the job done, and after (the pull and exit)."""
    env = {**os.environ, "RIGCTL_INVENTORY": inventory, "RIGCTL_RESULTS": str(results)}
    started = time.monotonic()
    seen: list[tuple[float, str]] = []
    with subprocess.Popen([RIGCTL, "bench", "run", "-H", host, "-m", MODELS, *matrix, "--cooldown-poll", "0.5",
                           "--keep-servers", "--wait"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            seen.append((time.monotonic() - started, line.rstrip("\n")))
        stderr = proc.stderr.read()
        rc = proc.wait(timeout=1800)
    wall = time.monotonic() - started
    stdout = "\n".join(line for _, line in seen)
    if rc != 0:
        raise SystemExit(f"rigctl bench run failed: {stderr.strip() or stdout.strip()}")
    job_id = next(line.split()[2] for _, line in seen if " started " in line)
    at_start = next(t for t, line in seen if " started " in line)
    at_done = next((t for t, line in seen if f"{job_id} done" in line), wall)
    phases = {"to start": at_start, "following": at_done - at_start, "pull and exit": wall - at_done}
    run = ResultsStore(results).find(f"{host}/{job_id}")
    cells = [json.loads(line) for line in (run.path / "cells.jsonl").read_text().splitlines()]
    waited = sum(c["cooldown"]["waited_s"] for c in cells)
    on_host = _seconds(run.record.ended or run.record.started) - _seconds(run.record.started) - waited
    return wall, waited, run.record.commands, on_host, sum(c["llama_bench_s"] for c in cells), phases


def ssh_run(inventory: Inventory, host_name: str, commands: list[str]) -> tuple[float, float]:
    """Wall time of the same commands in one plain `ssh` session (strict host keys, the inventory's key),
    and their own time, each timed on the host (a `date` before and after: the session's cost aside)."""
    host = inventory.host(host_name)
    argv = ["ssh", "-o", f"UserKnownHostsFile={host.known_hosts}", "-o", "StrictHostKeyChecking=yes", "-o",
            "BatchMode=yes", "-p", str(host.port)]
    if host.key_file:
        argv += ["-i", str(host.key_file), "-o", "IdentitiesOnly=yes"]
    mark = "echo bench-overhead-mark $(date +%s.%N) >&2"
    timed = [f"{mark} && {command} && {mark}" for command in commands]
    argv += [f"{host.user}@{host.address}", " && ".join(timed)]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"direct ssh failed: {done.stderr.strip()[-500:]}")
    stamps = [float(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("bench-overhead-mark ")]
    return wall, sum(end - begin for begin, end in zip(stamps[::2], stamps[1::2], strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--host", default="desktop")
    parser.add_argument("--matrix", default=MATRIX, help=f"rigctl bench run's matrix flags (default: {MATRIX})")
    parser.add_argument("-i", "--inventory", default=str(REPO / "inventory" / "lab"))
    args = parser.parse_args()
    inventory = Inventory.load(args.inventory)
    matrix = shlex.split(args.matrix)
    ratios, host_ratios, fixed_ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="rigctl-bench-overhead-") as tmp:
        results = Path(tmp)
        # The first rigctl run tells which commands to time directly (and warms the page cache).
        _, _, commands, _, _, _ = rigctl_run(args.host, args.inventory, results, matrix)
        print(f"matrix: {args.matrix} on {MODELS}, {len(commands)} cells; commands:")
        for command in commands:
            print(f"  {command}")
        for repeat in range(args.repeats):
            order = ["rigctl", "ssh"] if repeat % 2 == 0 else ["ssh", "rigctl"]
            times: dict[str, float] = {}
            for which in order:
                if which == "rigctl":
                    wall, waited, _, on_host, tool, phases = rigctl_run(args.host, args.inventory, results, matrix)
                    times["rigctl"], times["job"], times["rigctl tool"] = wall - waited, on_host, tool
                else:
                    times["ssh"], times["ssh tool"] = ssh_run(inventory, args.host, commands)
            ratios.append(times["rigctl"] / times["ssh"])
            host_ratios.append(times["job"] / times["ssh"])
            # What each adds around llama-bench's own time, and the ratio those costs make on the mean
            # llama-bench time of the two runs: the machine's drift between the runs left out.
            added = times["rigctl"] - times["rigctl tool"]
            direct = times["ssh"] - times["ssh tool"]
            tool = (times["rigctl tool"] + times["ssh tool"]) / 2
            fixed_ratios.append((tool + added) / (tool + direct))
            print(f"repeat {repeat + 1}: rigctl {times['rigctl']:.2f} s (cool-down excluded; the job itself "
                  f"{times['job']:.2f} s on the host; " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
                  + f"), direct ssh {times['ssh']:.2f} s, ratio {ratios[-1]:.3f}x; llama-bench itself "
                  f"{times['rigctl tool']:.2f} s in rigctl's run, {times['ssh tool']:.2f} s in the direct one; "
                  f"around it rigctl adds {added:.2f} s, ssh {direct:.2f} s: {fixed_ratios[-1]:.4f}x")
    print(f"rigctl bench run --wait / direct ssh: median {statistics.median(ratios):.3f}x over {len(ratios)} "
          f"repeats (aim <= 1.02x)")
    print(f"the job on the host (facts, model hashes, cool-down checks, records) / direct ssh: median "
          f"{statistics.median(host_ratios):.3f}x; the rest is the controller (CLI start-up, inventory, SSH, pull)")
    print(f"what each adds around llama-bench's own time, as a ratio on the same llama-bench time: median "
          f"{statistics.median(fixed_ratios):.4f}x (llama-bench's run-to-run spread left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
