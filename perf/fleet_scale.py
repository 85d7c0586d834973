#!/usr/bin/env python3
"""What the fleet's commands cost as it grows: a lab of N rigs (``rigctl lab inventory --rigs N``) for each N in
turn, brought up, provisioned, timed, and taken down, on this machine in one run; every figure printed as a ratio
against the smallest N.

Per N: ``lab up``; the first ``provision`` and a no-op one (site.yml, changed=0 checked); ``rigctl servers``
and ``rigctl jobs`` (the CLI as a user runs it); ``rigctl pull`` with 0 runs on each host and, with ``--seed``
(a results store a real campaign wrote), with 1 and 100 runs per host placed in the hosts' results directories
(copies sealed by ``RunRecord.seal`` under each host's name); one exporter collection (FleetState and the
results view); a fan-out eval over every rig's server (``rigctl eval run`` with one ``--host``/``--server``
pair per rig, the same few GSM8K questions at every N, after an untimed run that warms every server); and the
exporter's collection over an inventory of the N rigs plus ``--aliases`` more hosts, each another name for one
of the rigs' addresses (the same host key vouches for it), so that one collection opens N + aliases SSH
sessions, timed against the exporter's scrape interval after a first collection has had the model files hashed
(with a host timeout long enough for every host to answer: the wall time is what reading them all takes).
Aims (#29): no-op converge at 8 rigs at most 2.0x its time at 2; ``servers`` and ``jobs`` at 8 at most 1.5x at
2; the collection at 8 rigs + 200 aliased hosts within the exporter's scrape interval.

The rigs are containers on this machine: whatever each host does for a collection or a question (a Python
start, ``systemctl``, decoding) lands on the controller's own cores, where real hosts would each use their own.
The collection's CPU seconds in the exporter's process are printed beside its wall time for that reason.

The lab of each N uses this slot's bridge and directory (``RIGCTL_LAB_SLOT``), so no lab of the slot may be up.
Each rig boots systemd and, provisioned, serves SmolLM2-135M: keep N within the machine's memory.

    RIGCTL_LAB_SLOT=6 .venv/bin/python perf/fleet_scale.py [--rigs 2,4,8] [--seed results] [--repeats 3]
        [--aliases 200] [--questions 8] [--max-tokens 8] [--fanout-repeats 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eval_fanout import answers_by_server, timed_run  # noqa: E402
from gsm8k_load import gsm8k_task  # noqa: E402

from rigctl.evals import runner  # noqa: E402
from rigctl.evals.fanout import FanOut  # noqa: E402
from rigctl.evals.target import inventory_targets  # noqa: E402
from rigctl.fleet.deploy import run_playbook  # noqa: E402
from rigctl.inventory import Inventory  # noqa: E402
from rigctl.jobs import RESULTS_DIR  # noqa: E402
from rigctl.lab.config import write_lab_inventory  # noqa: E402
from rigctl.lab.rigs import Lab  # noqa: E402
from rigctl.results.record import RUN_FILE  # noqa: E402
from rigctl.results.store import ResultsStore, StoredRun  # noqa: E402
from rigctl.services.exporter import DEFAULT_INTERVAL, Exporter  # noqa: E402

AIMS = {"no-op provision": 2.0, "rigctl servers": 1.5, "rigctl jobs": 1.5}
#: Every rig's instance that the fan-out eval asks (the lab's always-on SmolLM2 server).
FANOUT_SERVER = "smollm2"
#: How long the first collection may take to have every host's model files hashed (200 aliases hash theirs too).
HASH_SETTLE_S = 900.0
#: The aliased collections' host timeout: long enough that every host answers, so that the wall time says how
#: long reading them all takes (the exporter's own default, 10 s, would cut it off and call the rest down).
ALIASED_HOST_TIMEOUT_S = 120.0


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


def write_alias_inventory(source: Path, dest: Path, aliases: int) -> Path:
    """A copy of the lab inventory ``source`` (as ``rigctl lab inventory`` writes it) with ``aliases`` more hosts
    in a group ``aliases``: ``alias001``, ... each another name for one of the rigs in turn (its address, and so
    its host key in the lab's known_hosts), with the rigs' servers and models from group_vars. Only for the
    exporter: ``lab up`` on it would take every alias for a rig to make."""
    shutil.copytree(source, dest)
    hosts_file = dest / "hosts.yml"
    hosts = yaml.safe_load(hosts_file.read_text(encoding="utf-8"))
    groups = hosts["all"]["children"]["gpu_hosts"]["children"]
    addresses = [spec["ansible_host"] for spec in groups["lab"]["hosts"].values()]
    groups["aliases"] = {"hosts": {f"alias{n + 1:03d}": {"ansible_host": addresses[n % len(addresses)]}
                                   for n in range(aliases)}}
    hosts_file.write_text(yaml.safe_dump(hosts, sort_keys=False), encoding="utf-8")
    return dest


def machine_busy_seconds() -> float:
    """CPU seconds this machine's cores have spent busy since boot (``/proc/stat``), every process counted: the
    rigs' sshd and probes with the rest."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def collection(exporter: Exporter) -> tuple[float, float, float, list[str]]:
    """One collection of ``exporter``: its wall seconds, the CPU seconds of this process (every thread) and of the
    whole machine meanwhile, and the hosts it found down, with why."""
    cpu_before, busy_before = resource.getrusage(resource.RUSAGE_SELF), machine_busy_seconds()
    wall, snapshot = timed(exporter.collect_once)
    cpu_after, busy_after = resource.getrusage(resource.RUSAGE_SELF), machine_busy_seconds()
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    down = [f"{name}: {state.error}" for name, state in snapshot.hosts.items() if not state.up]
    return wall, cpu, busy_after - busy_before, down


def aliased_collection(inventory: Inventory, results: ResultsStore, repeats: int) -> tuple[dict[str, float], int]:
    """The exporter over ``inventory`` (the rigs and their aliases), every host given
    :data:`ALIASED_HOST_TIMEOUT_S` to answer: a first collection (which has every host's model files hashed on
    the slow lane, waited for), then ``repeats`` collections: the medians of their wall seconds, of the
    exporter's CPU seconds and of the machine's, and the most hosts one of them found down (a collection that
    lost hosts is not the one the aim means)."""
    exporter = Exporter(inventory, results=results, interval=DEFAULT_INTERVAL, host_timeout=ALIASED_HOST_TIMEOUT_S)
    try:
        first, first_cpu, _, first_down = collection(exporter)
        settle, _ = timed(lambda: exporter.settle_hashes(HASH_SETTLE_S))
        print(f"    {len(exporter.hosts)} hosts: first collection {first:.2f} s ({first_cpu:.2f} CPU s, "
              f"{len(first_down)} down), model files hashed {settle:.1f} s later", flush=True)
        samples, most_down = [], 0
        for _ in range(repeats):
            wall, cpu, busy, down = collection(exporter)
            print(f"    collection of {len(exporter.hosts)} hosts: {wall:.2f} s, exporter {cpu:.2f} CPU s, machine "
                  f"{busy:.2f} CPU s, {len(down)} down" + (f", e.g. {'; '.join(down[:2])}" if down else ""),
                  flush=True)
            samples.append((wall, cpu, busy))
            most_down = max(most_down, len(down))
        wall, cpu, busy = (statistics.median(column) for column in zip(*samples, strict=True))
        return {"wall": wall, "exporter cpu": cpu, "machine cpu": busy}, most_down
    finally:
        exporter.stop()


def fanout_eval(source: Path, inventory: Inventory, workdir: Path, repeats: int, questions: int,
                max_tokens: int) -> float:
    """The median wall time of ``repeats`` runs of ``rigctl eval run`` fanned out over every rig's
    :data:`FANOUT_SERVER`, one request in flight per server, each run checked to have answered every question
    once; an untimed run first warms every server. Its task and results go under ``workdir`` (new)."""
    workdir.mkdir(parents=True)
    task = gsm8k_task(workdir, "fleet-fanout", questions, max_tokens)
    results = workdir / "results"
    store = ResultsStore(results)
    pairs = [(host, FANOUT_SERVER) for host in inventory.hosts.values()]
    timed_run(task, FanOut.of(inventory_targets(pairs)), store, runner.Options(concurrency=1))
    warmed = {run.id for run in store.runs()}
    servers = [arg for host, server in pairs for arg in ("--host", host.name, "--server", server)]
    wall = median_of(repeats, lambda: cli(source, "eval", "run", "--task", str(task.path), "--concurrency", "1",
                                          *servers, results=results))
    for run in store.runs():
        if run.id not in warmed:
            shares = answers_by_server(task, run.path)
            if len(shares) != len(pairs):
                print(f"    note: {run.id}: {len(shares)} of {len(pairs)} servers answered", flush=True)
    return wall


def median_of(repeats: int, work) -> float:
    """The median wall time of ``repeats`` calls of ``work`` (which returns its own wall time)."""
    return statistics.median(work() for _ in range(repeats))


class Figures(dict[str, float]):
    """One lab's figures, each printed as it comes."""

    def __init__(self, rigs: int):
        super().__init__()
        self.rigs = rigs

    def __setitem__(self, name: str, seconds: float) -> None:
        super().__setitem__(name, seconds)
        print(f"  {self.rigs} rigs: {name:42s} {seconds:8.2f} s", flush=True)


def measure(rigs: int, work: Path, seed: list[StoredRun] | None,
            args: argparse.Namespace) -> tuple[dict[str, float], int]:
    """The figures of a lab of ``rigs`` rigs, and the most hosts an aliased collection found down."""
    source = write_lab_inventory(REPO / "inventory" / "lab", work / f"lab{rigs}", rigs)
    inventory = Inventory.load(source)
    lab = Lab.from_inventory(inventory)
    figures = Figures(rigs)
    down = 0
    try:
        figures["lab up"], _ = timed(lab.up)
        figures["first provision"], _ = provision(inventory)
        figures["no-op provision"], changed = provision(inventory)
        if changed:
            raise SystemExit(f"{rigs} rigs: the no-op provision changed {changed} things")
        repeats = args.repeats
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
        results = ResultsStore(work / f"results-{rigs}-{counts[-1]}")
        exporter = Exporter(inventory, results=results)
        figures["exporter collection"] = median_of(repeats, lambda: timed(exporter.collect_once)[0])
        exporter.stop()
        try:
            figures[f"fan-out eval ({args.questions} q)"] = fanout_eval(
                source, inventory, work / f"lab{rigs}-eval", args.fanout_repeats, args.questions, args.max_tokens)
        except (Exception, SystemExit) as exc:  # the other figures of this N still count
            print(f"  {rigs} rigs: the fan-out eval failed: {exc}", flush=True)
        if args.aliases:
            try:
                aliased = Inventory.load(write_alias_inventory(source, work / f"lab{rigs}-aliases", args.aliases))
                collected, down = aliased_collection(aliased, results, repeats)
            except (Exception, SystemExit) as exc:
                print(f"  {rigs} rigs: the collection with {args.aliases} aliases failed: {exc}", flush=True)
            else:
                figures[f"exporter collection +{args.aliases} aliases"] = collected["wall"]
                figures["  its CPU s in the exporter"] = collected["exporter cpu"]
                figures["  CPU s of the whole machine meanwhile"] = collected["machine cpu"]
    finally:
        lab.down()
    return figures, down


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rigs", default="2,4,8", help="lab sizes, measured in this order, each against the smallest")
    parser.add_argument("--seed", type=Path, help="a results store of real runs, for pulls of 1 and 100 runs")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--repeats", type=int, default=1,
                        help="median of this many runs of servers, jobs and the collections")
    parser.add_argument("--aliases", type=int, default=200,
                        help="extra inventory names for the rigs in the exporter's second collection (0: none)")
    parser.add_argument("--questions", type=int, default=8, help="GSM8K questions of the fan-out eval")
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of the fan-out eval's answers")
    parser.add_argument("--fanout-repeats", type=int, default=1,
                        help="median of this many fan-out evals (each after one that warms the servers)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.rigs.split(",")]
    seed = list(ResultsStore(args.seed).runs()) if args.seed else None
    if args.seed and not seed:
        raise SystemExit(f"--seed {args.seed}: no runs there")
    work = args.work or Path(tempfile.mkdtemp(prefix="rigctl-fleet-scale-"))
    print(f"machine: {os.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"labs of {', '.join(map(str, sizes))} rigs", flush=True)
    # Measured in the order given (the largest early, when time is short), reported from the smallest up.
    measured = {rigs: measure(rigs, work, seed, args) for rigs in sizes}
    sizes = sorted(sizes)
    figures = {rigs: measured[rigs][0] for rigs in sizes}
    base = sizes[0]
    print("\n| operation | " + " | ".join(f"{n} rigs s" for n in sizes) + " | "
          + " | ".join(f"{n} / {base}" for n in sizes[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(sizes) - 1))
    names = list(dict.fromkeys(name for n in sizes for name in figures[n]))
    for name in names:
        cells = [figures[n].get(name) for n in sizes]
        first = cells[0]
        print(f"| {name} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " | "
              + " | ".join("-" if c is None or not first else f"{c / first:.2f}x" for c in cells[1:]) + " |")
    met = True
    largest = sizes[-1]
    for name, aim in AIMS.items():
        ratio = figures[largest][name] / figures[base][name]
        ok = ratio <= aim
        met &= ok
        print(f"aim {name} at {largest} rigs <= {aim}x its time at {base}: {ratio:.2f}x -> {'met' if ok else 'MISSED'}")
    if args.aliases:
        wall = figures[largest].get(f"exporter collection +{args.aliases} aliases", math.inf)
        down = measured[largest][1]
        ok = wall <= DEFAULT_INTERVAL and not down
        met &= ok
        print(f"aim exporter collection at {largest} rigs + {args.aliases} aliased hosts within its scrape interval "
              f"({DEFAULT_INTERVAL:g} s): {wall:.2f} s, {down} hosts down -> {'met' if ok else 'MISSED'}")
    print(f"load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
