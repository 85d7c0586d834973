"""Dataset files for eval tasks: fetched once with httpx, checked by sha256, cached, usable offline.

A source is one of

* a Hugging Face dataset file: repo + pinned revision + file, fetched from
  ``<HF_ENDPOINT>/datasets/<repo>/resolve/<revision>/<file>`` (``HF_ENDPOINT`` defaults to the hub);
* a URL (with its sha256 when known);
* a local JSON/JSONL file (relative paths are relative to the task file).

Downloads land in ``<RIGCTL_CACHE_DIR or ~/.cache/rigctl>/datasets/`` and are written to a temporary name
and renamed once their hash is checked, so a stopped download leaves nothing half-written. When the task
file gives no sha256, the first download records the file's hash in the lock file
(``<cache>/datasets/lock.json``, or ``RIGCTL_DATASET_LOCK``) and every later use, online or from the cache,
must match it. ``RIGCTL_OFFLINE=1`` (or ``HF_HUB_OFFLINE=1``) never touches the network: a file missing
from the cache is then an error.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigctl.errors import EvalError
from rigctl.files import HashLock, cache_dir
from rigctl.hostside.token_origin import bearer_header, hf_endpoint
from rigctl.inputs import read_text, utf8_lines
from rigctl.results.record import file_sha256, iter_json_objects
from rigctl.trust import register_secret

log = logging.getLogger(__name__)

_MAX_REDIRECTS = 10
_CHUNK = 1 << 20


def cache_root() -> Path:
    return cache_dir() / "datasets"


def lock_path() -> Path:
    return Path(os.environ["RIGCTL_DATASET_LOCK"]).expanduser() if os.environ.get("RIGCTL_DATASET_LOCK") \
        else cache_root() / "lock.json"


def offline() -> bool:
    return any(os.environ.get(v, "").lower() in {"1", "true", "yes"} for v in ("RIGCTL_OFFLINE", "HF_HUB_OFFLINE"))


@dataclass(frozen=True)
class DatasetFile:
    """A verified local copy: where it is, its sha256, and the key it is locked under."""

    key: str
    path: Path
    sha256: str
    origin: str  # URL or local path it came from


class Lock(HashLock):
    """The datasets' lock file: ``{key: sha256}`` of every file first downloaded without a known hash."""

    def __init__(self, path: Path | None = None):
        super().__init__(path or lock_path(), EvalError)


def hf_url(repo: str, revision: str, file: str, endpoint: str | None = None) -> str:
    quoted = "/".join(urllib.parse.quote(part) for part in file.split("/"))
    return f"{endpoint or hf_endpoint()}/datasets/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/{quoted}"


def _safe(part: str) -> str:
    if not part or part in {".", ".."} or "\\" in part:
        raise EvalError(f"dataset path part {part!r} is not allowed")
    return part


def fetch_hf(repo: str, revision: str, file: str, *, sha256: str | None = None, timeout: float = 120.0,
             lock: Lock | None = None) -> DatasetFile:
    key = f"hf:{repo}@{revision}/{file}"
    local = cache_root() / "hf" / Path(*map(_safe, repo.split("/"))) / _safe(revision)
    local = local / Path(*map(_safe, file.split("/")))
    return _fetch(key, hf_url(repo, revision, file), local, sha256, timeout, lock or Lock())


def fetch_url(url: str, *, sha256: str | None = None, timeout: float = 120.0, lock: Lock | None = None) -> DatasetFile:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in {"http", "https"}:
        raise EvalError(f"dataset URL {url!r}: only http and https are supported")
    name = _safe(Path(parsed.path).name or "download")
    local = cache_root() / "url" / hashlib.sha256(url.encode()).hexdigest()[:16] / name
    return _fetch(f"url:{url}", url, local, sha256, timeout, lock or Lock())


def local_file(path: Path, *, sha256: str | None = None) -> DatasetFile:
    if not path.is_file():
        raise EvalError(f"dataset file {path} does not exist")
    actual = file_sha256(path)
    if sha256 and actual != sha256.lower():
        raise EvalError(f"dataset file {path}: sha256 {actual} does not match the task's {sha256}")
    return DatasetFile(f"path:{path}", path, actual, str(path))


