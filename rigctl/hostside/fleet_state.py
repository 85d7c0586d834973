"""One host's state as :class:`rigctl.fleet.state.FleetState` reads it: every raw output it
parses, as one JSON object, in one round trip. Standard library only; run as a one-shot command. It changes
nothing on the host.

``main([ARGS])``: ``ARGS`` is JSON with ``fact`` (the llama_cpp role's fact file), ``gpu_fields`` and
``timeout`` (for ``nvidia-smi``), ``health_fields`` (the GPU health query's fields, newest driver's first:
the first a driver answers is kept), ``unit_pattern``, ``unit_properties`` and ``units`` (for ``systemctl``),
``models`` (artifact -> path) and ``servers`` (configuration directory -> instance names). Prints ``fact``
(its text or null), ``nvidia_smi``, ``health`` (with ``fields``: those it answered), ``kernel_xids`` (the kernel
log's ``NVRM: Xid`` lines since boot) and ``units`` ({rc, out, err} of those commands), ``models`` (artifact ->
path, :func:`model_files.identity` or null, manifest text or null) and ``pending_restarts`` (the running
instances whose process differs from their files: :func:`server_drift.pending_restarts`) and ``config_files``
(the {rc, out, err} of :func:`sandbox.config_files_command`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from rigctl.hostside import model_files, sandbox, server_drift


def run(argv: list[str], timeout: float) -> dict[str, Any]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return {"rc": 127, "out": "", "err": f"{argv[0]}: not found"}
    except subprocess.TimeoutExpired:
        return {"rc": 124, "out": "", "err": f"{argv[0]}: timed out"}
    return {"rc": done.returncode, "out": done.stdout, "err": done.stderr[-2000:]}


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def listed_units(listing: str, known: list[str]) -> list[str]:
    """``known`` and the services ``systemctl list-units --plain --no-legend`` lists besides."""
    units = list(known)
    for line in listing.splitlines():
        name = line.split(None, 1)[0] if line.strip() else ""
        if name.endswith(".service") and name not in units:
            units.append(name)
    return units


#: Where the kernel log is read: dmesg, else (a kernel that keeps it from users, ``dmesg_restrict``) the
#: journal's copy, which the adm and systemd-journal groups may read.
KERNEL_LOG_COMMANDS = (["dmesg"], ["journalctl", "--dmesg", "--boot", "--no-pager", "--quiet"])
XID_MARK = "NVRM: Xid"
#: The most Xid lines sent back: a GPU that reports one per second still counts, its log does not flood the reply.
MAX_XID_LINES = 2000


def kernel_xids(timeout: float) -> dict[str, Any]:
    """The kernel log's Xid lines since boot: {rc, out (those lines), err}; rc is the last source's when none
    could be read."""
    answer: dict[str, Any] = {"rc": 127, "out": "", "err": "no kernel log"}
    for argv in KERNEL_LOG_COMMANDS:
        answer = run(argv, timeout)
        if answer["rc"] == 0:
            lines = [line for line in answer["out"].splitlines() if XID_MARK in line]
            return {"rc": 0, "out": "\n".join(lines[-MAX_XID_LINES:]), "err": "",
                    "truncated": len(lines) > MAX_XID_LINES}
    return {**answer, "out": ""}


def read_state(args: dict[str, Any]) -> dict[str, Any]:
    timeout = float(args["timeout"])
    out: dict[str, Any] = {"fact": read_text(args["fact"])}
    out["nvidia_smi"] = run(["nvidia-smi", "--query-gpu=" + args["gpu_fields"], "--format=csv,noheader,nounits"],
                            timeout)
    for fields in args.get("health_fields") or []:
        health = run(["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"], timeout)
        out["health"] = {**health, "fields": fields}
        if health["rc"] == 0:
            break
    if args.get("health_fields"):
        out["kernel_xids"] = kernel_xids(timeout)
    listed = run(["systemctl", "list-units", "--all", "--plain", "--no-legend", "--no-pager", args["unit_pattern"]],
                 timeout)
    units = listed_units(listed["out"], list(args["units"]))
    out["units"] = run(["systemctl", "show", "--no-pager", "--property=" + args["unit_properties"], "--", *units],
                       timeout) if units else {"rc": 0, "out": "", "err": ""}
    out["config_files"] = run(sandbox.config_files_command(), timeout)
    models = out["models"] = {}
    for name, path in args["models"].items():
        try:
            stat: list[int] | None = model_files.identity(path)
        except OSError:
            stat = None
        models[name] = {"path": path, "stat": stat, "manifest": model_files.read_manifest(path)}
    pending = out["pending_restarts"] = {}
    for config_dir, names in (args.get("servers") or {}).items():
        pending.update(server_drift.pending_restarts(config_dir, list(names)))
    return out


def main(argv: list[str]) -> int:
    print(json.dumps(read_state(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
