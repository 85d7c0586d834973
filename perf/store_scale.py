#!/usr/bin/env python3
"""What reading the results store costs as it grows: `rigctl report` and `rigctl compare`, the exporter's results
view, MCP's list_results and a pull's run listing, each timed with its peak memory at 100, 1,000 and 10,000
runs, side by side in one run, with the growth from size to size as a ratio.

The stores are made by the project's own record code from real runs: ``--seed`` is a results store a real
campaign wrote (``make demo``'s ``results/``, default; every run of ``campaigns/lab.yml``). Each store holds
the seed's runs as they are, then copies of them under new run ids, started earlier, on the seed's hosts and on
six more (``rig3`` to ``rig8``): ``RunRecord.seal`` writes each copy's record with its raw files (hard links to
the seed's) hashed. So the newest runs are the seed's: the report and compare find the same runs at every size
and only the store around them grows. One copy in seven is on the seed's host (the campaign's): ``report`` reads
only the campaign's hosts' records, so "every record" (all records read, as the exporter's collection does)
is the cost a store whose every run is on the campaign's hosts would have.

Each operation runs in a process of its own (the CLI as a user runs it, or a short Python program over the
library), so its wall time includes Python's start and imports and its peak memory is that process's maximum
resident set (``wait4``'s ``ru_maxrss``); its CPU seconds (user + system) are printed beside the wall time, as
a busy machine stretches the wall time and not them. rigctl's modules are byte-compiled first and the processes
may write bytecode (an environment's ``PYTHONDONTWRITEBYTECODE`` is dropped for them): an installed rigctl runs
from its bytecode, and compiling its sources again in every process is a cost no user pays. Aims (#29): report
and compare at 10,000 runs within 10 s and 500 MB, growing no worse than linearly (time from 1,000 to 10,000 runs
at most 10x).

    .venv/bin/python perf/store_scale.py [--seed results] [--sizes 100,1000,10000] [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import compileall
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rigctl.analysis.campaign import load_campaign, locate  # noqa: E402
from rigctl.results.record import RUN_FILE  # noqa: E402
from rigctl.results.store import ResultsStore, StoredRun  # noqa: E402

CAMPAIGN = REPO / "campaigns" / "lab.yml"
AIM_SECONDS = 10.0
AIM_MB = 500.0
MORE_HOSTS = [f"rig{n}" for n in range(3, 9)]

# The library calls a service makes, each as a short program: ROOT is the store.
PROGRAMS = {
    "exporter results view": (
        "from rigctl.analysis.latest import ResultsReader\n"
        "from rigctl.results.store import ResultsStore\n"
        "benches, evals = ResultsReader(ResultsStore(ROOT)).latest()\n"
        "assert benches and evals\n"),
    "MCP list_results": (
        "from rigctl.inventory import Inventory\n"
        "from rigctl.services.mcp_server import FleetTools\n"
        "tools = FleetTools(Inventory.load(INVENTORY), results_root=ROOT)\n"
        "listed = tools.list_results(limit=50)\n"
        "assert len(listed['runs']) == 50\n"),
    "every record (store.runs)": (
        "from rigctl.results.store import ResultsStore\n"
        "assert sum(1 for _ in ResultsStore(ROOT).runs()) >= 100\n"),
    "pull listing (host side + parse)": (
        "import json\n"
        "from rigctl.hostside.jobhost import list_runs\n"
        "from rigctl.results.record import parse_json\n"
        "text = json.dumps(list_runs(str(ROOT / 'desktop'), 'rigctl-run-'))\n"
        "assert parse_json(text, 'listing', deferred=True)\n"),
}


def seed_runs(seed: Path) -> list[StoredRun]:
    runs = list(ResultsStore(seed).runs())
    if not runs:
        raise SystemExit(f"{seed}: no runs; run `make demo` (or `rigctl campaign run campaigns/lab.yml`) first, "
                         "or give --seed")
    found = locate(load_campaign(CAMPAIGN), ResultsStore(seed))
    missing = [name for name, run in [*found.evals.items(), *found.loads.items(), *found.benches.items()]
               if run is None]
    if missing:
        raise SystemExit(f"{seed}: campaigns/lab.yml is not complete there (missing {missing})")
    return runs


def build_store(seed: list[StoredRun], root: Path, size: int) -> None:
    """``size`` runs under ``root``: the seed's as they are, then copies sealed by RunRecord under new ids."""
    for run in seed:
        shutil.copytree(run.path, root / run.host / run.path.name, copy_function=os.link)
    oldest = min(datetime.strptime(r.record.started, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC) for r in seed)
    hosts = sorted({r.host for r in seed}) + MORE_HOSTS
    for n in range(size - len(seed)):
        source = seed[n % len(seed)]
        started = oldest - timedelta(minutes=n + 1)
        run_id = f"{source.record.kind}-{started.strftime('%Y%m%dT%H%M%SZ')}-{n % 0x10000:04x}"
        host = hosts[n % len(hosts)]
        run_dir = root / host / run_id
        run_dir.mkdir(parents=True)
        for item in source.path.rglob("*"):
            if item.is_file() and item.name != RUN_FILE:
                target = run_dir / item.relative_to(source.path)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(item, target)
        record = dataclasses.replace(source.record, id=run_id, host=host,
                                     started=started.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), files=[],
                                     extra=dict(source.record.extra))
        record.seal(run_dir, status=source.record.status, error=None)


