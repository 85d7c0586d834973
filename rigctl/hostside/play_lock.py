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

**The play lock.** ``/run/rigctl/play.lock``, an flock(2) held by a :data:`WHILE_CONNECTED` process
that the play's first task starts (:func:`acquire`) and its last one stops (:func:`release`). The kernel
drops the lock when that process ends, so a play whose controller died frees the host within a second of
its connection closing. Beside it, ``play.json`` names the holder: the controller (host name, user, the
rigctl process and its command), the SSH client's address and when it took the lock. A second play
(another checkout, another copy of the inventory, another user or machine) is refused naming that holder;
a ``play.json`` whose lock nobody holds is a stale one (its holder died), taken over and reported. A play
that ends, by success or failure, releases the lock leaving ``last.json`` with its outcome instead.

The directory is root's alone (made 0700; one another user made or opened up is refused), and every file
in it is opened from its descriptor without following links, written only as a new file and renamed into
place: a local user can neither point root's writes elsewhere nor hold the lock. :func:`release` signals
only the keeper :func:`acquire` started (pinned by a pidfd, then checked by start time and by holding the
lock file).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

#: Made by root, mode 0700: not /run/lock, where any local user may make ``rigctl/`` first.
LOCK_DIR = "/run/rigctl"
LOCK_FILE = "play.lock"
HOLDER_FILE = "play.json"
#: The record the last play left when it released the lock, with its outcome.
LAST_FILE = "last.json"
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
    """(command name, parent pid, start time in clock ticks) of ``pid``; None when it is gone (a zombie,
    which its parent has yet to reap, is gone: it holds nothing and takes no signal)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else (name, int(fields[1]), fields[19])


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


class LockDirRefused(OSError):
    """The lock directory is not one only this user can write (made by someone else, or opened up)."""


#: The most of a holder record read back: the module caps what the controller sends far below this.
_RECORD_MAX = 64 << 10


def _open_dir(lock_dir: str) -> int:
    """A descriptor of ``lock_dir``, made here (mode 0700) when absent. Refused unless it is a directory (not
    a link to one) owned by this user that nobody else may write: everything below is opened from this
    descriptor, so nothing another user made or swaps in can turn a write or a signal elsewhere."""
    parent = os.path.dirname(os.path.normpath(lock_dir)) or "."
    os.makedirs(parent, mode=0o755, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(lock_dir, 0o700)
    try:
        fd = os.open(lock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise LockDirRefused(exc.errno, f"{lock_dir}: not a directory of its own ({exc.strerror}); refused") from None
    found = os.fstat(fd)
    problem = ""
    if found.st_uid != os.geteuid():
        problem = f"owned by uid {found.st_uid}, not {os.geteuid()}"
    elif found.st_mode & 0o077:
        problem = f"mode {stat.S_IMODE(found.st_mode):04o} lets others in (0700 expected)"
    if problem:
        os.close(fd)
        raise LockDirRefused(errno.EPERM, f"{lock_dir}: {problem}; refused (remove it and run the play again)")
    return fd


def _read_holder(dir_fd: int, name: str = HOLDER_FILE) -> dict[str, Any]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        found = json.loads(os.read(fd, _RECORD_MAX).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return found if isinstance(found, dict) else {}


def _write_record(dir_fd: int, name: str, record: Mapping[str, Any]) -> None:
    """``record`` as ``name`` in the lock directory: written to a new file (never an existing one, never
    through a link) and renamed over ``name``."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(dict(record), handle, sort_keys=True)
            handle.write("\n")
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _open_lock(dir_fd: int) -> int:
    return os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)


def acquire(holder: Mapping[str, Any], *, lock_dir: str = LOCK_DIR, python: str = sys.executable,
            link: tuple[int, str] | None = None, wait_s: float = RELEASE_WAIT_S) -> dict[str, Any]:
    """Take this host's play lock for ``holder`` (what :func:`controller_holder` says, and whatever the
    caller adds), held by a :data:`WHILE_CONNECTED` process until :func:`release` or the end of the
    controller's connection. The record written, with ``stale``: the record of a holder that was gone
    without releasing it (None when the lock was free or released), and ``previous``: the record the last
    play left when it released the lock (its ``outcome``), None when there is none. :class:`LockBusy`
    naming the holder when another play holds it; :class:`LockDirRefused` when ``lock_dir`` is not this
    user's alone."""
    dir_fd = _open_dir(lock_dir)
    fd = -1
    try:
        fd = _open_lock(dir_fd)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # A holder whose connection just ended lets go within a second: wait that long, no longer.
                if time.monotonic() >= deadline:
                    raise LockBusy(_read_holder(dir_fd)) from None
                time.sleep(0.2)
        stale = _read_holder(dir_fd)
        previous = _read_holder(dir_fd, LAST_FILE)
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
        _write_record(dir_fd, HOLDER_FILE, record)
    finally:
        if fd >= 0:
            os.close(fd)  # the keeper's copy holds the lock now (or, refused, nobody's did)
        os.close(dir_fd)
    return {**record, "stale": stale or None, "previous": previous or None}


def _holds(pid: int, lock: os.stat_result) -> bool:
    """Whether ``pid`` has the lock file open (the keeper is the one process given it)."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in names:
        try:
            found = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (lock.st_dev, lock.st_ino):
            return True
    return False


def _stop_keeper(pid: int, start: str, lock: os.stat_result) -> None:
    """SIGTERM the keeper :func:`acquire` started, and only it: the pid is pinned with a pidfd first, then
    checked to be that process (its start time, and the lock file among its open files), so a pid the
    kernel has since given another process is never signalled."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return  # gone
    try:
        if not (alive(pid, start) and _holds(pid, lock)):
            return
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while alive(pid, start) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.close(pidfd)


def release(token: str, *, lock_dir: str = LOCK_DIR, outcome: str = "ok") -> bool:
    """Free the lock that :func:`acquire` took with ``token``: stop its keeper, and leave the holder's record
    as :data:`LAST_FILE` with ``outcome`` (``ok``, or ``failed`` for a play that ended by failure) and when
    it was released, so that the next play knows its predecessor let go rather than died. False when the
    lock is not (any more) that one's."""
    dir_fd = _open_dir(lock_dir)
    try:
        holder = _read_holder(dir_fd)
        if not token or holder.get("token") != token:
            return False
        _write_record(dir_fd, LAST_FILE, {**holder, "outcome": outcome,
                                          "released": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")})
        with contextlib.suppress(OSError):
            os.unlink(HOLDER_FILE, dir_fd=dir_fd)
        pid, start = holder.get("keeper_pid"), str(holder.get("keeper_start") or "")
        if isinstance(pid, int) and not isinstance(pid, bool) and pid > 1 and start:
            with contextlib.suppress(OSError):
                _stop_keeper(pid, start, os.stat(LOCK_FILE, dir_fd=dir_fd, follow_symlinks=False))
    finally:
        os.close(dir_fd)
    return True


def holder(lock_dir: str = LOCK_DIR) -> dict[str, Any] | None:
    """The record of the play holding this host's lock now; None when nobody holds it."""
    dir_fd = _open_dir(lock_dir)
    try:
        fd = _open_lock(dir_fd)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read_holder(dir_fd)
            return None
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
