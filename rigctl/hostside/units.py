"""Starting and stopping llama-server units around a run: the one rule and the one set of timeouts, for both
sides. Standard library only.

* An operator's start or restart clears the unit's failure counter first: systemd's StartLimitBurst counts
  every start, so benches and restarts in quick succession would trip it like a crash loop; the limit is
  left to crash loops. A ``reset-failed`` that fails (a unit never loaded) does not stop the start.
* ``systemctl`` is given :data:`SYSTEMCTL_TIMEOUT_S` to start or stop a unit; a server is then waited for
  :data:`HEALTH_TIMEOUT_S` until ``/health`` answers 200 (a model loading from a slow disk), polled every
  :data:`POLL_S`.

The job runtime runs these commands itself, as root, around a bench that takes the card from the host's
servers (:func:`rigctl.hostside.jobrun.prepare` and ``finish``, :func:`run`); the controller sends the same
commands over SSH (:func:`shell`) from its server lifecycle, :mod:`rigctl.fleet.servers`.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence

SYSTEMCTL_TIMEOUT_S = 300.0
HEALTH_TIMEOUT_S = 600.0
POLL_S = 1.0
#: The actions that start a unit (and so clear its failure counter first).
STARTS = ("start", "restart")


def commands(action: str, units: Sequence[str]) -> list[list[str]]:
    """The ``systemctl`` command lines of ``action`` on ``units``, in order."""
    before = [["systemctl", "reset-failed", *units]] if action in STARTS else []
    return [*before, ["systemctl", action, *units]]


def shell(action: str, units: Sequence[str]) -> str:
    """:func:`commands` as one shell command line, whose exit status is the action's."""
    return "; ".join(shlex.join(argv) for argv in commands(action, units))


def run(action: str, units: Sequence[str]) -> str | None:
    """:func:`commands` on this host; None when the action worked, else its one-line complaint."""
    problem = None
    for argv in commands(action, units):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            problem = str(exc)
            continue
        problem = None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")
    return problem
