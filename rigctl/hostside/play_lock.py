"""A play's hold on a host: one play at a time per host, and host-side work that ends with the controller's
connection. Standard library only: the ``play_lock`` and ``llama_cpp_compile`` modules import it as
``ansible.module_utils.play_lock``; rigctl imports it on the controller for the holder's record and message.

**The controller's connection.** What a play starts on a host outlives a controller that dies (SIGKILL,
a closed lid, a dropped link) unless something watches for it. :func:`connection` finds the process that
is the controller's SSH connection on this host (the nearest ``sshd`` ancestor of the caller); when the
controller goes, so does that process. :data:`WHILE_CONNECTED` is a small program (``python3 -c``) that
runs a command and stops it (its whole process group, and a transient unit's cgroup with it) within a
second of that connection ending; with no command it just waits for the connection to end, holding what
it inherited.

**The play lock.** ``/run/lock/rigctl/play.lock``, an flock(2) held by a :data:`WHILE_CONNECTED` process
that the play's first task starts (:func:`acquire`) and its last one stops (:func:`release`). The kernel
drops the lock when that process ends, so a play whose controller died frees the host within a second of
its connection closing, and a play that failed on a host frees it when the controller disconnects. Beside
it, ``play.json`` names the holder: the controller (host name, user, the rigctl process and its command),
the SSH client's address and when it took the lock. A second play (another checkout, another copy of the
inventory, another user or machine) is refused naming that holder; a ``play.json`` whose lock nobody holds
is a stale one, taken over and reported.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

LOCK_DIR = "/run/lock/rigctl"
LOCK_FILE = "play.lock"
HOLDER_FILE = "play.json"
#: How long :func:`acquire` waits for a holder whose connection has just ended to let go.
RELEASE_WAIT_S = 3.0
#: Exit status of :data:`WHILE_CONNECTED` when it stopped its command because the connection ended.
DISCONNECTED = 75

# argv: CONNECTION_PID CONNECTION_START [COMMAND...]. Polls the connection once a second; with a command,
# runs it in its own process group and ends that group (SIGTERM, SIGKILL 5 s later) when the connection
# ends or on SIGTERM. A start time that differs from the pid's now is a pid the kernel gave another process.
WHILE_CONNECTED = """\
import os, signal, subprocess, sys, time
pid, start, command = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
def connected():
    try:
        with open("/proc/%d/stat" % pid) as handle:
            return handle.read().rsplit(")", 1)[1].split()[19] == start
    except (OSError, IndexError):
        return False
child = subprocess.Popen(command, start_new_session=True) if command else None
def end(code):
    if child is not None and child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass
    sys.exit(code)
signal.signal(signal.SIGTERM, lambda *_: end(143))
while child is None or child.poll() is None:
    if not connected():
        if child is not None:
            sys.stderr.write("rigctl: the controller's connection (pid %d) ended: stopping %s\\n" % (pid, command[0]))
        end(75)
    time.sleep(1)
sys.exit(child.returncode)
"""


class LockBusy(Exception):
    """Another play holds the host: ``holder`` is its record."""

    def __init__(self, holder: Mapping[str, Any]):
        self.holder = dict(holder)
        super().__init__(f"refused: {describe(holder)} is running a play against this host; wait for it to finish")


def describe(holder: Mapping[str, Any]) -> str:
    """The holder of a lock in a few words: the controller process, its command and since when."""
    where = str(holder.get("controller") or "?")
    if holder.get("user"):
        where = f"{holder['user']}@{where}"
    if holder.get("ssh_client"):
        where += f" ({holder['ssh_client']})"
    pid = holder.get("pid")
    return (f"pid {pid if pid is not None else '?'} on {where} (`{holder.get('command') or '?'}`, "
            f"since {holder.get('started') or '?'})")


def controller_holder(command: str, *, pid: int | None = None) -> dict[str, Any]:
    """This process as a lock's holder: host name, user, pid, command, when."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return {"controller": socket.gethostname(), "user": user, "pid": os.getpid() if pid is None else pid,
            "command": command, "started": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


# ------------------------------------------------------------------------------------------- processes


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(command name, parent pid, start time in clock ticks) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    return name, int(fields[1]), fields[19]


def alive(pid: int, start: str) -> bool:
    found = _stat(pid)
    return found is not None and found[2] == start


