"""A play dies with the rigctl process that started it.

ansible-runner starts ansible-playbook in a session of its own (a pseudo-terminal, SIGHUP ignored), and
mitogen puts its SSH connections in sessions of their own again: a rigctl killed with SIGKILL (an OOM kill,
a closed laptop lid) would leave all of them running, headless, against the hosts.

So every process of a play carries a mark in its environment (``RIGCTL_PLAY=<random>``, inherited by
ansible-playbook, its workers, mitogen's multiplexer and each ``ssh``), and a small watchdog
(``python -m rigctl.fleet.tether``, in a session of its own) holds the read end of a pipe whose write end only
rigctl holds. When rigctl is gone, for whatever reason, the pipe reads end-of-file and the watchdog stops
every process that carries the mark: SIGTERM, then SIGKILL after :data:`GRACE_S`. Their SSH connections
close with them, and on the hosts what hangs on a connection stops (:mod:`rigctl.hostside.play_lock`).

The watchdog also inherits the descriptors it is given (the controller's lock files,
:mod:`rigctl.fleet.deploy_lock`): they stay locked until the last process of the play is gone, so a second run
is refused until then. Standard library only; the watchdog imports nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

log = logging.getLogger(__name__)

#: The environment variable every process of a play carries.
MARK_VARIABLE = "RIGCTL_PLAY"
#: Seconds between SIGTERM and SIGKILL for what a dead controller left running.
GRACE_S = 3.0
#: How long rigctl waits for its watchdog to finish after a play that ended normally.
WATCHDOG_EXIT_S = 30.0


def marked_processes(mark: str, *, proc: str = "/proc") -> list[int]:
    """The pids whose environment holds ``RIGCTL_PLAY=<mark>`` (processes of other users, which cannot be
    read, are not a play's)."""
    needle = f"{MARK_VARIABLE}={mark}".encode()
    found = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"{proc}/{entry.name}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def stop_marked(mark: str, *, grace_s: float = GRACE_S, rounds: int = 5) -> int:
    """Stop every process carrying ``mark``: SIGTERM, then SIGKILL what is left after ``grace_s``; again for
    what forked meanwhile. The number of processes signalled."""
    signalled: set[int] = set()
    for _ in range(rounds):
        pids = marked_processes(mark)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM if pid not in signalled else signal.SIGKILL)
        signalled.update(pids)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and marked_processes(mark):
            time.sleep(0.1)
        for pid in marked_processes(mark):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return len(signalled)


class Tether:
    """The context a play runs in: :attr:`env` to give its processes, a watchdog holding ``keep_fds`` that
    stops them when this process dies. A normal exit from the block closes the pipe too; the watchdog then
    stops whatever the play left behind (usually nothing) and rigctl waits for it, so the locks it shares are
    free when the block is left."""

    def __init__(self, keep_fds: Sequence[int] = ()):
        self.mark = secrets.token_hex(12)
        self.keep_fds = tuple(keep_fds)
        self._write: int | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        return {MARK_VARIABLE: self.mark}

    def __enter__(self) -> Tether:
        read, self._write = os.pipe()  # both close-on-exec: no child but the watchdog ever holds the read end
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", "rigctl.fleet.tether", self.mark, str(os.getpid())],
                stdin=read, stdout=subprocess.DEVNULL, pass_fds=self.keep_fds, start_new_session=True,
                env={k: v for k, v in os.environ.items() if k != MARK_VARIABLE})
        finally:
            os.close(read)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._write is not None:
            os.close(self._write)
            self._write = None
        if self._watchdog is not None:
            try:
                self._watchdog.wait(timeout=WATCHDOG_EXIT_S)
            except subprocess.TimeoutExpired:
                log.warning("the play's watchdog (pid %d) is still stopping its processes", self._watchdog.pid)


@contextlib.contextmanager
def tethered(keep_fds: Iterable[int] = ()) -> Iterator[Tether]:
    with Tether(tuple(keep_fds)) as tether:
        yield tether


def watch(mark: str, owner: int) -> int:
    """The watchdog: wait for end-of-file on stdin, then stop the play's processes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rigctl, which decides
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    owner_alive = True
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        owner_alive = False
    except OSError:
        pass
    started = time.monotonic()
    stopped = stop_marked(mark)
    if stopped:
        with contextlib.suppress(OSError):
            print(f"rigctl: {'the controller process ' + str(owner) + ' is gone: ' if not owner_alive else ''}"
                  f"stopped {stopped} process(es) of its play in {time.monotonic() - started:.1f} s",
                  file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(watch(sys.argv[1], int(sys.argv[2])))