def measure(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak resident MB of one process; exits on failure with its output."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = process.stdout.read() if process.stdout else b""
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out.decode(errors='replace')[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def operations(root: Path, pair: tuple[str, str], out: Path) -> dict[str, list[str]]:
    rigctl = [sys.executable, "-m", "rigctl.cli"]
    prelude = f"from pathlib import Path\nROOT = Path({str(root)!r})\nINVENTORY = {str(REPO / 'inventory' / 'lab')!r}\n"
    return {
        "rigctl report": [*rigctl, "report", str(CAMPAIGN), "--results", str(root), "--out", str(out)],
        "rigctl compare": [*rigctl, "compare", *pair, "--results", str(root)],
        **{name: [sys.executable, "-c", prelude + program] for name, program in PROGRAMS.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=Path, default=REPO / "results")
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--work", type=Path, help="where the stores are made (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="leave the stores")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    seed = seed_runs(args.seed)
    if min(sizes) < len(seed):
        raise SystemExit(f"--sizes: each at least the seed's {len(seed)} runs")
    found = locate(load_campaign(CAMPAIGN), ResultsStore(args.seed))
    (_, a), (_, b) = list(found.evals.items())[:2]
    pair = (f"{a.host}/{a.id}", f"{b.host}/{b.id}")
    work = args.work or Path(tempfile.mkdtemp(prefix="rigctl-store-scale-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RIGCTL_LAB_SLOT": os.environ.get("RIGCTL_LAB_SLOT", "0")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    compileall.compile_dir(REPO / "rigctl", quiet=1)
    print(f"machine: {os.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"seed: {len(seed)} runs from {args.seed}; compare {pair[0]} {pair[1]}")
    figures: dict[str, dict[int, tuple[float, float, float]]] = {}
    try:
        for size in sizes:
            root = work / f"store-{size}"
            began = time.perf_counter()
            build_store(seed, root, size)
            print(f"{size} runs made in {time.perf_counter() - began:.1f} s", flush=True)
            for name, argv in operations(root, pair, work / f"report-{size}").items():
                figures.setdefault(name, {})[size] = measure(argv, env)
                seconds, cpu, mb = figures[name][size]
                print(f"  {name:34s} {seconds:7.2f} s {cpu:7.2f} CPU s {mb:7.0f} MB", flush=True)
            if not args.keep:
                shutil.rmtree(root)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nmachine at the end: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    header = " | ".join(f"{s:>6} runs s (CPU s) / MB" for s in sizes)
    steps = [f"{b}/{a}" for a, b in zip(sizes, sizes[1:], strict=False)]
    print(f"| operation | {header} | " + " | ".join(f"time {s}" for s in steps) + " |")
    print("|---|" + "---:|" * (len(sizes) + len(steps)))
    for name, by_size in figures.items():
        cells = [f"{by_size[s][0]:.2f} ({by_size[s][1]:.2f}) / {by_size[s][2]:.0f}" for s in sizes]
        ratios = [f"{by_size[b][0] / by_size[a][0]:.2f}x" for a, b in zip(sizes, sizes[1:], strict=False)]
        print(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    print()
    largest = max(sizes)
    met = True
    for name in ("rigctl report", "rigctl compare"):
        seconds, _, mb = figures[name][largest]
        growth = [(figures[name][b][0] / figures[name][a][0]) / (b / a) for a, b in zip(sizes, sizes[1:],
                                                                                      strict=False)]
        ok = seconds <= AIM_SECONDS and mb <= AIM_MB and all(g <= 1.0 for g in growth)
        met &= ok
        print(f"aim {name} at {largest} runs <= {AIM_SECONDS:.0f} s and <= {AIM_MB:.0f} MB, no worse than linear: "
              f"{seconds:.2f} s, {mb:.0f} MB, growth over linear {', '.join(f'{g:.2f}' for g in growth)} -> "
              f"{'met' if ok else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
