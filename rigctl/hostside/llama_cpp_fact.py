"""The llama_cpp role's local fact (``/etc/ansible/facts.d/llama_cpp.fact``, INI): the builds the
``current`` and ``previous`` links point to, and a ``candidate`` beside them while an upgrade measures
one. Standard library only.

The one reader of that file: the job runtime records the current build from it on the host, and
:func:`rigctl.fleet.build.parse_fact` makes its typed :class:`rigctl.fleet.build.Build` from the same dicts.
"""

from __future__ import annotations

import configparser
from typing import Any

FACT_PATH = "/etc/ansible/facts.d/llama_cpp.fact"
LINKS = ("current", "previous", "candidate")
_TEXT_FIELDS = ("name", "dir", "key", "version", "commit", "source", "cuda_architectures", "cuda_version",
                "built_on", "built_at", "cpu_target", "cpu_isa_hash")


def parse_builds(text: str) -> dict[str, dict[str, Any] | None]:
    """``{"current": build, "previous": build, "candidate": build}`` (None where the fact has no such
    section), read the way Ansible reads facts.d INI files. Raises configparser.Error (not INI) or
    ValueError (a bad number)."""
    parser = configparser.ConfigParser()
    parser.read_string(text)
    builds: dict[str, dict[str, Any] | None] = {}
    for link in LINKS:
        if not parser.has_section(link):
            builds[link] = None
            continue
        section = parser[link]
        build: dict[str, Any] = {name: section.get(name, "") for name in _TEXT_FIELDS}
        build["build_number"] = section.getint("build_number", fallback=0)
        build["cuda"] = section.getboolean("cuda", fallback=False)
        build["cmake_flags"] = [line.strip() for line in section.get("cmake_flags", "").splitlines() if line.strip()]
        binaries = f"{link}_binaries"
        build["binaries"] = dict(parser[binaries]) if parser.has_section(binaries) else {}
        builds[link] = build
    return builds


def record_fields(build: dict[str, Any]) -> dict[str, Any]:
    """What a run record keeps of a build: commit, version, build_key, build_number, cuda, binaries."""
    fields = {name: build[name] for name in ("name", "dir", "commit", "version", "build_number", "cuda")}
    fields["build_key"] = build["key"]
    if build["binaries"]:
        fields["binaries"] = build["binaries"]
    return fields
