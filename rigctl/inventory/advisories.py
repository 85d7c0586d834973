"""The CVE floor: llama.cpp's published security advisories by build number, and which builds they cover.

The table is vendored (``rigctl/inventory/data/llama_cpp_advisories.yaml``, each entry citing where its range
was read). A build is *covered* by an advisory when its number lies in the advisory's range; a fleet may
accept a named advisory with a reason (the inventory's ``rigctl_allowed_advisories``: ``{id: reason}``),
which then no longer refuses the build but is still reported. Everything here is pure apart from reading
the table once.

Where the floor is checked: ``rigctl build upgrade`` and ``rigctl build bisect`` (before anything is
fetched or built, for a pin of the form ``bNNNN``; after the candidate is built for a git pin, whose
number the build itself reports), ``rigctl provision`` (every selected host's pin), ``rigctl inventory
check`` and the exporter (``rigctl_build_vulnerable`` for the pinned and the running build).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from rigctl.errors import ConfigError
from rigctl.inventory.keys import allowances
from rigctl.trust import data_text_problem

#: The inventory variable naming the advisories a fleet accepts, each with its reason.
ALLOWED_VAR = "rigctl_allowed_advisories"
_BUILD_LABEL = re.compile(r"b([0-9]+)")  # ASCII digits: \d and isdigit() take ² and ٣ too
#: An entry's id: the repository's GHSA, else the CVE (upstream took no private reports from 2026-06), else
#: the upstream issue that reported it.
_ID = re.compile(r"^(?:GHSA(-[23456789cfghjmpqrvwx]{4}){3}|CVE-[0-9]{4}-[0-9]{4,}|ggml-org/llama\.cpp#[0-9]+)$")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
#: A llama-server flag as the table names one: what the dangerous-flag policy compares.
_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")


@dataclass(frozen=True)
class Advisory:
    """One advisory and the builds it covers (see the table's header for the range semantics)."""

    id: str  # GHSA-xxxx-xxxx-xxxx, CVE-YYYY-N or ggml-org/llama.cpp#N
    cve: str | None
    severity: str
    summary: str
    introduced: int = 0
    last_affected: int | None = None
    fixed: int | None = None
    sources: tuple[str, ...] = ()
    #: The commit a CVE names as its last affected one, when it names no build.
    through_commit: str | None = None
    #: The llama-server flags the attack needs (the dangerous-flag policy cites the advisory for them).
    flags: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        if self.id.startswith("GHSA-"):
            return f"https://github.com/ggml-org/llama.cpp/security/advisories/{self.id}"
        if self.id.startswith("CVE-"):
            return f"https://nvd.nist.gov/vuln/detail/{self.id}"
        return f"https://github.com/ggml-org/llama.cpp/issues/{self.id.rpartition('#')[2]}"

    @property
    def has_build_range(self) -> bool:
        return self.last_affected is not None or self.fixed is not None

    def covers(self, build: int) -> bool:
        if build < self.introduced or not self.has_build_range:
            return False
        if self.fixed is not None:
            return build < self.fixed
        return self.last_affected is not None and build <= self.last_affected

    @property
    def range_text(self) -> str:
        """The covered builds, short: ``b7492-b9060``, ``< b8146``, or what the source states instead."""
        if not self.has_build_range:
            return f"through commit {self.through_commit}" if self.through_commit else "no range stated"
        start = f"b{self.introduced}" if self.introduced else ""
        if self.fixed is not None:
            return f"{start}-b{self.fixed - 1}" if start else f"< b{self.fixed}"
        return f"{start}-b{self.last_affected}" if start else f"<= b{self.last_affected}"

    def describe(self) -> str:
        """``GHSA-… (CVE-…, critical, builds b7492-b9060, fixed in b…): summary``."""
        fixed = f", fixed in b{self.fixed}" if self.fixed is not None else ", no fixed build named"
        cve = f"{self.cve}, " if self.cve and self.cve != self.id else ""
        return f"{self.id} ({cve}{self.severity}, builds {self.range_text}{fixed}): {self.summary}"


def parse_table(data: Any, origin: str) -> list[Advisory]:
    """The table's ``advisories`` list as :class:`Advisory` values; ConfigError naming the entry otherwise."""
    if not isinstance(data, Mapping) or not isinstance(data.get("advisories"), list):
        raise ConfigError(f"{origin}: expected a mapping with an 'advisories' list")
    out: list[Advisory] = []
    seen: set[str] = set()
    for index, entry in enumerate(data["advisories"]):
        where = f"{origin}: advisories[{index}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        known = {"id", "cve", "severity", "summary", "introduced", "last_affected", "fixed", "sources",
                 "through_commit", "flags"}
        unknown = sorted(str(k) for k in entry if k not in known)
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]}")
        ident = str(entry.get("id", ""))
        if not _ID.match(ident) or ident in seen:
            raise ConfigError(f"{where}: id {ident!r} is not a GHSA id, a CVE id or an upstream issue, "
                              "or is listed twice")
        seen.add(ident)
        bounds = {}
        for key in ("introduced", "last_affected", "fixed"):
            value = entry.get(key)
            if value is not None and (type(value) is not int or value < 0):
                raise ConfigError(f"{where} ({ident}): {key}: expected a build number, got {value!r}")
            bounds[key] = value
        commit = entry.get("through_commit")
        if commit is not None and (not isinstance(commit, str) or not _COMMIT.match(commit)):
            raise ConfigError(f"{where} ({ident}): through_commit: expected a commit hash, got {commit!r}")
        flags = entry.get("flags") or []
        if not isinstance(flags, list) or not all(isinstance(f, str) and _FLAG.match(f) for f in flags):
            raise ConfigError(f"{where} ({ident}): flags: expected a list of llama-server flags (--name)")
        if bounds["last_affected"] is None and bounds["fixed"] is None:
            if bounds["introduced"] is not None:
                raise ConfigError(f"{where} ({ident}): introduced needs last_affected or fixed")
        else:
            if commit is not None:
                raise ConfigError(f"{where} ({ident}): through_commit is for an advisory that names no build")
            end = bounds["fixed"] if bounds["fixed"] is not None else bounds["last_affected"] + 1
            if end <= (bounds["introduced"] or 0):
                raise ConfigError(f"{where} ({ident}): covers no build (introduced {bounds['introduced']}, "
                                  f"end {end})")
        sources = entry.get("sources") or []
        if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s for s in sources):
            raise ConfigError(f"{where} ({ident}): sources: every advisory cites where its range was read")
        out.append(Advisory(id=ident, cve=str(entry["cve"]) if entry.get("cve") else None,
                            severity=str(entry.get("severity", "unknown")), summary=str(entry.get("summary", "")),
                            introduced=bounds["introduced"] or 0, last_affected=bounds["last_affected"],
                            fixed=bounds["fixed"], sources=tuple(sources), through_commit=commit,
                            flags=tuple(flags)))
    return out


