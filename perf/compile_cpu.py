#!/usr/bin/env python3
"""On a rig (shipped there by perf/adjacent_compile.py): wait up to ARGV[1] seconds for the llama_cpp role's
`cmake --build`, then follow it to its end and print its wall time and the CPU time of its whole process tree
(user and system, with every finished compiler's, as make reaps it) as JSON. Standard library only. The tree is
read every 0.2 s, so what finishes in the last 0.2 s before the build ends may be missing from the CPU time."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def stat(pid: int) -> tuple[int, int, int]:
    """(parent pid, utime + stime + cutime + cstime in ticks, start time in ticks after boot)."""
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(rest[1]), sum(int(x) for x in rest[11:15]), int(rest[19])


def processes() -> dict[int, tuple[int, int, int]]:
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                found[int(name)] = stat(int(name))
    return found


def tree_ticks(root: int) -> int:
    """CPU ticks of ``root`` and every process below it."""
    procs = processes()
    keep, grown = {root}, True
    while grown:
        below = {pid for pid, (ppid, _, _) in procs.items() if ppid in keep} - keep
        keep |= below
        grown = bool(below)
    return sum(procs[pid][1] for pid in keep if pid in procs)


def find_build() -> int | None:
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")[:2] == [b"cmake", b"--build"]:
                    return int(name)
    return None


def main() -> None:
    deadline = time.time() + float(sys.argv[1])
    root = find_build()
    while root is None and time.time() < deadline:
        time.sleep(0.5)
        root = find_build()
    if root is None:
        sys.exit(json.dumps({"error": "no compile"}))
    boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    started = boot + stat(root)[2] / TICK
    most = 0
    while Path(f"/proc/{root}").exists():
        with contextlib.suppress(OSError, IndexError, ValueError):
            most = max(most, tree_ticks(root))
        time.sleep(0.2)
    print(json.dumps({"wall_s": round(time.time() - started, 1), "cpu_s": round(most / TICK, 1)}))


if __name__ == "__main__":
    main()
