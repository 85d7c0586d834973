"""What ``llama-server --version`` (and every llama.cpp tool's ``--version``) says: the one reader of it, used by
the llama_cpp role's post-build check (as ``module_utils``, through ``llama_cpp_version``) and by rigctl.
Standard library only.

Two generations print it (to stderr, after whatever the backends log while loading: ``ggml_cuda_init:``
device lines, ``load_backend:``, ``ggml_vulkan:``)::

    version: 4547 (c5d9effb)
    built with MSVC 19.29.30158.0 for

    version: 0.4.1-dev (build 10991, commit 930e2fa59)
    built with AppleClang 21.0.0.21000334 for Darwin arm64

The commit is what the build saw (a short hash, a release label like ``b11434`` for a source archive without
git, or ``unknown``); the target after ``for`` may be empty.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

_OLD = re.compile(r"^version: (?P<build>\d+) \((?P<commit>[0-9A-Za-z._-]+)\)$")
_NEW = re.compile(r"^version: (?P<label>\S+) \(build (?P<build>\d+), commit (?P<commit>[0-9A-Za-z._-]+)\)$")
_BUILT = re.compile(r"^built with (?P<compiler>.*?) for ?(?P<target>.*)$")


@dataclass(frozen=True)
class LlamaVersion:
    build_number: int
    commit: str
    label: str | None  # the release's version (0.4.1-dev) where the build prints one
    compiler: str | None
    target: str | None  # None: no `built with` line; "" where the build printed none after `for`

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def parse(text: str) -> LlamaVersion:
    """The version ``text`` reports; ValueError when no line of it is a ``version:`` line of either form."""
    found: LlamaVersion | None = None
    for line in text.splitlines():
        line = line.strip()
        match = _NEW.match(line) or _OLD.match(line)
        if match and found is None:
            groups = match.groupdict()
            found = LlamaVersion(int(groups["build"]), groups["commit"], groups.get("label"), None, None)
            continue
        built = _BUILT.match(line)
        if built and found is not None and found.compiler is None:
            found = LlamaVersion(found.build_number, found.commit, found.label, built["compiler"],
                                 built["target"].strip())
    if found is None:
        first = next((line.strip() for line in text.splitlines() if line.strip()), "nothing")
        raise ValueError(f"no `version: N (commit)` line (said {first[:200]!r})")
    return found


def same_commit(reported: str, pinned: str) -> bool:
    """The reported commit is the pinned one: one is a prefix of the other (builds print a short hash; a
    source archive's build prints its release label, which is what the pin holds)."""
    reported, pinned = reported.lower(), pinned.lower()
    return bool(reported and pinned) and (reported.startswith(pinned) or pinned.startswith(reported))
