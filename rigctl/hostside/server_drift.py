"""Whether a running llama-server instance runs what its files now say. Standard library only: the
llama_server role's ``llama_server_drift`` module imports it (as ``ansible.module_utils.server_drift``), and
rigctl runs it as a one-shot command (``main``) for ``rigctl servers``, the exporter and the fleet state.

A provision writes an instance's files (``NAME.args``, ``NAME.env``, the ``NAME.bin`` link) and then
restarts it. A play killed between the two leaves files that no process runs, and the next play writes
nothing new: judging by what *this* run changed, it would never restart it. So the running process is the
reference: the unit's main process is compared with the files.

* its arguments (``/proc/PID/cmdline`` after the program) with what the launcher makes of ``NAME.args``
  now (:func:`launcher_argv`, the launcher's own rules);
* its executable (``/proc/PID/exe``, resolved by the kernel; `` (deleted)`` when the build was replaced
  under it) with ``NAME.bin`` resolved now;
* the sha256 of ``NAME.env`` that the launcher put into the process's environment when it started it
  (:data:`ENV_HASH_VARIABLE`, read from ``/proc/PID/environ``) with the file's sha256 now: the environment
  itself mixes the unit's own ``Environment=`` lines with the file's, so only the launcher knows which
  file it started with. A process the launcher did not mark (started by an older launcher) differs.

An instance that does not run has nothing to differ: starting it reads the files as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

#: What the launcher exports before it execs the server: the sha256 of the environment file it started with.
ENV_HASH_VARIABLE = "RIGCTL_LLAMA_SERVER_ENV_SHA256"
SYSTEMCTL_TIMEOUT_S = 30.0
#: What a difference is called, in the order they are checked.
ARGUMENTS, BINARY, ENVIRONMENT = "arguments", "binary", "environment"


def launcher_argv(args_text: str) -> list[str]:
    """The arguments the launcher passes for this ``NAME.args`` text: one flag per line, its value after the
    first space verbatim; blank lines and lines starting with ``#`` skipped."""
    argv: list[str] = []
    for line in args_text.split("\n"):
        if line == "" or line.startswith("#"):
            continue
        flag, space, value = line.partition(" ")
        argv += [flag, value] if space else [flag]
    return argv


def file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        return None


def main_pid(unit: str) -> int:
    """The unit's main process id; 0 when it does not run (or systemd cannot say)."""
    try:
        done = subprocess.run(["systemctl", "show", "--property=MainPID", "--value", "--", unit],
                              capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    value = done.stdout.strip()
    return int(value) if done.returncode == 0 and value.isdigit() else 0


def process_view(pid: int) -> dict[str, Any] | None:
    """What process ``pid`` runs: its arguments after the program, its executable and the environment
    file's hash the launcher gave it; None when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            cmdline = handle.read()
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read()
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
    words = [w.decode("utf-8", errors="surrogateescape") for w in cmdline.split(b"\0")]
    if words and words[-1] == "":
        words.pop()
    env_hash = None
    prefix = f"{ENV_HASH_VARIABLE}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            env_hash = entry[len(prefix):].decode("ascii", errors="replace")
    return {"argv": words[1:], "exe": exe, "env_sha256": env_hash}


def differences(config_dir: str, name: str, running: dict[str, Any]) -> list[str]:
    """What of ``running`` (:func:`process_view`) differs from instance ``name``'s files in ``config_dir``."""
    base = os.path.join(config_dir, name)
    found = []
    try:
        with open(f"{base}.args", encoding="utf-8", errors="surrogateescape") as handle:
            wanted_argv: list[str] | None = launcher_argv(handle.read())
    except OSError:
        wanted_argv = None
    if running["argv"] != wanted_argv:
        found.append(ARGUMENTS)
    if running["exe"] != os.path.realpath(f"{base}.bin"):
        found.append(BINARY)
    if running["env_sha256"] is None or running["env_sha256"] != file_sha256(f"{base}.env"):
        found.append(ENVIRONMENT)
    return found


def pending_restarts(config_dir: str, names: list[str]) -> dict[str, list[str]]:
    """Each running instance of ``names`` whose process differs from its files, with what differs."""
    pending = {}
    for name in names:
        pid = main_pid(f"llama-server@{name}.service")
        running = process_view(pid) if pid else None
        found = differences(config_dir, name, running) if running else []
        if found:
            pending[name] = found
    return pending


def main(argv: list[str]) -> int:
    """``main([ARGS])``: ``ARGS`` is JSON with ``config_dir`` and ``names``; prints
    :func:`pending_restarts` as JSON."""
    args = json.loads(argv[0])
    print(json.dumps(pending_restarts(str(args["config_dir"]), [str(n) for n in args["names"]])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
