"""One run's lifecycle on the controller: its directory made at once, its record sealed however it ends.

Every run the controller drives (eval, spec, server-speed, load, and any kind to come) goes through
:func:`open_run`::

    stamp = inventory_stamp(host, [inventory_server(host, name)], artifacts=[...])   # the inventory's word
    with open_run("load", stamp, store, extra={...}) as run:      # <store>/<host>/<id>/run.json: running
        ...                                                       # servers started, probes up
        run.complete_stamp(ssh)                                   # the host's word: argv as deployed, GPU...
        run.write_jsonl(REQUESTS_FILE, rows)                      # raw files as they are ready
        run.record.extra["summary"] = ...
    # sealed with every raw file's sha256: done; failed with the error in extra["error"] (the exception goes
    # on to the caller); stopped on Ctrl-C

So a run that fails (a server that will not start, a port nobody answers, a flag the build refuses)
leaves its record, sealed ``failed`` with the reason, beside whatever raw files it wrote. Jobs on the hosts
seal their records the same way (:class:`rigctl.hostside.runrecord.RunRecord.seal`, from
:mod:`rigctl.hostside.jobrun`); an eval run that stopped part-way is resumed with :meth:`Run.reopen`.

**A new run kind**: add its name to :data:`rigctl.hostside.runrecord.RUN_KINDS` (the record, run ids and the
pull's checks follow), then open its runs with :func:`open_run`; what it measures goes into raw files and
``extra``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rigctl.errors import one_line
from rigctl.results.record import Provenance, RunKind, RunRecord, RunStatus, utc_now
from rigctl.results.store import ResultsStore, StoredRun

if TYPE_CHECKING:
    from rigctl.ssh import SshClient

log = logging.getLogger(__name__)

#: What a run interrupted by the user is sealed with.
INTERRUPTED = "interrupted (Ctrl-C)"


@dataclass
class Run:
    """A run in progress: its record and its directory in the results store."""

    record: RunRecord
    path: Path

    @property
    def ref(self) -> str:
        """``host/run id``, as commands take it."""
        return f"{self.record.host}/{self.record.id}"

    @classmethod
    def create(cls, kind: RunKind, stamp: Provenance, store: ResultsStore, **outcome: Any) -> Run:
        """A new run of ``kind``: its directory under ``store`` and its record (status running) saved there."""
        record = RunRecord.begin(kind, stamp, **{"host": stamp.host, **outcome})
        path = store.run_dir(record.host, record.id)
        path.mkdir(parents=True, exist_ok=False)
        record.save(path)
        return cls(record, path)

    @classmethod
    def reopen(cls, stored: StoredRun) -> Run:
        """A stopped run running again (an eval resumed): its record back to ``running``, when noted."""
        record = stored.record
        record.status, record.ended = "running", None
        record.extra.pop("error", None)
        record.extra.setdefault("resumed", []).append(utc_now())
        record.save(stored.path)
        return cls(record, stored.path)

    def save(self) -> None:
        self.record.save(self.path)

    def complete_stamp(self, ssh: SshClient) -> None:
        """The record's stamp completed by the host (:func:`rigctl.results.stamp.complete_on_host`): the
        servers' argv as deployed, the GPU, the build, the artifacts' manifests. Call it while the servers
        run."""
        from rigctl.results.stamp import complete_on_host

        self.record.restamp(complete_on_host(ssh, self.record.provenance))
        self.save()

    def write_text(self, name: str, text: str) -> Path:
        path = self.path / name
        path.write_text(text, encoding="utf-8")
        return path

    def write_jsonl(self, name: str, rows: Iterable[Mapping[str, Any]]) -> Path:
        """One JSON line per row (keys sorted), a raw file of the run."""
        import json

        return self.write_text(name, "".join(json.dumps(dict(r), sort_keys=True) + "\n" for r in rows))

    def write_json(self, name: str, data: Any) -> Path:
        import json

        return self.write_text(name, json.dumps(data, indent=2, sort_keys=True) + "\n")

    def seal(self, status: RunStatus = "done", error: str | None = None) -> None:
        """Every raw file hashed into the record, ``status`` and ``error`` set, the record saved."""
        self.record.seal(self.path, status, error)
        if status != "done":
            # Info, not a warning: the error itself reaches the user once, as the command's `error:` line.
            log.info("%s: sealed %s%s", self.ref, status, f": {error}" if error else "")

    @contextmanager
    def sealing(self) -> Iterator[Run]:
        """The block's outcome sealed into the record: done; failed with the error (re-raised); stopped on an
        interrupt."""
        try:
            yield self
        except (KeyboardInterrupt, asyncio.CancelledError):
            self.seal("stopped", INTERRUPTED)
            raise
        except BaseException as exc:
            self.seal("failed", one_line(exc))
            raise
        self.seal("done")


@dataclass
class RunResult:
    """What a command that drives one run returns (a load curve, a server bench, a drafter race): the host,
    the run's directory once :func:`open_run` made it, and what the command measured (in subclasses)."""

    host: str
    run_dir: Path | None = field(default=None, kw_only=True)

    @property
    def ref(self) -> str:
        """``host/run id``, as :attr:`Run.ref` and commands name it; ``host/?`` when no run was opened."""
        return f"{self.host}/{self.run_dir.name if self.run_dir else '?'}"


@contextmanager
def open_run(kind: RunKind, stamp: Provenance, store: ResultsStore, **outcome: Any) -> Iterator[Run]:
    """A new run of ``kind`` (:meth:`Run.create`: its directory and ``running`` record at once), sealed when
    the block ends (:meth:`Run.sealing`). ``outcome``: record fields besides the stamp (``extra``,
    ``commands``, ``host`` when the results directory is not the stamp's host)."""
    run = Run.create(kind, stamp, store, **outcome)
    with run.sealing():
        yield run
