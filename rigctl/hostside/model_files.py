"""Model files on a host: their sha256, their identity, the manifest the models role left beside them.

Standard library only. The job runtime (:mod:`rigctl.hostside.jobrun`), the exporter's probe
(:mod:`rigctl.hostside.fleet_state`) and ``rigctl models`` use these, the last two as one-shot commands
(:func:`rigctl.hostside.ship.python_command`):

* ``inspect PATHS REHASH``: ``{artifact: {"manifest": text, "sha256": hex}}`` for ``PATHS`` (JSON,
  artifact -> path); ``sha256`` only when ``REHASH`` is ``1`` and the file exists.
* ``hash FILES``: ``{path: sha256}`` for ``FILES`` (JSON, path -> :func:`identity`), each hash kept
  only if the file kept that identity while it was read.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

MANIFEST_SUFFIX = ".manifest.json"
_CHUNK = 1 << 22


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def identity(path: str | os.PathLike[str]) -> list[int]:
    """Device, inode, size, mtime and ctime: no write or rename leaves all of them as they were."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def manifest_path(path: str) -> str:
    return path + MANIFEST_SUFFIX


def read_manifest(path: str) -> str | None:
    """The text of the manifest beside the model file ``path`` (None without one)."""
    try:
        with open(manifest_path(path), encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def inspect(paths: dict[str, str], rehash: bool) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, path in paths.items():
        entry = out[name] = {}
        manifest = read_manifest(path)
        if manifest is not None:
            entry["manifest"] = manifest
        if rehash and os.path.isfile(path):
            entry["sha256"] = file_sha256(path)
    return out


def hash_unchanged(files: dict[str, list[int]]) -> dict[str, str]:
    out = {}
    for path, seen in files.items():
        try:
            digest = file_sha256(path)
            now = identity(path)
        except OSError:
            continue
        if now == seen:
            out[path] = digest
    return out


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "inspect":
        answer: object = inspect(json.loads(args[0]), args[1] == "1")
    elif command == "hash":
        answer = hash_unchanged(json.loads(args[0]))
    else:
        print(f"model_files: unknown command {command!r}", file=sys.stderr)
        return 2
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
