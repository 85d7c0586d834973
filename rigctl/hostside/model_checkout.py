"""What a model checkout (a Hugging Face repository's files) may hold before rigctl writes or converts it.

Standard library only: the models role's modules import it as ``ansible.module_utils.model_checkout``.

* :func:`confined_name`: a file name a listing gives is a relative path that stays inside the checkout
  (a hostile mirror's ``../escape.txt`` or ``/etc/x`` never becomes a path).
* :func:`remote_code`: what in a checkout would run as Python when the converter loads it with
  transformers' ``trust_remote_code=True`` (the pinned convert_hf_to_gguf.py passes it): Python files, and
  an ``auto_map`` in any of its JSON configs (config.json, tokenizer_config.json, processor configs).
  The models role refuses such a checkout unless its catalog entry sets ``trust_remote_code: true``.
"""

from __future__ import annotations

import json
import os

_CODE_SUFFIXES = (".py", ".pyc", ".pyw")
#: A JSON file larger than this is not read; it counts as code (a config could hide an auto_map in it).
_MAX_JSON_BYTES = 256 << 20


class CheckoutError(Exception):
    """One line naming the file or the name that was refused."""


def confined_name(name: object) -> str:
    """``name`` if it is a plain relative POSIX path (no ``..``, ``.`` or empty component, not absolute, no
    backslash or control character); CheckoutError otherwise."""
    shown = repr(name)[:120]
    if not isinstance(name, str) or not name:
        raise CheckoutError(f"{shown} is not a relative path")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name) or "\\" in name:
        raise CheckoutError(f"{shown} has a control character or a backslash")
    if name.startswith("/"):
        raise CheckoutError(f"{shown} is absolute")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise CheckoutError(f"{shown} leaves the directory or has an empty component")
    return name


def is_code(name: str) -> bool:
    """Whether a file of the checkout is Python that transformers' remote code would import."""
    return name.lower().endswith(_CODE_SUFFIXES)


def remote_code(checkout: str) -> list[str]:
    """What in the checkout directory would run as code: each Python file (relative path), and
    ``<file> auto_map`` for each JSON config that maps a class onto the repository's own code."""
    found = []
    for root, dirs, files in os.walk(checkout):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, checkout)
            if is_code(name):
                found.append(rel)
            elif name.lower().endswith(".json"):
                reason = _json_code(path)
                if reason:
                    found.append(f"{rel} {reason}")
    return found


def _json_code(path: str) -> str:
    """``auto_map`` when the JSON file maps classes onto the repository's code, else ``""``."""
    try:
        if os.path.getsize(path) > _MAX_JSON_BYTES:
            return f"(over {_MAX_JSON_BYTES >> 20} MiB, not read)"
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return ""  # not a config transformers could read either
    return "auto_map" if isinstance(config, dict) and config.get("auto_map") else ""


def describe(found: list[str], limit: int = 3) -> str:
    """``a.py, config.json auto_map and 4 more`` for a one-line message."""
    shown = ", ".join(found[:limit])
    return shown + (f" and {len(found) - limit} more" if len(found) > limit else "")
