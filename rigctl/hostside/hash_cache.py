"""The host's cache of model files' sha256, keyed by each file's identity. Standard library only.

A model file is hashed once for as long as it keeps its identity (device, inode, size, mtime and ctime, which
no write or rename leaves as they were, :func:`rigctl.hostside.model_files.identity`): a job's record
(:mod:`rigctl.hostside.jobrun`) and ``rigctl models list`` take the sha256 from here, so they name the file's
actual hash without reading gigabytes each time. The cache is root's, beside the jobs directory; a caller that
cannot write it (a job) still gets the hash, computed now.

``inspect PATHS CACHE`` (a one-shot command, :func:`rigctl.hostside.ship.python_command`): ``{artifact:
{"manifest": text, "sha256": hex, "sha256_from": where}}`` for ``PATHS`` (JSON, artifact -> path).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from rigctl.hostside import commands, jobfiles, model_files
from rigctl.hostside.runrecord import utc_now, write_json_atomically

HASH_CACHE_FILE = "sha256-cache.json"
#: Where the cache is on a host: beside the jobs directory (``rigctl.jobs.JOBS_DIR``), where the job runtime's
#: ``hash_cache_path`` finds it too.
HOST_CACHE = "/var/lib/rigctl/" + HASH_CACHE_FILE


def cached_sha256(cache_path: Path, path: str) -> tuple[str, str]:
    """``path``'s sha256 and where it came from: the cache when the file's identity is the one it was hashed
    with, else hashed now (and kept in the cache, where the caller may write it)."""
    identity = model_files.identity(path)
    cache = jobfiles.read_json(str(cache_path))
    hit = cache.get(path) if isinstance(cache, dict) else None
    if isinstance(hit, dict) and hit.get("identity") == identity and isinstance(hit.get("sha256"), str):
        return hit["sha256"], f"cache (hashed {hit.get('hashed', '?')}, file unchanged since)"
    digest = model_files.file_sha256(path)
    if not isinstance(cache, dict):
        cache = {}
    cache[path] = {"identity": identity, "sha256": digest, "hashed": utc_now()}
    with contextlib.suppress(OSError):  # read-only to a job: hashed now, again next time
        write_json_atomically(cache_path, cache)
    return digest, "hashed now"


def inspect(paths: dict[str, str], cache_path: Path) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, path in paths.items():
        entry = out[name] = {}
        manifest = model_files.read_manifest(path)
        if manifest is not None:
            entry["manifest"] = manifest
        if os.path.isfile(path):
            entry["sha256"], entry["sha256_from"] = cached_sha256(cache_path, path)
    return out


def main(argv: list[str]) -> int:
    return commands.answer("hash_cache", argv, {"inspect": lambda args: inspect(json.loads(args[0]), Path(args[1]))})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
