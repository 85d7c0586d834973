"""The controller's results store: ``<root>/<host>/<run id>/`` per run, a tolerant loader over it.

A directory whose record cannot be read is skipped with a warning (one bad run never hides the others);
records of every version load (:func:`rigctl.results.record.upgrade`). Host and run id are single path
names: nothing a record or a rig says can place a run outside the root.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from rigctl.errors import ConfigError, TrustError
from rigctl.hostside.jobfiles import READ_LIMIT as RECORD_LIMIT
from rigctl.hostside.runrecord import RUN_ID
from rigctl.inputs import utf8_handle_lines, utf8_lines
from rigctl.results.record import RUN_FILE, RunRecord, iter_json_objects
from rigctl.trust import relative_path

log = logging.getLogger(__name__)

# A raw file of a run (answers, cells, tokens) is read up to this many bytes: a file grown past it (or a
# device that never ends) is refused rather than read for ever.
RAW_FILE_LIMIT = 8 << 30
# Every store directory below the root is opened from its parent's fd without following a link, every
# store file likewise and then checked on the open file: the check and the read are one act (a link
# swapped in between a path check and the read cannot redirect it).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class StoredRun:
    host: str
    path: Path
    record: RunRecord

    @property
    def id(self) -> str:
        return self.record.id


def default_results_root() -> Path:
    return Path(os.environ.get("RIGCTL_RESULTS") or "results")


class ResultsStore:
    """The controller's results tree: ``<root>/<host>/<run id>/``."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or default_results_root()).expanduser()

    def run_dir(self, host: str, run_id: str) -> Path:
        """``<root>/<host>/<run id>``; TrustError when either is not one plain path name."""
        for what, name in (("host", host), ("run id", run_id)):
            if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
                    or "\0" in name:
                raise TrustError(f"{what} {name!r}: not a plain name, refused as a results path")
        return self.root / host / run_id

    def runs(self, host: str | None = None, kind: str | None = None,
             on_skip: Callable[[Path, ConfigError], None] | None = None) -> Iterator[StoredRun]:
        """Every stored run, oldest first; directories without a readable record are skipped with a warning
        (or handed to ``on_skip``, for a caller that reads the store again and again)."""
        for host_dir in self._host_dirs(host):
            for name in sorted(_subdirs(self.root, (host_dir.name,))):
                run_dir = host_dir / name
                record = _readable(run_dir, on_skip)
                if record is not None and (kind is None or record.kind == kind):
                    yield StoredRun(host=host_dir.name, path=run_dir, record=record)

    def _host_dirs(self, host: str | None) -> list[Path]:
        return [self.root / host] if host else [self.root / name for name in sorted(_subdirs(self.root, ()))]

    def last(self, limit: int, host: str | None = None, kind: str | None = None) -> list[StoredRun]:
        """``list(self.runs(host, kind))[-limit:]``, reading only the records it returns (and unreadable ones
        on the way): the directories from the end, a run id naming another kind passed over unread."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        found: list[StoredRun] = []
        for host_dir in reversed(self._host_dirs(host)):
            for name in sorted(_subdirs(self.root, (host_dir.name,)), reverse=True):
                run_dir = host_dir / name
                if len(found) >= limit:
                    return found[::-1]
                if kind is not None and RUN_ID.match(run_dir.name) and not run_dir.name.startswith(f"{kind}-"):
                    continue
                record = _readable(run_dir)
                if record is not None and (kind is None or record.kind == kind):
                    found.append(StoredRun(host=host_dir.name, path=run_dir, record=record))
        return found[::-1]

    def find(self, ref: str) -> StoredRun:
        """A run by id, by ``host/id`` or by path to its directory."""
        path = Path(ref)
        if (path / RUN_FILE).is_file():
            # A directory the user names is theirs to name through a link: its real path is the run's, so that
            # its raw files are then read (:func:`open_run_file`) from there, link-free.
            path = path.resolve()
            record = RunRecord.load(path)
            return StoredRun(host=record.host, path=path, record=record)
        if path.is_dir():  # a host's directory or the store itself: read as a host/id it would list every sibling
            raise ConfigError(f"{ref}: not a run (a directory without {RUN_FILE})")
        host, _, run_id = ref.rpartition("/")
        if "/" in host:
            raise ConfigError(f"run {ref!r}: not found under {self.root} (a run is ID, HOST/ID or its directory)")
        # A run lives in the directory named by its id: look there first, loading one record per host rather
        # than every record of the store; only a directory not named by its record's id needs the scan.
        matches = self._named(host, run_id) or [run for run in self.runs(host or None) if run.id == run_id]
        if not matches:
            raise ConfigError(f"run {ref!r}: not found under {self.root}")
        if len(matches) > 1:
            where = ", ".join(f"{m.host}/{m.id}" for m in matches)
            raise ConfigError(f"run {ref!r} is ambiguous: {where}")
        return matches[0]

    def _named(self, host: str, run_id: str) -> list[StoredRun]:
        """The runs in ``<host>/<run_id>`` (every host's when ``host`` is empty) whose record has that id."""
        found = []
        for name in [host] if host else [p.name for p in self._host_dirs(None)]:
            try:
                run_dir = self.run_dir(name, run_id)
            except TrustError:
                return []
            record = _readable(run_dir) if _is_stored(self.root, (name, run_id, RUN_FILE)) else None
            if record is not None and record.id == run_id:
                found.append(StoredRun(host=name, path=run_dir, record=record))
        return found

    def verify(self, run: StoredRun) -> list[str]:
        """Raw files missing or differing from the record's hashes (empty when all is well)."""
        problems = []
        for raw in run.record.files:
            try:
                with open_run_file(run, raw.path) as handle:
                    digest = hashlib.file_digest(handle, "sha256").hexdigest()
            except FileNotFoundError:
                problems.append(f"{run.host}/{run.id}: {raw.path} is missing")
                continue
            except (ConfigError, TrustError) as exc:
                problems.append(f"{run.host}/{run.id}: {raw.path}: {exc}")
                continue
            if digest != raw.sha256:
                problems.append(f"{run.host}/{run.id}: {raw.path} does not match its sha256")
        return problems


@contextmanager
def open_stored(base: Path, parts: Sequence[str], limit: int = RAW_FILE_LIMIT) -> Iterator[BinaryIO]:
    """The file ``base/parts...`` open for reading, the one way every store reader reaches a file: each
    directory opened from its parent's fd with ``O_DIRECTORY|O_NOFOLLOW`` and the file with ``O_NOFOLLOW``,
    then held to be a regular file of at most ``limit`` bytes on the open fd (a link anywhere below ``base``
    is refused, never followed). FileNotFoundError when a part is missing; ConfigError naming the path
    otherwise."""
    path = base.joinpath(*parts)
    try:
        fd = _open_below(base, parts)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(f"{path}: not read: {_why(exc)}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path}: not a regular file")
        if info.st_size > limit:
            raise ConfigError(f"{path}: larger than {limit} bytes")
        yield _Bounded(handle, limit)


def open_run_file(run: StoredRun, relative: str) -> Any:
    """:func:`open_stored` for ``relative`` (checked: no ``..``, not absolute) in ``run``'s directory, the run
    and host directories included in the link-free walk."""
    parts = relative_path(relative, f"{run.host}/{run.id}: file").parts
    return open_stored(run.path.parent.parent, (run.path.parent.name, run.path.name, *parts))


def run_has(run: StoredRun, relative: str) -> bool:
    """Whether ``run`` holds ``relative`` as a regular file, reached without a link."""
    return _is_stored(run.path.parent.parent,
                      (run.path.parent.name, run.path.name, *relative_path(relative, "file").parts))


def iter_run_jsonl(run: StoredRun, relative: str) -> Iterator[dict[str, Any]]:
    """:func:`iter_jsonl` of ``run``'s raw file ``relative``, opened with :func:`open_run_file`; ConfigError
    naming the run when it has no such file."""
    label = f"{run.path / relative}"
    try:
        with open_run_file(run, relative) as handle:
            yield from iter_json_objects(utf8_handle_lines(handle, label), label, torn_tail=True)
    except FileNotFoundError:
        raise ConfigError(f"{run.host}/{run.id}: no {relative}") from None
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read: {exc.strerror or exc}") from None


def read_run_jsonl(run: StoredRun, relative: str) -> list[dict[str, Any]]:
    """:func:`iter_run_jsonl`, all at once."""
    return list(iter_run_jsonl(run, relative))


class _Bounded:
    """A binary file read no further than ``limit`` bytes (it may grow after its size was checked); a read past
    the limit is a ConfigError."""

    def __init__(self, handle: BinaryIO, limit: int) -> None:
        self._handle, self._left = handle, limit

    def read(self, size: int = -1) -> bytes:
        want = self._left + 1 if size < 0 else min(size, self._left + 1)
        data = self._handle.read(want)
        self._spend(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)[:self._left + 1]
        count = self._handle.readinto(view)
        self._spend(count)
        return count

    def readable(self) -> bool:
        return True

    def __iter__(self) -> Iterator[bytes]:
        for line in self._handle:
            self._spend(len(line))
            yield line

    def _spend(self, count: int) -> None:
        self._left -= count
        if self._left < 0:
            raise ConfigError(f"{self._handle.name}: grew past its read limit")


def _open_below(base: Path, parts: Sequence[str], *, directory: bool = False) -> int:
    """An fd of ``base/parts...`` opened link-free below ``base`` (``base`` itself is the caller's to name)."""
    dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for index, name in enumerate(parts):
            last = index == len(parts) - 1
            fd = os.open(name, _FILE_FLAGS if last and not directory else _DIR_FLAGS, dir_fd=dir_fd)
            if last:
                return fd
            os.close(dir_fd)
            dir_fd = fd
        return os.dup(dir_fd)
    finally:
        os.close(dir_fd)


def _is_stored(base: Path, parts: Sequence[str]) -> bool:
    """Whether ``base/parts...`` is a regular file reached without a link."""
    try:
        fd = _open_below(base, parts)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def _subdirs(base: Path, parts: Sequence[str]) -> list[str]:
    """Names of the real directories in ``base/parts...``: each opened from the directory's fd with
    ``O_DIRECTORY|O_NOFOLLOW``, so a link (to another tree, another run) is neither listed nor read. Empty when
    the directory itself is missing or reached through a link."""
    try:
        dir_fd = _open_below(base, parts, directory=True)
    except OSError:
        return []
    try:
        names = []
        for name in os.listdir(dir_fd):
            try:
                os.close(os.open(name, _DIR_FLAGS, dir_fd=dir_fd))
            except OSError:
                continue
            names.append(name)
        return names
    finally:
        os.close(dir_fd)


def _why(exc: OSError) -> str:
    """An open's failure in words: ELOOP/ENOTDIR from ``O_NOFOLLOW`` mean a link where a file or directory was."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a link or not a directory on the way (links in the results store are not followed)"
    return exc.strerror or str(exc)


def _readable(run_dir: Path, on_skip: Callable[[Path, ConfigError], None] | None = None) -> RunRecord | None:
    """The run's record (read with :func:`open_stored`, from the store's fds); None when it cannot be read (one
    bad run never hides the others), with a warning or handed to ``on_skip``."""
    try:
        try:
            with open_stored(run_dir.parent.parent, (run_dir.parent.name, run_dir.name, RUN_FILE),
                             RECORD_LIMIT) as handle:
                raw = handle.read()
        except FileNotFoundError:
            raise ConfigError(f"{run_dir}: no {RUN_FILE} (not a run directory)") from None
        except OSError as exc:
            raise ConfigError(f"{run_dir / RUN_FILE}: cannot read: {exc.strerror or exc}") from None
        return RunRecord.parse(raw, run_dir / RUN_FILE)
    except ConfigError as exc:
        if on_skip is None:
            log.warning("skipping %s: %s", run_dir, exc)
        else:
            on_skip(run_dir, exc)
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Objects of a JSONL file (:func:`iter_jsonl`, all at once)."""
    return list(iter_jsonl(path))


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Objects of a JSONL file, read line by line (a run's answers cost one line of memory, however many there
    are); a torn last line (a run stopped mid-write) is ignored, any other bad line (not UTF-8, not JSON, not
    an object) is a ConfigError naming the file and line."""
    return iter_json_objects(utf8_lines(path), path, torn_tail=True)


def run_file(run: StoredRun, kind: str, name: str) -> Path:
    """The raw file ``name`` of ``run``, which must be a ``kind`` run that has it (ConfigError naming the run)."""
    if run.record.kind != kind:
        raise ConfigError(f"{run.host}/{run.id}: a {run.record.kind} run, not a {kind} run")
    if not run_has(run, name):
        raise ConfigError(f"{run.host}/{run.id}: no {name}")
    return run.path / name


_Row = TypeVar("_Row")


def read_rows(run: StoredRun, kind: str, name: str, row: Callable[..., _Row]) -> list[_Row]:
    """The JSON lines of ``run``'s raw file ``name`` (:func:`run_file`) as ``row(**line)`` each; a line that
    does not fit is a ConfigError naming the file."""
    path = run_file(run, kind, name)
    try:
        return [row(**line) for line in read_run_jsonl(run, name)]
    except TypeError as exc:
        raise ConfigError(f"{path}: not a {kind} run's {name}: {exc}") from None
