"""A run's provenance stamp, completed on the host: the one builder of :class:`Provenance`. Standard library only.

The controller states what the inventory says of a run (host, the inventory's GPU, the servers' names,
units and ports, the artifacts' paths, task, matrix, seed, concurrency, rigctl's version) as a partial
:class:`Provenance`; :func:`complete` fills in what the host says:

* each server's argv *as deployed*: the unit's main process (``systemctl show -p MainPID --value UNIT``) and
  its ``/proc/<pid>/cmdline``, not flags derived again from the inventory (which may have changed since the
  last deploy); the llama_server role's launcher execs the binary, so a ``llama-server@`` unit's main process
  is llama-server itself, as it is for a probe that ``systemd-run`` started. Secret option values are masked
  before they leave the host. Beside it what else configured it: the config files it said it applied (the
  "using config file" lines of its journal) and the names of the variables llama.cpp reads in its
  ``/proc/<pid>/environ`` (values masked);
* the GPU from ``nvidia-smi`` (the inventory's bandwidth figure kept; without an answer, the inventory's
  GPU stays, its driver absent);
* the llama.cpp build ``current`` points to, from the llama_cpp role's fact;
* each artifact's sha256, size and manifest from the manifest beside it (a job hashes the file instead).

Two callers: :mod:`rigctl.hostside.jobrun` (jobs on the host, in process, before the task runs) and the
controller (:func:`rigctl.results.stamp.collect_stamp`), which runs this module over SSH
(:func:`rigctl.hostside.ship.python_command`, REQUEST_JSON the one argument) and reads one JSON object back::

    request  {"stamp": partial Provenance (dataclasses.asdict), "running_servers": bool}
    answer   {"stamp": the completed Provenance, "notes": [what could not be read, one line each]}
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from rigctl.hostside import llama_cpp_fact, model_files, nvidia_smi, sandbox
from rigctl.hostside.masking import MASK, mask_argv
from rigctl.hostside.runrecord import Artifact, Gpu, LlamaCppBuild, Provenance, Server, from_plain

GPU_FIELDS = "name,driver_version,memory.total,compute_cap"
SERVER_UNIT = "llama-server@{}.service"
SYSTEMCTL_TIMEOUT_S = 30

#: How a job hashes a model file: ``(path) -> (sha256, where it came from)``.
Hasher = Callable[[str], tuple[str, str]]


def parse_cmdline(data: bytes) -> list[str]:
    """``/proc/<pid>/cmdline``: NUL-separated arguments, with a trailing NUL."""
    return [arg.decode("utf-8", errors="replace") for arg in data.split(b"\0")[:-1]] if data else []


#: The first lines of a server's journal that can hold its "using config file" lines (argument parsing comes
#: first; a busy server's journal is long).
JOURNAL_HEAD_LINES = 200


def parse_environ(data: bytes) -> list[str]:
    """``/proc/<pid>/environ``: the variables llama.cpp reads as options, as ``NAME=***`` (the value never
    leaves the host)."""
    names = (entry.split(b"=", 1)[0].decode("utf-8", errors="replace") for entry in data.split(b"\0") if entry)
    return sorted({f"{name}={MASK}" for name in names if sandbox.foreign_variable(name)})


def used_config_files(pid: int) -> tuple[list[str], str | None]:
    """The config files process ``pid`` said it applied (its journal's first lines); why they could not be
    read, if not."""
    try:
        with subprocess.Popen(["journalctl", "--no-pager", "-o", "cat", f"_PID={pid}"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, errors="replace") as proc:
            assert proc.stdout is not None
            head = [line for _, line in zip(range(JOURNAL_HEAD_LINES), proc.stdout, strict=False)]
            proc.kill()
    except OSError as exc:
        return [], f"journalctl: {exc}"
    return sandbox.parse_used_config_files("".join(head)), None


def deployed(unit: str) -> dict[str, Any]:
    """``unit``'s main process as it runs: pid, argv (secrets masked) and where the argv was read; a unit
    not running has pid 0, argv [] and ``error`` saying so."""
    entry: dict[str, Any] = {"unit": unit, "pid": 0, "argv": [], "argv_from": None}
    try:
        shown = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", unit], capture_output=True,
                               text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=False)
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
    entry.update(pid=pid, argv=mask_argv(argv), argv_from=path)
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            entry["environment"] = parse_environ(handle.read())
    except OSError as exc:
        entry["environment_error"] = f"/proc/{pid}/environ: {exc.strerror or exc}"
    entry["config_files"], entry["config_files_error"] = used_config_files(pid)
    return entry


def deployed_server(server: Server) -> str | None:
    """Fill ``server``'s argv, its source and pid from its unit's main process, unless it has an argv already
    (stamped before a job stopped it); None, or why it could not be read."""
    server.unit = server.unit or SERVER_UNIT.format(server.name)
    if server.argv:
        return None
    found = deployed(server.unit)
    if not found["argv"]:
        return f"no deployed argv for {server.unit}: {found.get('error')}"
    server.argv, server.argv_from, server.pid = found["argv"], found["argv_from"], found["pid"]
    server.environment, server.config_files = found.get("environment", []), found["config_files"]
    errors = [found[key] for key in ("environment_error", "config_files_error") if found.get(key)]
    return f"{server.unit}: {'; '.join(errors)}" if errors else None


def active_servers() -> list[str]:
    """Instance names of the llama-server units running now (enabled or started by hand)."""
    try:
        listing = subprocess.run(["systemctl", "list-units", SERVER_UNIT.format("*"), "--state=active", "--plain",
                                  "--no-legend"], capture_output=True, text=True, check=False,
                                 timeout=SYSTEMCTL_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    units = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return sorted(u.removeprefix("llama-server@").removesuffix(".service") for u in units)


def gpu_query(fields: str = GPU_FIELDS, selection: list[str] | None = None) -> str | None:
    """``nvidia-smi --query-gpu=FIELDS`` (csv, no header, no units) of the GPUs ``selection`` names
    (``["-i", "0,1"]``; none: every GPU); None without nvidia-smi."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                               *(selection or [])],
                              capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def parse_gpu_query(stdout: str) -> dict[str, Any]:
    """The answer of :func:`gpu_query` for ``GPU_FIELDS``: the first GPU's name, driver, VRAM (None where
    the driver reports none: a unified-memory GPU's is ``[N/A]``) and compute capability."""
    rows = nvidia_smi.query_rows(stdout, GPU_FIELDS.split(","))
    if not rows:
        raise ValueError("no GPU line")
    first = rows[0]
    return {"name": nvidia_smi.cell(first["name"]), "driver": nvidia_smi.cell(first["driver_version"]),
            "vram_mib": nvidia_smi.whole(first["memory.total"]),
            "compute_capability": nvidia_smi.cell(first["compute_cap"])}


def read_gpu(inventory: Gpu) -> tuple[Gpu, str | None]:
    """The GPU as ``nvidia-smi`` reports it, with the inventory's bandwidth figure; the inventory's GPU when
    nvidia-smi does not answer."""
    answer = gpu_query()
    if not (answer and answer.strip()):
        return inventory, None
    try:
        return Gpu(**parse_gpu_query(answer), bandwidth_gbs=inventory.bandwidth_gbs), None
    except ValueError as exc:
        return inventory, f"nvidia-smi answer not read: {exc}"


def read_build() -> tuple[LlamaCppBuild, str | None]:
    """The build ``current`` points to, from the llama_cpp role's fact (empty without one)."""
    try:
        with open(llama_cpp_fact.FACT_PATH, encoding="utf-8") as handle:
            current = llama_cpp_fact.parse_builds(handle.read())["current"]
    except (OSError, UnicodeDecodeError, ValueError, configparser.Error) as exc:
        return LlamaCppBuild(), f"llama.cpp fact not read: {exc}"
    return (LlamaCppBuild(**llama_cpp_fact.record_fields(current)) if current else LlamaCppBuild()), None


def artifact(name: str, path: str | None, hasher: Hasher | None = None) -> tuple[Artifact, str | None]:
    """Model file ``name`` at ``path``: its manifest (the models role's, beside it), and its sha256 and size
    from there, or hashed now by ``hasher`` (a job's: it records what it ran on)."""
    entry = Artifact(name=name, path=path)
    if not path:
        return entry, None
    note = None
    text = model_files.read_manifest(path)
    try:
        manifest = json.loads(text) if text is not None else None
    except ValueError:
        manifest, note = None, f"manifest of {name} beside {path} is not JSON"
    if isinstance(manifest, dict):
        entry.manifest = manifest
        digest, size = manifest.get("sha256"), manifest.get("bytes")
        if isinstance(digest, str) and isinstance(size, int) and not isinstance(size, bool):
            entry.sha256, entry.sha256_from, entry.bytes = digest, "manifest", size
        else:
            note = f"manifest of {name} beside {path} names no sha256 and size"
    elif text is not None and note is None:
        note = f"manifest of {name} beside {path} is not a JSON object"
    elif text is None and hasher is None:
        note = f"no manifest beside {path} ({name})"
    if hasher is not None:
        entry.sha256, entry.sha256_from = hasher(path)
        entry.bytes = os.path.getsize(path)
    return entry, note


def complete(stamp: Provenance, *, running_servers: bool = False) -> tuple[Provenance, list[str]]:
    """``stamp`` (what the controller knows from the inventory) completed with what this host says; the
    notes say what could not be read (the stamp then keeps the inventory's word, or leaves it out).
    ``running_servers``: stamp every llama-server running now (what a bench found), not ``stamp``'s."""
    notes: list[str] = []
    if running_servers:
        stamp.servers = [Server(name=name, host=stamp.host) for name in active_servers()]
    for server in stamp.servers:
        notes.append(deployed_server(server) or "")
    stamp.gpu, gpu_note = read_gpu(stamp.gpu)
    stamp.llama_cpp, build_note = read_build()
    notes += [gpu_note or "", build_note or ""]
    artifacts = []
    for known in stamp.artifacts:
        found, note = artifact(known.name, known.path)
        found.gguf = known.gguf
        artifacts.append(found)
        notes.append(note or "")
    stamp.artifacts = artifacts
    return stamp, [note for note in notes if note]


def main(argv: list[str]) -> int:
    request = json.loads(argv[0])
    stamp, notes = complete(from_plain(Provenance, request["stamp"]),
                            running_servers=bool(request.get("running_servers")))
    print(json.dumps({"stamp": dataclasses.asdict(stamp), "notes": notes}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