def connection(pid: int | None = None) -> tuple[int, str]:
    """(pid, start time) of the process that is the controller's connection for ``pid`` (default: this
    process): its nearest ``sshd`` ancestor (OpenSSH's per-connection process), else, for a play on the
    controller itself, the nearest ``ansible-playbook``; else its parent."""
    pid = os.getpid() if pid is None else pid
    chain = []
    current = pid
    while current > 1:
        found = _stat(current)
        if found is None:
            break
        chain.append((current, found))
        current = found[1]
    for candidate, (name, _, start) in chain[1:]:
        if name.startswith("sshd"):
            return candidate, start
    for candidate, (_, _, start) in chain[1:]:
        try:
            with open(f"/proc/{candidate}/cmdline", "rb") as handle:
                if b"ansible-playbook" in handle.read():
                    return candidate, start
        except OSError:
            continue
    if len(chain) > 1:
        return chain[1][0], chain[1][1][2]
    raise OSError(f"no parent process found for pid {pid}")


def while_connected(python: str, command: Sequence[str], link: tuple[int, str] | None = None) -> list[str]:
    """The argv that runs ``command`` until the controller's connection (:func:`connection` unless
    ``link``) ends."""
    pid, start = link or connection()
    return [python, "-c", WHILE_CONNECTED, str(pid), start, *command]


# ------------------------------------------------------------------------------------------- the lock


def _read_holder(lock_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(lock_dir, HOLDER_FILE), encoding="utf-8") as handle:
            found = json.load(handle)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write_holder(lock_dir: str, holder: Mapping[str, Any]) -> None:
    path = os.path.join(lock_dir, HOLDER_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(dict(holder), handle, sort_keys=True)
        handle.write("\n")
    os.replace(tmp, path)


def acquire(holder: Mapping[str, Any], *, lock_dir: str = LOCK_DIR, python: str = sys.executable,
            link: tuple[int, str] | None = None, wait_s: float = RELEASE_WAIT_S) -> dict[str, Any]:
    """Take this host's play lock for ``holder`` (what :func:`controller_holder` says, and whatever the
    caller adds), held by a :data:`WHILE_CONNECTED` process until :func:`release` or the end of the
    controller's connection. The record written, with ``stale``: the record of a holder that was gone
    (None when the lock was free). :class:`LockBusy` naming the holder when another play holds it."""
    os.makedirs(lock_dir, mode=0o755, exist_ok=True)
    fd = os.open(os.path.join(lock_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # A holder whose connection just ended lets go within a second: wait that long, no longer.
                if time.monotonic() >= deadline:
                    raise LockBusy(_read_holder(lock_dir)) from None
                time.sleep(0.2)
        previous = _read_holder(lock_dir)
        pid, start = link or connection()
        token = secrets.token_hex(8)
        keeper = subprocess.Popen([python, "-c", WHILE_CONNECTED, str(pid), start], pass_fds=(fd,),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True, close_fds=True)
        keeper_stat = None
        for _ in range(50):  # its start time, for release to know it is still this process
            keeper_stat = _stat(keeper.pid)
            if keeper_stat is not None:
                break
            time.sleep(0.01)
        record = {**holder, "token": token, "keeper_pid": keeper.pid,
                  "keeper_start": keeper_stat[2] if keeper_stat else "", "connection_pid": pid,
                  "ssh_client": (os.environ.get("SSH_CLIENT") or "").split(" ")[0] or holder.get("ssh_client"),
                  "taken": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
        _write_holder(lock_dir, record)
    finally:
        os.close(fd)  # the keeper's copy holds the lock now (or, refused, nobody's did)
    return {**record, "stale": previous or None}


def release(token: str, *, lock_dir: str = LOCK_DIR) -> bool:
    """Free the lock that :func:`acquire` took with ``token``: stop its keeper, remove the record. False when
    the lock is not (any more) that one's."""
    holder = _read_holder(lock_dir)
    if not token or holder.get("token") != token:
        return False
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(lock_dir, HOLDER_FILE))
    pid, start = holder.get("keeper_pid"), str(holder.get("keeper_start") or "")
    if isinstance(pid, int) and start and alive(pid, start):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while alive(pid, start) and time.monotonic() < deadline:
            time.sleep(0.05)
    return True


def holder(lock_dir: str = LOCK_DIR) -> dict[str, Any] | None:
    """The record of the play holding this host's lock now; None when nobody holds it."""
    os.makedirs(lock_dir, mode=0o755, exist_ok=True)
    fd = os.open(os.path.join(lock_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(lock_dir)
        return None
    finally:
        os.close(fd)
