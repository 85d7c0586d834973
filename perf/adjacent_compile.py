#!/usr/bin/env python3
"""What an adjacent llama.cpp version costs to compile after its neighbour, against a cold compile, as a ratio.

Aim: at most 0.3x. The llama_cpp role unpacks every archive into its build's own root, beside the CMake tree, so
each version's sources sit at the same relative path and ccache (base_dir = the work root, hash_dir = false)
takes every file the new version did not change from the objects the old one made.

On the lab's desktop rig (a copy of the lab inventory, provisioned with `rigctl provision`): first ``--old`` pinned
(a cold compile when the lab slot's ccache has never seen that version), then ``--new`` pinned, with its build
number stated in ``llama_cpp_build_number`` (the stamp it would have anyway): a build key of its own, so it is
compiled on the rig, not copied from a pack the controller's cache may hold. The figures are the compile's own
(`cmake --build`, followed on the rig by perf/compile_cpu.py: wall time, and the CPU time of its process tree)
and ccache's hit counts; CPU time is the figure that holds on a machine shared with other work.

    RIGCTL_LAB_SLOT=N .venv/bin/python perf/adjacent_compile.py [--old b11401] [--new b11434]

Needs the lab up (`rigctl lab up`); leaves the rigs on ``--new`` with that build key.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rigctl.fleet import candidate
from rigctl.inventory import Inventory
from rigctl.upgrade.upgrade import PinFiles, write_pin

REPO = Path(__file__).resolve().parent.parent
RIGCTL = str(Path(sys.executable).parent / "rigctl")
POLLER = Path(__file__).resolve().parent / "compile_cpu.py"
CCACHE_DIR = "/var/cache/llama.cpp/ccache"


@dataclass(frozen=True)
class Compile:
    version: str
    wall_s: float
    cpu_s: float
    ccache: str


def rig(*command: str) -> str:
    # `lab ssh` hands its command to the rig's shell as one line.
    done = subprocess.run([RIGCTL, "lab", "ssh", "desktop", "--", shlex.join(command)], capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout


def follow_compile() -> subprocess.Popen[str]:
    """perf/compile_cpu.py on the rig, waiting for the compile (the rig's journal has no CPU accounting)."""
    script = base64.b64encode(POLLER.read_bytes()).decode()
    return subprocess.Popen([RIGCTL, "lab", "ssh", "desktop", "--",
                             f"echo {script} | base64 -d > /tmp/compile_cpu.py && python3 /tmp/compile_cpu.py 7200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def provision(copy: Path, version: str, extra: str, env: dict[str, str]) -> Compile:
    inventory = Inventory.load(copy)
    desktop = inventory.host("desktop")
    raw = PinFiles(inventory, "group all").raw("llama_cpp_archive")["path"]
    pin = candidate.fetch_archive(candidate.pin_for(desktop, version, raw))
    write_pin(inventory, desktop, pin, {}, ["desktop", "laptop"])
    with (copy / "group_vars" / "all" / "llama_cpp.yml").open("a") as out:
        out.write(extra)
    # Counts of this compile alone (a fresh rig has no ccache yet: nothing to zero).
    rig("sh", "-c", f"! command -v ccache >/dev/null || CCACHE_DIR={CCACHE_DIR} ccache --zero-stats")
    follower = follow_compile()
    started = time.monotonic()
    done = subprocess.run([RIGCTL, "provision"], capture_output=True, text=True, env=env, timeout=7200, check=False)
    if done.returncode != 0:
        follower.kill()
        sys.exit(f"error: provision at {version} failed: {done.stderr.strip()[-2000:]}")
    out, err = follower.communicate(timeout=60)
    if follower.returncode != 0:
        sys.exit(f"error: no compile of {version} seen on desktop: {out.strip()} {err.strip()}")
    figures = json.loads(out)
    wall, cpu = float(figures["wall_s"]), float(figures["cpu_s"])
    stats = rig("env", f"CCACHE_DIR={CCACHE_DIR}", "ccache", "--print-stats")
    counts = dict(line.split("\t", 1) for line in stats.splitlines() if "\t" in line)
    hits = int(counts.get("direct_cache_hit", 0)) + int(counts.get("preprocessed_cache_hit", 0))
    misses = int(counts.get("cache_miss", 0))
    print(f"{version}: compile {wall:.0f} s wall, {cpu:.0f} s CPU; ccache {hits} hits, {misses} misses "
          f"(provision {time.monotonic() - started:.0f} s)", flush=True)
    return Compile(version, wall, cpu, f"{hits}/{hits + misses}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default="b11401")
    parser.add_argument("--new", default="b11434")
    parser.add_argument("--adjacent-only", action="store_true",
                        help="the rigs are on --old already (its compile measured before): compile --new only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "lab"
        shutil.copytree(REPO / "inventory" / "lab", copy)
        env = {**os.environ, "RIGCTL_INVENTORY": str(copy), "RIGCTL_RESULTS": str(Path(scratch) / "results")}
        cold = None if args.adjacent_only else provision(copy, args.old, "", env)
        number = args.new.removeprefix("b")
        adjacent = provision(copy, args.new, f"# A build key of its own (the stamp it has anyway).\n"
                                             f"llama_cpp_build_number: \"{number}\"\n", env)
    if cold is None:
        return
    print(f"\n| | {cold.version} (cold) | {adjacent.version} after {cold.version} | ratio |\n|---|---|---|---|\n"
          f"| compile, wall | {cold.wall_s:.0f} s | {adjacent.wall_s:.0f} s | {adjacent.wall_s / cold.wall_s:.2f}x |\n"
          f"| compile, CPU | {cold.cpu_s:.0f} s | {adjacent.cpu_s:.0f} s | {adjacent.cpu_s / cold.cpu_s:.2f}x |\n"
          f"| ccache hits | {cold.ccache} | {adjacent.ccache} | |")


if __name__ == "__main__":
    main()
