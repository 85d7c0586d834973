"""Loading the inventory in a forked child while the command gets on with its own start-up.

Importing Ansible and loading an inventory through it takes most of a second, about as long as a fleet
command's own imports (SSH, the job runtime, the records). Both are CPU work in one interpreter, so a
thread would not overlap them; a forked child does, on a controller with a second core. The child
sends the loaded :class:`~rigctl.inventory.model.Inventory` back pickled over a pipe (memory only:
a decrypted vault value never touches a disk) with the log records it made, which this process then
handles as its own. Whenever the child cannot give an inventory (a bad inventory, a failure of any
kind, no fork on this platform, threads already running), this process loads it itself, so an error
reads exactly as a plain :meth:`Inventory.load`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rigctl.inventory.model import Inventory

log = logging.getLogger(__name__)


class _Collect(logging.Handler):
    """The child's log records, made picklable (message formatted, arguments and tracebacks as text)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = record.getMessage(), None
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        self.records.append(record)


class InventoryPreload:
    """``Inventory.load(source)`` started now in a child; :meth:`result` waits for it."""

    def __init__(self, source: str | None):
        self.source = source
        self._pid: int | None = None
        self._pipe: int | None = None
        self._started = time.monotonic()
        # Forking a process with threads may copy a lock some thread holds: load in-process instead.
        if not hasattr(os, "fork") or threading.active_count() > 1:
            return
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: load, send, and leave without running the parent's exit handlers
            os.close(read)
            os._exit(_load_and_send(source, write))
        os.close(write)
        self._pid, self._pipe = pid, read

    def result(self) -> Inventory:
        """The inventory: the child's when it loaded one, else loaded here (raising what loading raises)."""
        from rigctl.inventory.model import Inventory

        pid, waited = self._pid, time.monotonic()
        loaded = self._take()
        if loaded is None:
            return Inventory.load(self.source)
        inventory, records = loaded
        for record in records:
            logging.getLogger(record.name).handle(record)
        log.debug("inventory %s: loaded by child %s in %.2f s, %.2f s of it beside this process's own start-up",
                  inventory.source, pid, time.monotonic() - self._started, waited - self._started)
        return inventory

    def close(self) -> None:
        """Stop a child that is still loading (the command ended first) and reap it."""
        if self._pid is not None:
            log.debug("inventory preload: not needed; stopping child %s", self._pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
            self._take()

    def _take(self) -> tuple[Inventory, list[logging.LogRecord]] | None:
        if self._pid is None or self._pipe is None:
            return None
        pid, pipe = self._pid, self._pipe
        self._pid = self._pipe = None
        with os.fdopen(pipe, "rb") as answer:
            data = answer.read()
        _, status = os.waitpid(pid, 0)
        if status != 0 or not data:
            log.debug("inventory preload: the child ended with status %d; loading here", status)
            return None
        try:
            inventory, records = pickle.loads(data)  # noqa: S301 (our own child, over our own pipe)
        except Exception as exc:  # a child that died mid-write: load here
            log.debug("inventory preload: unreadable answer (%s); loading here", exc)
            return None
        return inventory, records


def _load_and_send(source: str | None, pipe: int) -> int:
    """In the child: load the inventory and write it with its log records to ``pipe``; the exit status."""
    try:
        from rigctl.inventory.model import Inventory

        collect = _Collect()
        root = logging.getLogger()
        root.handlers = [collect]  # the parent's handlers would print now, out of order
        inventory = Inventory.load(source)
        data = pickle.dumps((inventory, collect.records))
        with os.fdopen(pipe, "wb") as out:
            out.write(data)
        return 0
    except BaseException:  # anything at all: the parent loads it itself and reports it properly
        return 1
