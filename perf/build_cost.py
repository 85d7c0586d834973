#!/usr/bin/env python3
"""What a llama.cpp build costs through the llama_cpp role on one lab rig: a cold build (empty
ccache), a no-op rerun, and a ccache-warm rebuild after a CMake flag change, each as a ratio to the
cold build.

Aim: no-op < 2% of cold; warm rebuild < 35% of cold.

The measured runs use their own install and work roots on the rig (``/opt/llama.cpp-bench``,
``/var/cache/llama.cpp-bench``, removed before and after) and no twin copying, so the rig's real
builds and ccache are untouched and the cold build is really cold. Brings the lab up if it is
down, and takes it down again only if it started it. Not part of the test suite (a cold build
takes minutes).

    .venv/bin/python perf/build_cost.py [--host desktop] [--flag GGML_CPU_REPACK=OFF]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from rigctl.fleet.deploy import run_playbook
from rigctl.inventory import Host, Inventory
from rigctl.lab.rigs import Lab
from rigctl.ssh import SshClient, SshTarget

REPO = Path(__file__).resolve().parent.parent
INSTALL_ROOT = "/opt/llama.cpp-bench"
WORK_ROOT = "/var/cache/llama.cpp-bench"


def on_rig(host: Host, cmd: str) -> str:
    with SshClient(SshTarget.from_host(host)) as ssh:
        return ssh.run(cmd, timeout=120).stdout


def ccache_stats(host: Host) -> dict[str, int]:
    out = on_rig(host, f"CCACHE_DIR={WORK_ROOT}/ccache ccache --print-stats 2>/dev/null || true")
    stats = {}
    for line in out.splitlines():
        name, _, value = line.partition("\t")
        if value.strip().isdigit():
            stats[name] = int(value)
    return stats


def timed(inventory: Inventory, host: str, extravars: dict[str, Any]) -> tuple[float, int]:
    started = time.monotonic()
    result = run_playbook(inventory, "site.yml", limit=host, tags=["llama_cpp"], extravars=extravars, timeout=7200)
    wall = time.monotonic() - started
    result.raise_for_failures()
    return wall, result.hosts[host].changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="desktop")
    parser.add_argument("--flag", default="GGML_CPU_REPACK=OFF",
                        help="the CMake flag (NAME=VALUE) changed for the warm rebuild")
    parser.add_argument("-i", "--inventory", default=str(REPO / "inventory" / "lab"))
    args = parser.parse_args()
    flag_name, _, flag_value = args.flag.partition("=")

    inventory = Inventory.load(args.inventory)
    with Lab.from_inventory(inventory).up_while():
        host = inventory.host(args.host)
        base = {"llama_cpp_install_root": INSTALL_ROOT, "llama_cpp_work_root": WORK_ROOT, "llama_cpp_build_once": False}
        clean = f"rm -rf {INSTALL_ROOT} {WORK_ROOT}"
        try:
            on_rig(host, clean)
            cold, cold_changed = timed(inventory, args.host, base)
            noop, noop_changed = timed(inventory, args.host, base)
            before = ccache_stats(host)
            warm, _ = timed(inventory, args.host, {**base, "llama_cpp_cmake_options": {flag_name: flag_value}})
            after = ccache_stats(host)
            cores = on_rig(host, "nproc").strip()
        finally:
            on_rig(host, clean)

    hits = sum(after.get(k, 0) - before.get(k, 0) for k in ("direct_cache_hit", "preprocessed_cache_hit"))
    misses = after.get("cache_miss", 0) - before.get("cache_miss", 0)
    print(f"llama.cpp build cost on lab rig {args.host} (role llama_cpp, 6 targets, CPU, {cores} cores)")
    print(f"  cold build (empty ccache)      {cold:8.1f} s   1.000x   changed={cold_changed}")
    print(f"  no-op rerun                    {noop:8.1f} s   {noop / cold:.3f}x   changed={noop_changed}"
          f"   (aim < 0.02x)")
    print(f"  warm rebuild, {args.flag:<16} {warm:8.1f} s   {warm / cold:.3f}x   ccache hits={hits} misses={misses}"
          f"   (aim < 0.35x)")
    ok = noop_changed == 0 and noop / cold < 0.02 and warm / cold < 0.35
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
