#!/usr/bin/env python3
"""Wall time of a no-change `rigctl provision` of both lab rigs, against the same run with Ansible's
default SSH settings (linear strategy, no pipelining, no ControlPersist), measured side by side.

Aim: changed=0 on every run, and the configured run at most 0.25x the default.
Brings the lab up if it is down, and takes it down again only if it started it.

    .venv/bin/python perf/converge_noop.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from rigctl.fleet.deploy import run_playbook
from rigctl.inventory import Inventory
from rigctl.lab.rigs import Lab

REPO = Path(__file__).resolve().parent.parent

# Ansible's own defaults: no pipelining, linear strategy, and ssh without connection sharing.
DEFAULTS = {
    "ANSIBLE_STRATEGY": "linear",
    "ANSIBLE_PIPELINING": "False",
    "ANSIBLE_SSH_ARGS": "-o ControlMaster=no",
}
VARIANTS = {
    "configured (ansible.cfg: mitogen)": {},
    "pipelining + ControlPersist, linear": {"ANSIBLE_STRATEGY": "linear"},
    "Ansible defaults": DEFAULTS,
}


def timed_run(inventory: Inventory, env: dict[str, str]) -> tuple[float, int, int]:
    started = time.monotonic()
    result = run_playbook(inventory, "site.yml", env=env)
    wall = time.monotonic() - started
    result.raise_for_failures()
    changed = sum(h.changed for h in result.hosts.values())
    tasks = max(h.ok + h.skipped for h in result.hosts.values())
    return wall, changed, tasks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-i", "--inventory", default=str(REPO / "inventory" / "lab"))
    args = parser.parse_args()

    inventory = Inventory.load(args.inventory)
    with Lab.from_inventory(inventory).up_while():
        _, changed, tasks = timed_run(inventory, {})  # converge first; the measured runs change nothing
        print(f"converge: {changed} changed, {tasks} tasks per host")
        walls: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for rep in range(args.repeats):
            for name, env in VARIANTS.items():  # interleaved, so drift hits every variant alike
                wall, changed, _ = timed_run(inventory, env)
                walls[name].append(wall)
                print(f"  run {rep + 1} {name}: {wall:.2f} s, changed={changed}")
                if changed:
                    print(f"FAIL: {name} changed {changed} things on a no-change run", file=sys.stderr)
                    return 1
        default = statistics.median(walls["Ansible defaults"])
        print(f"\nno-change provision of {len(inventory.hosts)} rigs, {tasks} tasks each, "
              f"median of {args.repeats}:")
        for name in VARIANTS:
            median = statistics.median(walls[name])
            print(f"  {name:40s} {median:6.2f} s  {median / default:5.2f}x of defaults")
        ratio = statistics.median(walls["configured (ansible.cfg: mitogen)"]) / default
        print(f"\nratio configured/defaults = {ratio:.2f} (aim <= 0.25): {'ok' if ratio <= 0.25 else 'MISSED'}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
