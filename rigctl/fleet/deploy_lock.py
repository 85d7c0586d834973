"""One play per host at a time: the locks a second `rigctl provision` is refused by.

Two runs against the same host race each other (one restarts a server the other is waiting on, two
compiles share one build tree). Two locks keep them apart, both per host, whatever inventory file,
checkout or copy names it:

* **On the host** (the ``play_lock`` role, :mod:`rigctl.hostside.play_lock`): the play's first task takes
  ``/run/rigctl/play.lock`` and its last one frees it; it is held for as long as the controller's
  connection lasts, so it binds every controller and user. rigctl hands the play its record of itself
  (:func:`holder_env`) for the refusal to name.
* **On the controller** (here): before any connection, an flock(2) per host address under the cache
  directory, so that a second run from this controller is refused at once, naming the run that holds it.
  The kernel drops it when its holders die; the play's watchdog (:mod:`rigctl.fleet.tether`) holds it too, so it
  is free only once every process of the play is gone.

Both records have one shape and one description (:func:`rigctl.hostside.play_lock.describe`).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import re
import shlex
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from rigctl.errors import DeployBusyError, DeployError
from rigctl.files import cache_dir
from rigctl.hostside.play_lock import controller_holder

if TYPE_CHECKING:
    from rigctl.inventory import Host

#: The environment variable the play_lock role reads the holder's record from.
HOLDER_VARIABLE = "RIGCTL_PLAY_HOLDER"


def lock_dir() -> Path:
    return cache_dir() / "locks"


def host_key(host: Host) -> str:
    """What a host is, for its lock: its address and SSH port (the inventory name is a label)."""
    return f"{host.address}:{host.port}"


def lock_path(host: Host) -> Path:
    key = host_key(host)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return lock_dir() / f"host-{re.sub(r'[^A-Za-z0-9.-]', '_', host.address)[:64]}-{digest}.lock"


def this_command() -> str:
    """This process's command line as its user typed it: ``rigctl ...`` (installed script or ``python -m
    rigctl.cli``), else the program that called rigctl's library (a test runner, a script)."""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return shlex.join(["rigctl" if program == "__main__.py" else program, *sys.argv[1:]])


def holder_env(command: str | None = None) -> dict[str, str]:
    """The environment that gives the play_lock role this process's record as the holder."""
    record = json.dumps(controller_holder(command or this_command()))
    return {HOLDER_VARIABLE: base64.b64encode(record.encode()).decode()}


def _take(host: Host, record: dict[str, object]) -> IO[str]:
    path = lock_path(host)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")  # noqa: SIM115 (held by the caller)
    except OSError as exc:
        raise DeployError(f"lock {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        try:
            holder = json.loads(handle.read() or "{}")
        except ValueError:
            holder = {}
        handle.close()
        raise DeployBusyError(host.name, host_key(host), holder if isinstance(holder, dict) else {}) from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({**record, "host": host.name, "address": host_key(host)}))
    handle.flush()
    return handle


@contextlib.contextmanager
def hosts_lock(hosts: Iterable[Host], command: str | None = None) -> Iterator[list[int]]:
    """Hold every host's controller-side lock for the block (yields their descriptors, for the play's
    watchdog to hold too); DeployBusyError naming the first host taken and its holder, with none held."""
    record = controller_holder(command or this_command())
    handles: list[IO[str]] = []
    try:
        for host in sorted({host_key(h): h for h in hosts}.values(), key=host_key):
            handles.append(_take(host, record))
        yield [h.fileno() for h in handles]
    finally:
        for handle in handles:
            handle.close()  # releases the flock (unless the watchdog still holds it)