@functools.cache
def table() -> tuple[Advisory, ...]:
    """The vendored table."""
    text = resources.files("rigctl.inventory").joinpath("data/llama_cpp_advisories.yaml").read_text()
    return tuple(parse_table(yaml.safe_load(text), "llama_cpp_advisories.yaml"))


def build_number(version: str) -> int | None:
    """The upstream build number of a pin label ``bNNNN``; None for anything else (a git commit)."""
    found = _BUILD_LABEL.fullmatch(version.strip())
    return int(found.group(1)) if found else None


def covering(build: int, advisories: Iterable[Advisory] | None = None) -> list[Advisory]:
    """The advisories whose range holds ``build``."""
    return [a for a in (table() if advisories is None else advisories) if a.covers(build)]


#: The longest reason an upgrade writes into the inventory for an accepted advisory.
MAX_REASON = 500


def allowed_advisories(value: Any, where: str, *, written: bool = False) -> dict[str, str]:
    """``rigctl_allowed_advisories`` as ``{id: reason}``; ConfigError naming ``where`` and the entry.
    ``written``: the reasons come from a command line and an upgrade writes them into the inventory, so
    each must be one printable line of plain text (no template: the file tags it ``!unsafe`` too)."""
    out = allowances(value, where, ALLOWED_VAR, {a.id for a in table()}, what="advisory id", granted="accepted",
                     unknown="not an advisory of the table (rigctl build advisories lists them)")
    for ident, reason in out.items():
        problem = data_text_problem(reason, MAX_REASON) if written else None
        if problem:
            raise ConfigError(f"{where}: {ident}: the reason must be plain text: {problem}")
    return out


@dataclass(frozen=True)
class FloorCheck:
    """A build against the table: the advisories that cover it, split into refused and accepted."""

    build: int
    refused: tuple[Advisory, ...] = ()
    accepted: tuple[tuple[Advisory, str], ...] = ()  # (advisory, the fleet's reason)
    allow: Mapping[str, str] = field(default_factory=dict)

    @property
    def vulnerable(self) -> bool:
        return bool(self.refused)

    def refusal(self, what: str) -> str:
        """One line: ``what`` is inside the advisories' ranges, and how to accept one."""
        listed = "; ".join(a.describe() for a in self.refused)
        return (f"{what} (build {self.build}) is inside {listed}; pick a build outside the range, or accept it "
                f"by naming it in {ALLOWED_VAR} with the reason")


def check_build(build: int, allow: Mapping[str, str] | None = None,
                advisories: Sequence[Advisory] | None = None) -> FloorCheck:
    allow = dict(allow or {})
    found = covering(build, advisories)
    return FloorCheck(build=build, refused=tuple(a for a in found if a.id not in allow),
                      accepted=tuple((a, allow[a.id]) for a in found if a.id in allow), allow=allow)


def host_allowed(host: Any) -> dict[str, str]:
    """The advisories ``host`` (an inventory Host) accepts."""
    return allowed_advisories(host.vars.get(ALLOWED_VAR), f"host {host.name}")


def refuse_vulnerable_pins(hosts: Iterable[Any]) -> None:
    """BuildError naming every host whose inventory pin (an archive's ``bNNNN``) is inside an advisory's range
    it has not accepted: what ``rigctl provision`` checks before a play could install it."""
    from rigctl.errors import BuildError

    refusals = []
    for host in hosts:
        pin = host.llama_cpp if "llama_cpp_source" in host.vars else None
        number = build_number(pin.version) if pin is not None and pin.source == "archive" else None
        if number is None:
            continue
        check = check_build(number, host_allowed(host))
        if check.vulnerable:
            refusals.append(f"host {host.name}: " + check.refusal(f"pin {pin.version}"))
    if refusals:
        raise BuildError("; ".join(refusals))
