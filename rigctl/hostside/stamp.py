"""The host's part of a run's provenance stamp (:mod:`rigctl.results.stamp`). Standard library only.

What a record says about a server is what runs, read from the host: the unit's main process
(``systemctl show -p MainPID --value UNIT``) and its ``/proc/<pid>/cmdline``, not flags derived again from
the inventory (which may have changed since the last deploy). The llama_server role's launcher execs the
binary, so a ``llama-server@`` unit's main process is llama-server itself, as it is for a probe that
``systemd-run`` started.

Two callers: :mod:`rigctl.hostside.jobrun` (jobs on the host, before the task runs) and the controller,
which runs it over SSH (:func:`rigctl.hostside.ship.python_command`, REQUEST_JSON the one argument)
and reads one JSON object back::

    request  {"units": [unit, ...], "manifests": [artifact path, ...]}
    answer   {"servers": [deployed(unit), ...], "llama_cpp_fact": text or null, "gpu_query": text or null,
              "manifests": {path: text}}
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from rigctl.hostside.llama_cpp_fact import FACT_PATH

GPU_FIELDS = "name,driver_version,memory.total,compute_cap"
MASK = "***"
#: Option names whose value is a secret (the key itself; a key *file* path is not).
SECRET_OPTIONS = ("--api-key", "--hf-token", "-hft")
SERVER_UNIT = "llama-server@{}.service"


def mask_secrets(argv: list[str]) -> list[str]:
    """``argv`` with the value of every secret option masked: it never leaves the host."""
    out: list[str] = []
    masking = False
    for arg in argv:
        name, eq, _ = arg.partition("=")
        if masking:
            out.append(MASK)
            masking = False
        elif name in SECRET_OPTIONS and eq:
            out.append(f"{name}={MASK}")
        else:
            out.append(arg)
            masking = arg in SECRET_OPTIONS
    return out


def parse_cmdline(data: bytes) -> list[str]:
    """``/proc/<pid>/cmdline``: NUL-separated arguments, with a trailing NUL."""
    return [arg.decode("utf-8", errors="replace") for arg in data.split(b"\0")[:-1]] if data else []


def deployed(unit: str) -> dict[str, Any]:
    """``unit``'s main process as it runs: pid, argv (secrets masked) and where the argv was read; a unit
    not running has pid 0, argv [] and ``error`` saying so."""
    entry: dict[str, Any] = {"unit": unit, "pid": 0, "argv": [], "argv_from": None}
    try:
        shown = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", unit], capture_output=True,
                               text=True, timeout=30, check=False)
        pid = int(shown.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        entry["error"] = f"systemctl show {unit}: {exc}"
        return entry
    if pid <= 0:
        entry["error"] = f"{unit} is not running"
        return entry
    path = f"/proc/{pid}/cmdline"
    try:
        with open(path, "rb") as handle:
            argv = parse_cmdline(handle.read())
    except OSError as exc:
        entry["error"] = f"{path}: {exc.strerror or exc}"
        return entry
    entry.update(pid=pid, argv=mask_secrets(argv), argv_from=path)
    return entry


def active_servers() -> list[str]:
    """Instance names of the llama-server units running now (enabled or started by hand)."""
    try:
        listing = subprocess.run(["systemctl", "list-units", SERVER_UNIT.format("*"), "--state=active", "--plain",
                                  "--no-legend"], capture_output=True, text=True, check=False, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    units = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return sorted(u.removeprefix("llama-server@").removesuffix(".service") for u in units)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError):
        return None


def gpu_query(fields: str = GPU_FIELDS) -> str | None:
    """``nvidia-smi --query-gpu=FIELDS`` (csv, no header, no units); None without nvidia-smi."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def parse_gpu_query(stdout: str) -> dict[str, Any]:
    """The answer of :func:`gpu_query` for ``GPU_FIELDS``: the first GPU's name, driver, VRAM and compute
    capability."""
    first = stdout.strip().splitlines()[0]
    name, driver, vram, compute = (cell.strip() for cell in first.split(","))
    return {"name": name, "driver": driver, "vram_mib": int(float(vram)), "compute_capability": compute}


def collect(request: dict[str, Any]) -> dict[str, Any]:
    manifests = {}
    for path in request.get("manifests") or []:
        text = _read(str(path) + ".manifest.json")
        if text is not None:
            manifests[str(path)] = text
    return {"servers": [deployed(str(unit)) for unit in request.get("units") or []],
            "llama_cpp_fact": _read(FACT_PATH), "gpu_query": gpu_query(), "manifests": manifests}


def main(argv: list[str]) -> int:
    print(json.dumps(collect(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
