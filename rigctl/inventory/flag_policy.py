"""The dangerous-flag policy: llama-server flags that hand the model, or whoever reaches the server, more power
than serving completions, refused unless the inventory allows each by name with a reason.

Each flag of :data:`DANGEROUS` says why it is dangerous and cites where that is stated; an advisory of the
CVE floor's table whose attack needs a flag (its ``flags``) is cited for it too. ``--rerank`` is dangerous only
on a bind beyond loopback (CVE-2026-52132 is reached over HTTP, and no build number escapes it). A fleet that
needs one names it in ``rigctl_allowed_server_flags`` (``{flag: reason}``). Checked by ``rigctl inventory
check`` (one problem per instance and flag) and ``rigctl provision`` (before a play could write the flag into
an arguments file). What is compared is each arguments-file line's flag, after every profile, host override
and ``extra_args`` is applied: the lines the role writes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rigctl.errors import ConfigError
from rigctl.inventory import advisories
from rigctl.inventory.keys import allowances

#: The inventory variable naming the dangerous flags a fleet allows, each with its reason.
ALLOWED_VAR = "rigctl_allowed_server_flags"


@dataclass(frozen=True)
class DangerousFlag:
    """One flag (and its aliases) the policy refuses, with why and where that is stated."""

    flag: str  # the name an inventory allows it by
    why: str
    sources: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    #: Any flag starting with ``flag`` (``--mcp-servers-config``, ``--mcp-servers-json``).
    prefix: bool = False
    #: Dangerous only when the server listens beyond loopback.
    exposed_only: bool = False

    def matches(self, name: str) -> bool:
        if self.prefix:
            return name.startswith(self.flag)
        return name == self.flag or name in self.aliases

    def advisories(self) -> list[str]:
        """The ids of the table's advisories whose attack needs this flag."""
        names = {self.flag, *self.aliases}
        return [a.id for a in advisories.table()
                if any(f in names or (self.prefix and f.startswith(self.flag)) for f in a.flags)]


DANGEROUS: tuple[DangerousFlag, ...] = (
    DangerousFlag("--tools", "gives the model the server's built-in tools (reading, editing and listing files "
                             "on the host)",
                  ("ggml-org/llama.cpp#20673 (the server's tool registry: read_file, edit_file, list_files)",)),
    DangerousFlag("--agent", "lets the model act through the server's tools on its own",
                  ("ggml-org/llama.cpp#20673 (built-in tools run by the server)",)),
    DangerousFlag("--mcp-servers", "makes the server spawn local processes (MCP servers) whose tools the model "
                                   "may call", prefix=True,
                  sources=("ggml-org/llama.cpp#25736: enabling it \"lets the server spawn arbitrary local "
                           "processes, so it should not be used in untrusted environments\"",)),
    DangerousFlag("--rpc", "offloads to RPC servers, whose protocol is unauthenticated and whose reports "
                           "upstream resolves only in public, if at all",
                  ("ggml-org/llama.cpp#13061 (RPC is vulnerable \"to all sorts of attack vectors\"; "
                   "its reports skip the advisory process)",)),
    DangerousFlag("--slot-save-path", "lets clients save and restore KV cache slots as files on the host",
                  ("CVE-2026-43629 (state restore from the slot directory overflows the heap)",)),
    DangerousFlag("--sleep-idle-seconds", "unloads the model while HTTP handlers may still use it",
                  ("CVE-2026-43631, CVE-2026-43632 (use-after-free of the vocabulary)",)),
    DangerousFlag("--props", "lets any client change the server's global properties (POST /props)",
                  ("llama.cpp tools/server README: --props enables \"changing global properties via POST "
                   "/props (default: disabled)\"",)),
    DangerousFlag("--rerank", "serves /rerank, which a negative top_n fails (no fixed build)",
                  ("CVE-2026-52132 (through commit 97f06e9; the pinned build still has it)",),
                  aliases=("--reranking",), exposed_only=True),
)


def flag_name(line: str) -> str:
    """The flag of an arguments-file line (``--rpc host:port``, ``--rpc=host:port``): what the launcher passes
    as the option's name."""
    return line.split(" ", 1)[0].split("=", 1)[0]


def dangerous(name: str) -> DangerousFlag | None:
    return next((d for d in DANGEROUS if d.matches(name)), None)


def allowed_flags(value: Any, where: str) -> dict[str, str]:
    """``rigctl_allowed_server_flags`` as ``{flag: reason}``; ConfigError naming ``where`` and the entry."""
    known = {d.flag for d in DANGEROUS}
    return allowances(value, where, ALLOWED_VAR, known, what="flag", granted="allowed",
                      unknown=f"not a flag of the dangerous-flag policy ({', '.join(sorted(known))})")


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def refusal(flag: DangerousFlag, name: str, bind: str) -> str:
    """One line: why ``name`` (a spelling of ``flag``) is refused, what it cites, how to allow it."""
    exposed = f" on {bind}" if flag.exposed_only else ""
    cited = "; ".join([*flag.sources, *(f"advisory {a}" for a in flag.advisories()
                                        if not any(a in s for s in flag.sources))])
    return (f"{name}{exposed} {flag.why} ({cited}); allow it by naming {flag.flag} in {ALLOWED_VAR} "
            f"with the reason")


def server_refusals(flags: Iterable[str], bind: str, allowed: Mapping[str, str]) -> list[str]:
    """The refusals of one server's arguments-file lines listening on ``bind``."""
    out = []
    for line in flags:
        name = flag_name(line)
        flag = dangerous(name)
        if flag is None or flag.flag in allowed or (flag.exposed_only and _loopback(bind)):
            continue
        out.append(refusal(flag, name, bind))
    return out


def host_refusals(host: Any) -> list[tuple[str, str]]:
    """``(instance, refusal)`` for every dangerous flag ``host`` (an inventory Host) uses without allowing it;
    ConfigError when its allowances or profiles cannot be read."""
    allowed = allowed_flags(host.vars.get(ALLOWED_VAR), f"host {host.name}")
    return [(server.name, line) for server in host.servers
            for line in server_refusals(server.flags, server.bind, allowed)]


def refuse_dangerous_flags(hosts: Iterable[Any]) -> None:
    """ConfigError naming every host and instance whose arguments would carry a dangerous flag the inventory
    does not allow: what ``rigctl provision`` checks before a play could write it."""
    refusals = [f"host {host.name}: llama_server_instances.{instance}: {line}"
                for host in hosts for instance, line in host_refusals(host)]
    if refusals:
        raise ConfigError("; ".join(refusals))
