"""llama.cpp builds on the hosts: what is current and previous, and rolling back to the previous one.

The llama_cpp role installs each build in ``<install_root>/<version>-<key>/`` and points the
``current`` and ``previous`` links at two of them; its local fact
(``/etc/ansible/facts.d/llama_cpp.fact``, INI) describes both. rigctl reads that fact over SSH and
rolls back through the role itself (tag ``llama_cpp_rollback``), so the links and the fact are only
ever written by one piece of code.
"""

from __future__ import annotations

import configparser
from collections.abc import Callable
from dataclasses import dataclass, field

from rigctl.errors import BuildError
from rigctl.fleet.deploy import DeployResult, TaskEvent, run_playbook
from rigctl.hostside.llama_cpp_fact import FACT_PATH, parse_builds
from rigctl.inventory import Host, Inventory


@dataclass(frozen=True)
class Build:
    """One installed llama.cpp build, as the role's fact describes it."""

    name: str
    dir: str
    key: str
    version: str
    commit: str
    build_number: int
    source: str
    cuda: bool
    cuda_architectures: str
    cuda_version: str
    built_on: str
    built_at: str
    cpu_target: str = ""  # "native" (-march=native) or "portable"; "" from a role older than the field
    cpu_isa_hash: str = ""  # native: the hash of the instruction-set extensions it was compiled for
    cmake_flags: tuple[str, ...] = ()
    binaries: dict[str, str] = field(default_factory=dict)  # name -> sha256

    def __str__(self) -> str:
        return f"{self.name} (build {self.build_number}, commit {self.commit})"

    @property
    def cpu(self) -> str:
        """What the CPU code targets, short: ``native 9246a338`` (the instruction set's hash), ``portable``."""
        if self.cpu_target == "native":
            return f"native {self.cpu_isa_hash[:8]}" if self.cpu_isa_hash else "native"
        return self.cpu_target or "-"


@dataclass(frozen=True)
class Builds:
    host: str
    current: Build | None
    previous: Build | None
    candidate: Build | None = None  # built beside current by `rigctl build upgrade` / `bisect`


@dataclass(frozen=True)
class RollbackResult:
    host: str
    before: Build
    after: Build
    deploy: DeployResult


def parse_fact(text: str, host: str = "?") -> Builds:
    """The role's INI fact as :class:`Builds` (:func:`rigctl.hostside.llama_cpp_fact.parse_builds`)."""
    try:
        builds = parse_builds(text)
    except (configparser.Error, ValueError) as exc:
        raise BuildError(f"{host}: {FACT_PATH} is not the llama_cpp role's fact: {str(exc).splitlines()[0]}") from None

    def build(link: str) -> Build | None:
        fields = builds[link]
        if fields is None:
            return None
        return Build(**{**fields, "cmake_flags": tuple(fields["cmake_flags"])})

    return Builds(host=host, current=build("current"), previous=build("previous"), candidate=build("candidate"))


def read_builds(host: Host, *, timeout: float = 30.0) -> Builds:
    """The builds ``current`` and ``previous`` point to on ``host``, from the role's fact over SSH."""
    from rigctl.ssh import session

    with session(host) as ssh:
        result = ssh.run(f"cat {FACT_PATH}", timeout=timeout, check=False)
    if result.rc != 0:
        return Builds(host=host.name, current=None, previous=None)
    return parse_fact(result.stdout, host.name)


def rollback(
    inventory: Inventory,
    host_name: str,
    *,
    on_event: Callable[[TaskEvent], None] | None = None,
    on_task: Callable[[str], None] | None = None,
    timeout: int | None = 600,
) -> RollbackResult:
    """Make ``host_name``'s previous llama.cpp build current (and the current one previous).

    Runs ``playbooks/site.yml`` limited to the host with tag ``llama_cpp_rollback`` and
    ``llama_cpp_rollback=true``: the role swaps the links atomically and rewrites its fact. The next
    ``rigctl provision`` makes the inventory's build current again.
    """
    host = inventory.host(host_name)
    before = read_builds(host)
    if before.current is None:
        raise BuildError(f"{host.name}: no llama.cpp build recorded in {FACT_PATH}; provision it first")
    if before.previous is None:
        raise BuildError(f"{host.name}: no previous llama.cpp build to roll back to (current is {before.current})")
    result = run_playbook(
        inventory,
        "site.yml",
        limit=host.name,
        tags=["llama_cpp_rollback"],
        extravars={"llama_cpp_rollback": True},
        on_event=on_event,
        on_task=on_task,
        timeout=timeout,
    )
    result.raise_for_failures()
    after = read_builds(host)
    if after.current is None or after.current.name != before.previous.name:
        raise BuildError(f"{host.name}: rollback ran but current is {after.current}, not {before.previous}")
    return RollbackResult(host=host.name, before=before.current, after=after.current, deploy=result)
