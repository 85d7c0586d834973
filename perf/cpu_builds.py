#!/usr/bin/env python3
"""Prompt and generation speed of llama.cpp CPU builds side by side on one lab rig: a portable build
(GGML_NATIVE=OFF, what the lab inventory uses) against a native one (-march=native), as ratios to the
first build given, measured interleaved in one run on SmolLM2-135M Q4_1.

Aim: the portable build keeps >= 0.85x of native prompt and generation speed on this machine
(otherwise the lab's safe default costs too much and a per-CPU native build is worth its build key).

Each build is a tarball the llama_cpp role exported into the controller's cache
(``<rigctl cache>/builds/<name>.tar.gz``: ``llama_cpp_build_once`` hosts export every build they
make), or ``current`` for what the rig runs. The builds are unpacked under ``/tmp/rigctl-cpu-bench``
on the rig, which is removed afterwards; the rig's own builds are untouched. Runs are small (pp64,
tg16 by default, 2 threads): the lab machine's cores are shared. The lab must be up.

    .venv/bin/python perf/cpu_builds.py --build native=~/.cache/rigctl/builds/b11434-<key>.tar.gz \
        [--build portable=current] [--host desktop] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rigctl.inventory import Host, Inventory
from rigctl.ssh import SshClient, SshTarget

REPO = Path(__file__).resolve().parent.parent
SCRATCH = "/tmp/rigctl-cpu-bench"
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
AIM = 0.85


def on_rig(ssh: SshClient, cmd: str, timeout: float = 600) -> str:
    return ssh.run(cmd, timeout=timeout).check().stdout


def bench_once(ssh: SshClient, bin_dir: str, model: str, *, prompt: int, gen: int, threads: int) -> tuple[float, float]:
    out = on_rig(ssh, f"{bin_dir}/llama-bench -m {model} -p {prompt} -n {gen} -r 1 -t {threads} -o json")
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return pp, tg


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", default=[], metavar="LABEL=TARBALL|current",
                        help="a build to measure; the first is the reference (give native first)")
    parser.add_argument("--host", default="desktop")
    parser.add_argument("--reps", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-i", "--inventory", default=str(REPO / "inventory" / "lab"))
    args = parser.parse_args()
    builds = [b.partition("=")[::2] for b in args.build]
    if len(builds) < 2 or any(not label or not src for label, src in builds):
        parser.error("give at least two --build LABEL=TARBALL|current")
    for label, src in builds:
        if src != "current" and not Path(os.path.expanduser(src)).is_file():
            parser.error(f"--build {label}: no file {src}")

    inventory = Inventory.load(args.inventory)
    host: Host = inventory.host(args.host)
    cache = Path(os.path.expanduser(os.environ.get("RIGCTL_CACHE_DIR") or "~/.cache/rigctl"))
    results: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in builds}
    with SshClient(SshTarget.from_host(host)) as ssh:
        on_rig(ssh, f"rm -rf {SCRATCH} && mkdir -p {SCRATCH}")
        try:
            ssh.put(cache / "models" / MODEL, f"{SCRATCH}/{MODEL}", timeout=600)
            bins = {}
            for label, src in builds:
                if src == "current":
                    bins[label] = "/opt/llama.cpp/current/bin"
                    continue
                ssh.put(Path(os.path.expanduser(src)), f"{SCRATCH}/{label}.tar.gz", timeout=600)
                on_rig(ssh, f"mkdir -p {SCRATCH}/{label} && tar -xzf {SCRATCH}/{label}.tar.gz -C {SCRATCH}/{label}")
                bins[label] = f"{SCRATCH}/{label}/bin"
            names = {label: json.loads(on_rig(ssh, f"cat {b}/../build.json")) for label, b in bins.items()}
            for _ in range(args.reps):
                for label, _src in builds:
                    results[label].append(bench_once(ssh, bins[label], f"{SCRATCH}/{MODEL}", prompt=args.prompt,
                                                     gen=args.gen, threads=args.threads))
            cpu = on_rig(ssh, "grep -m1 'model name' /proc/cpuinfo").split(":", 1)[-1].strip()
            flags = on_rig(ssh, "grep -m1 '^flags' /proc/cpuinfo")
        finally:
            on_rig(ssh, f"rm -rf {SCRATCH}")

    def best(label: str) -> tuple[float, float]:
        return max(pp for pp, _ in results[label]), max(tg for _, tg in results[label])

    ref_label = builds[0][0]
    ref_pp, ref_tg = best(ref_label)
    isa = " ".join(f for f in ("avx2", "avx512f", "amx_tile") if f" {f} " in f" {flags} ")
    print(f"llama.cpp CPU builds on lab rig {args.host} ({cpu}; {isa}), SmolLM2-135M Q4_1, "
          f"pp{args.prompt}/tg{args.gen}, {args.threads} threads, best of {args.reps} interleaved rounds")
    print(f"  {'build':<10} {'name':<26} {'cmake':<16} {'pp t/s':>9} {'ratio':>7} {'tg t/s':>9} {'ratio':>7}")
    ok = True
    for label, _src in builds:
        pp, tg = best(label)
        native = "-DGGML_NATIVE=ON" if names[label].get("cmake", {}).get("GGML_NATIVE") == "ON" else "GGML_NATIVE=OFF"
        print(f"  {label:<10} {names[label]['name']:<26} {native:<16} {pp:9.1f} {pp / ref_pp:6.3f}x "
              f"{tg:9.1f} {tg / ref_tg:6.3f}x")
        ok = ok and pp / ref_pp >= AIM and tg / ref_tg >= AIM
    print(f"  aim: every build >= {AIM:.2f}x of {ref_label} on both: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
