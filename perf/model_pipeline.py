#!/usr/bin/env python3
"""Convert and quantize time and peak memory for the SmolLM2 Hugging Face checkout on one lab rig,
and the no-op rerun of the models role as a ratio of the first run.

The first run is a real `provision --tags models` from an empty models directory (for this bench's
artifacts only); times come from the manifests the role writes. Peak memory is measured by running
each manifest's exact command once more on the rig, writing to a scratch file, under getrusage.

    .venv/bin/python perf/model_pipeline.py [--host desktop]
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures"))

from make_hf_checkout import make_checkout  # noqa: E402

from rigctl.fleet.deploy import run_playbook  # noqa: E402
from rigctl.fleet.models import parse_manifest  # noqa: E402
from rigctl.inventory import Inventory  # noqa: E402
from rigctl.lab.rigs import Lab  # noqa: E402
from rigctl.ssh import SshClient, SshTarget  # noqa: E402

ARTIFACTS = ("bench-bf16", "bench-q4_0")

# Runs a command and prints its children's peak resident memory (KiB): GNU time is not on the rigs.
PEAK_RSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def bench_inventory(dest: Path, checkout: Path) -> Path:
    shutil.copytree(REPO / "inventory" / "lab", dest)
    (dest / "group_vars" / "all" / "models_bench.yml").write_text(yaml.safe_dump({"models_catalog": {
        "smollm2-bench": {"source": {"type": "controller", "path": str(checkout)},
                          "artifacts": {"bench-bf16": {"type": "convert", "outtype": "bf16"},
                                        "bench-q4_0": {"type": "quantize", "from": "bench-bf16", "qtype": "Q4_0"}}},
    }}))
    return dest


def timed_provision(inventory: Inventory, host: str) -> tuple[float, int]:
    started = time.monotonic()
    result = run_playbook(inventory, limit=host, tags=["models"], timeout=1800)
    wall = time.monotonic() - started
    result.raise_for_failures()
    return wall, sum(h.changed for h in result.hosts.values())


def peak_rss_mib(ssh: SshClient, command: str, artifact_path: str) -> float:
    scratch = f"/tmp/rigctl-bench-{Path(artifact_path).name}"
    argv = shlex.split(command.replace(artifact_path, scratch))
    try:
        out = ssh.run(shlex.join(["python3", "-c", PEAK_RSS, *argv]), timeout=1800)
    finally:
        ssh.run(f"rm -f {shlex.quote(scratch)}", timeout=30, check=False)
    return int(out.stdout.split()[-1]) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="desktop")
    args = parser.parse_args()

    checkout = make_checkout()
    with tempfile.TemporaryDirectory(prefix="rigctl-bench-") as tmp:
        inventory = Inventory.load(bench_inventory(Path(tmp) / "inventory", checkout))
        host = inventory.host(args.host)
        with Lab.from_inventory(inventory).up_while():
            models_dir = host.vars.get("models_dir", "/var/lib/rigctl/models")
            with SshClient(SshTarget.from_host(host)) as ssh:
                paths = " ".join(f"{models_dir}/{a}.gguf {models_dir}/{a}.gguf.manifest.json" for a in ARTIFACTS)
                ssh.run(f"rm -f {paths}", timeout=30)
                first, first_changed = timed_provision(inventory, host.name)
                noop, noop_changed = timed_provision(inventory, host.name)
                manifests = {a: parse_manifest(ssh.run(f"cat {models_dir}/{a}.gguf.manifest.json", timeout=30).stdout,
                                               host.name) for a in ARTIFACTS}
                peaks = {a: peak_rss_mib(ssh, m.command, m.path) for a, m in manifests.items()}

    print(f"SmolLM2-135M checkout on {host.name} (llama.cpp {manifests['bench-q4_0'].llama_cpp['name']}):")
    for artifact, label in zip(ARTIFACTS, ("convert_hf_to_gguf --outtype bf16", "llama-quantize Q4_0"), strict=True):
        m = manifests[artifact]
        print(f"  {label:36s} {m.wall_s:7.2f} s  peak {peaks[artifact]:7.0f} MiB  -> {m.bytes / 1e6:.1f} MB")
    print(f"  first models run (changed={first_changed})   {first:7.2f} s")
    print(f"  no-op rerun (changed={noop_changed})          {noop:7.2f} s  = {noop / first:.2f}x of the first run")
    print(json.dumps({"convert_s": manifests["bench-bf16"].wall_s, "quantize_s": manifests["bench-q4_0"].wall_s,
                      "convert_peak_mib": round(peaks["bench-bf16"]), "quantize_peak_mib": round(peaks["bench-q4_0"]),
                      "first_s": round(first, 2), "noop_s": round(noop, 2), "noop_ratio": round(noop / first, 3)}))
    return 0 if noop_changed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