def _fetch(key: str, url: str, local: Path, sha256: str | None, timeout: float, lock: Lock) -> DatasetFile:
    pinned = sha256.lower() if sha256 else None
    locked = lock.get(key)
    if pinned and locked and pinned != locked:
        raise EvalError(f"{key}: the task pins sha256 {pinned} but the lock file {lock.path} has {locked}")
    expected = pinned or locked
    if local.is_file():
        actual = file_sha256(local)
        if expected is None or actual == expected:
            if expected is None:
                lock.record(key, actual)
            return DatasetFile(key, local, actual, url)
        if offline():
            raise EvalError(f"{key}: cached {local} has sha256 {actual}, expected {expected} (offline: not re-fetched)")
        log.warning("%s: cached copy %s does not match %s; fetching again", key, local, expected)
    elif offline():
        raise EvalError(f"{key}: not in the cache ({local}) and offline (RIGCTL_OFFLINE/HF_HUB_OFFLINE)")
    actual = _download(key, url, local, timeout)
    if expected and actual != expected:
        local.with_name(f".{local.name}.part").unlink(missing_ok=True)
        source = "the task file" if pinned else f"the lock file {lock.path}"
        raise EvalError(f"{key}: downloaded sha256 {actual} does not match {expected} from {source}")
    os.replace(local.with_name(f".{local.name}.part"), local)
    if expected is None:
        lock.record(key, actual)
        log.info("%s: first download, sha256 %s recorded in %s", key, actual, lock.path)
    return DatasetFile(key, local, actual, url)


def _download(key: str, url: str, local: Path, timeout: float) -> str:
    """Stream ``url`` into ``.<name>.part`` beside ``local``; returns its sha256 (the caller renames it)."""
    import httpx  # a tenth of a second: reading a task (a report locating its runs) never downloads

    local.parent.mkdir(parents=True, exist_ok=True)
    part = local.with_name(f".{local.name}.part")
    digest = hashlib.sha256()
    token = os.environ.get("HF_TOKEN")
    register_secret(token)
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout, connect=15.0), follow_redirects=False) as client:
            current = url
            for _ in range(_MAX_REDIRECTS + 1):
                # The token goes to the endpoint's own scheme, host and port only, redirects included.
                headers = bearer_header(token, current, hf_endpoint())
                with client.stream("GET", current, headers=headers) as response:
                    if response.is_redirect and "location" in response.headers:
                        current = str(response.url.join(response.headers["location"]))
                        continue
                    if response.status_code != 200:
                        raise EvalError(f"{key}: GET {current}: HTTP {response.status_code}")
                    with part.open("wb") as handle:
                        for chunk in response.iter_bytes(_CHUNK):
                            handle.write(chunk)
                            digest.update(chunk)
                    break
            else:
                raise EvalError(f"{key}: GET {url}: more than {_MAX_REDIRECTS} redirects")
    except httpx.HTTPError as exc:
        part.unlink(missing_ok=True)
        raise EvalError(f"{key}: GET {url}: {type(exc).__name__}: {exc}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def read_records(path: Path) -> list[dict[str, Any]]:
    """The file's records (:func:`iter_records`, all at once)."""
    return list(iter_records(path))


def iter_records(path: Path) -> Iterator[dict[str, Any]]:
    """JSON lines, read one at a time, or one JSON array of objects, read whole (decided by the first
    non-blank character)."""
    lines = utf8_lines(path, error=EvalError)
    head: list[str] = []
    for line in lines:
        head.append(line)
        if line.strip():
            if line.lstrip().startswith("["):
                lines.close()
                return iter(_json_array(path))
            break
    return iter_json_objects(itertools.chain(head, lines), path, error=EvalError)


def _json_array(path: Path) -> list[dict[str, Any]]:
    text = read_text(path, error=EvalError)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvalError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list):
        raise EvalError(f"{path}: not a JSON array of records")
    for number, row in enumerate(data):
        if not isinstance(row, dict):
            raise EvalError(f"{path}: record {number} is a {type(row).__name__}, not a JSON object")
    return data
