#!/usr/bin/env python3
"""What the fleet's commands cost as it grows: a lab of N rigs (``rigctl lab inventory --rigs N``) for each N in
turn, brought up, provisioned, timed, and taken down, on this machine in one run; every figure printed as a ratio
against the smallest N.

Per N: ``lab up``; the first ``provision`` and a no-op one (site.yml, changed=0 checked); ``rigctl servers``
and ``rigctl jobs`` (the CLI as a user runs it); ``rigctl pull`` with 0 runs on each host and, with ``--seed``
(a results store a real campaign wrote), with 1 and 100 runs per host placed in the hosts' results directories
(copies sealed by ``RunRecord.seal`` under each host's name); one exporter collection (FleetState and the
results view). Aims (#29): no-op converge at 8 rigs at most 2.0x its time at 2; ``servers`` and ``jobs`` at 8
at most 1.5x at 2.

The lab of each N uses this slot's bridge and directory (``RIGCTL_LAB_SLOT``), so no lab of the slot may be up.
Each rig boots systemd and, provisioned, serves SmolLM2-135M: keep N within the machine's memory.

    RIGCTL_LAB_SLOT=6 .venv/bin/python perf/fleet_scale.py [--rigs 2,4,8] [--seed results] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rigctl.fleet.deploy import run_playbook  # noqa: E402
from rigctl.inventory import Inventory  # noqa: E402
from rigctl.jobs import RESULTS_DIR  # noqa: E402
from rigctl.lab.config import write_lab_inventory  # noqa: E402
from rigctl.lab.rigs import Lab  # noqa: E402
from rigctl.results.record import RUN_FILE  # noqa: E402
from rigctl.results.store import ResultsStore, StoredRun  # noqa: E402
from rigctl.services.exporter import Exporter  # noqa: E402

AIMS = {"no-op provision": 2.0, "rigctl servers": 1.5, "rigctl jobs": 1.5}


def timed(work) -> tuple[float, object]:
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def cli(inventory: Path, *args: str, results: Path | None = None) -> float:
    argv = [sys.executable, "-m", "rigctl.cli", "-i", str(inventory), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), **({"RIGCTL_RESULTS": str(results)} if results else {})}
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800, env=env, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    return wall


def provision(inventory: Inventory) -> tuple[float, int]:
    wall, result = timed(lambda: run_playbook(inventory, "site.yml", timeout=3600))
    result.raise_for_failures()
    return wall, sum(h.changed for h in result.hosts.values())


def place_runs(lab: Lab, seed: list[StoredRun], host: str, count: int) -> None:
    """``count`` runs in ``host``'s results directory: copies of the seed's, sealed under the host's name."""
    with tempfile.TemporaryDirectory(prefix="rigctl-fleet-runs-") as staging:
        root = Path(staging)
        oldest = datetime(2026, 1, 1, tzinfo=UTC)
        for n in range(count):
            source = seed[n % len(seed)]
            started = oldest + timedelta(minutes=n)
            run_id = f"{source.record.kind}-{started.strftime('%Y%m%dT%H%M%SZ')}-{n:04x}"
            shutil.copytree(source.path, root / run_id, ignore=shutil.ignore_patterns(RUN_FILE))
            record = dataclasses.replace(source.record, id=run_id, host=host, files=[], extra=dict(source.record.extra),
                                         started=started.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
            record.seal(root / run_id, status=source.record.status)
        packed = io.BytesIO()
        with tarfile.open(fileobj=packed, mode="w") as tar:
            tar.add(root, arcname=".")
    target = f"{RESULTS_DIR}/{host}"
    done = subprocess.run(lab.ssh_argv(host, f"rm -rf {target} && mkdir -p {target} && tar -x -C {target}"),
                          input=packed.getvalue(), capture_output=True, timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{host}: placing runs failed: {done.stderr.decode(errors='replace')[-500:]}")


def median_of(repeats: int, work) -> float:
    """The median wall time of ``repeats`` calls of ``work`` (which returns its own wall time)."""
    return statistics.median(work() for _ in range(repeats))


def measure(rigs: int, work: Path, seed: list[StoredRun] | None, repeats: int) -> dict[str, float]:
    source = write_lab_inventory(REPO / "inventory" / "lab", work / f"lab{rigs}", rigs)
    inventory = Inventory.load(source)
    lab = Lab.from_inventory(inventory)
    figures: dict[str, float] = {}
    try:
        figures["lab up"], _ = timed(lab.up)
        figures["first provision"], _ = provision(inventory)
        figures["no-op provision"], changed = provision(inventory)
        if changed:
            raise SystemExit(f"{rigs} rigs: the no-op provision changed {changed} things")
        figures["rigctl servers"] = median_of(repeats, lambda: cli(source, "servers"))
        figures["rigctl jobs"] = median_of(repeats, lambda: cli(source, "jobs"))
        counts = [0, 1, 100] if seed else [0]
        for count in counts:
            if count:
                for host in inventory.hosts:
                    place_runs(lab, seed or [], host, count)
            results = work / f"results-{rigs}-{count}"
            # Later pulls of the same runs find them here and copy nothing: only the first is timed.
            figures[f"rigctl pull ({count} runs/host)"] = cli(source, "pull", results=results)
            if count and sum(1 for _ in ResultsStore(results).runs()) != count * rigs:
                raise SystemExit(f"{rigs} rigs: pull of {count} runs per host did not bring them all")
        exporter = Exporter(inventory, results=ResultsStore(work / f"results-{rigs}-{counts[-1]}"))
        figures["exporter collection"] = median_of(repeats, lambda: timed(exporter.collect_once)[0])
    finally:
        lab.down()
    for name, seconds in figures.items():
        print(f"  {rigs} rigs: {name:30s} {seconds:8.2f} s", flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rigs", default="2,4,8")
    parser.add_argument("--seed", type=Path, help="a results store of real runs, for pulls of 1 and 100 runs")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--repeats", type=int, default=1,
                        help="median of this many runs of servers, jobs and the exporter's collection")
    args = parser.parse_args()
    sizes = [int(n) for n in args.rigs.split(",")]
    seed = list(ResultsStore(args.seed).runs()) if args.seed else None
    if args.seed and not seed:
        raise SystemExit(f"--seed {args.seed}: no runs there")
    work = args.work or Path(tempfile.mkdtemp(prefix="rigctl-fleet-scale-"))
    print(f"machine: {os.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"labs of {', '.join(map(str, sizes))} rigs", flush=True)
    figures = {rigs: measure(rigs, work, seed, args.repeats) for rigs in sizes}
    base = sizes[0]
    print("\n| operation | " + " | ".join(f"{n} rigs s" for n in sizes) + " | "
          + " | ".join(f"{n} / {base}" for n in sizes[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(sizes) - 1))
    for name in figures[base]:
        print(f"| {name} | " + " | ".join(f"{figures[n][name]:.2f}" for n in sizes) + " | "
              + " | ".join(f"{figures[n][name] / figures[base][name]:.2f}x" for n in sizes[1:]) + " |")
    met = True
    largest = sizes[-1]
    for name, aim in AIMS.items():
        ratio = figures[largest][name] / figures[base][name]
        ok = ratio <= aim
        met &= ok
        print(f"aim {name} at {largest} rigs <= {aim}x its time at {base}: {ratio:.2f}x -> {'met' if ok else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
