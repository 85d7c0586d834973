"""Drained hosts: out of campaigns, fan-out evals, benches and canaries, with a stated reason.

The drain lives in the inventory, as ``rigctl_drain`` in the host's ``host_vars/NAME.yml`` (written by the one
inventory writer, through :class:`rigctl.fleet.enroll.InventoryFiles`): a drain is the operator's decision about
the fleet, like a host's membership, so it is stated where the rest of the fleet is, reviewed and versioned
with it, read by every command before anything connects (a drained host is skipped without an SSH round trip,
and a host that is down can still be drained), held to the schema by ``inventory check``, and seen by plays
(a play may skip ``rigctl_drain`` hosts). Host-side state under /var/lib/rigctl would need a host that answers
to be read or changed, and each controller would find out only by asking every host first.

``rigctl_drain_policy: {unhealthy_gpu: ignore|drain|stop}`` drains a host whose GPU is unhealthy
(:mod:`rigctl.fleet.health`) when a reading finds it (:func:`apply_policy`: ``rigctl hosts health --apply``,
or the exporter with ``--apply-drain-policy``); ``stop`` also stops its servers, the others keep serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rigctl.errors import ConfigError, DrainedError
from rigctl.inventory import Host, Inventory
from rigctl.inventory.edit import OutsideText

log = logging.getLogger(__name__)

DRAIN_VAR = "rigctl_drain"
POLICY_VAR = "rigctl_drain_policy"
T = TypeVar("T")


@dataclass(frozen=True)
class Drain:
    host: str
    reason: str
    since: str  # UTC, ISO 8601
    by: str  # operator | policy


def host_drain(host: Host) -> Drain | None:
    """The host's drain; None when it is in service. ConfigError naming the host and key for a bad one."""
    from rigctl.inventory.schema import validate_value

    value = host.vars.get(DRAIN_VAR)
    if value is None:
        return None
    spec = validate_value(f"host {host.name}", DRAIN_VAR, value)
    return None if spec is None else Drain(host.name, spec.reason, spec.since, spec.by)


def unhealthy_gpu_policy(host: Host) -> str:
    """What an unhealthy GPU does to ``host``: ignore, drain or stop (``rigctl_drain_policy``)."""
    from rigctl.inventory.schema import validate_value

    value = host.vars.get(POLICY_VAR)
    return "ignore" if value is None else str(validate_value(f"host {host.name}", POLICY_VAR, value).unhealthy_gpu)


def check_reason(reason: str) -> str:
    """``--reason`` as the schema takes it; ConfigError naming the option otherwise."""
    from rigctl.inventory.schema import drain_reason

    try:
        return drain_reason(reason)
    except ValueError as exc:
        raise ConfigError(f"--reason: {exc}") from None


def drain(inventory: Inventory, name: str, reason: str, *, by: str = "operator") -> Drain:
    """Drain host ``name``: ``rigctl_drain`` written into its host_vars once the inventory it makes passes
    ``inventory check`` and the drain reads back (nothing is written otherwise). An existing drain is replaced."""
    from rigctl.fleet.deploy import roles_paths
    from rigctl.fleet.enroll import InventoryFiles

    inventory.host(name)  # ConfigError naming an unknown host, before anything is written
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    entry = {"reason": OutsideText(check_reason(reason)), "since": since, "by": by}
    files = InventoryFiles(inventory.source, roles_paths(), what=f"drain of {name}")
    files.update_host_vars(name, {DRAIN_VAR: entry})
    files.edit.commit(verify=lambda staged: _reads_back(staged, name))
    return Drain(name, entry["reason"], entry["since"], by)


def undrain(inventory: Inventory, name: str) -> Drain | None:
    """Put host ``name`` back in service; the drain it had (None: it had none, nothing is written)."""
    from rigctl.fleet.deploy import roles_paths
    from rigctl.fleet.enroll import InventoryFiles

    before = host_drain(inventory.host(name))
    if before is None:
        return None
    files = InventoryFiles(inventory.source, roles_paths(), what=f"undrain of {name}")
    files.remove_host_vars_keys(name, [DRAIN_VAR])
    files.edit.commit(verify=lambda staged: _reads_back(staged, name))
    return before


def _reads_back(staged: Inventory, name: str) -> None:
    host_drain(staged.host(name))  # ConfigError when the drain the edit leaves does not read as one


def admitted(items: Iterable[T], host_of: Callable[[T], Host | None], what: str) -> tuple[list[T], dict[str, str]]:
    """The items (targets, hosts, cells) whose host is in service, and {host: why it is skipped} for the rest,
    each skip logged: what campaigns, fan-out evals, benches and canaries run on."""
    kept: list[T] = []
    skipped: dict[str, str] = {}
    for item in items:
        host = host_of(item)
        found = host_drain(host) if host is not None else None
        if found is None:
            kept.append(item)
            continue
        if found.host not in skipped:
            skipped[found.host] = f"drained since {found.since} by {found.by}: {found.reason}"
            log.warning("%s: skipped by %s: %s", found.host, what, skipped[found.host])
    return kept, skipped


def refuse_drained(hosts: Sequence[Host], what: str) -> None:
    """DrainedError naming the drained host(s) of ``hosts`` and why: for what runs on one host alone (a bench,
    a canary), where skipping it would leave nothing to run."""
    _, skipped = admitted(hosts, lambda h: h, what)
    if skipped:
        raise DrainedError("; ".join(f"host {h} is drained ({why}); `rigctl hosts undrain {h}` puts it back"
                                    for h, why in skipped.items()))


class InService:
    """``inventory`` whose :meth:`host` refuses a drained host (DrainedError naming it and why): what a campaign
    runs its steps on, so a step on a drained host is skipped with the reason, the others run."""

    def __init__(self, inventory: Inventory, what: str):
        self._inventory, self._what = inventory, what

    def __getattr__(self, name: str) -> object:
        return getattr(self._inventory, name)

    def host(self, name: str) -> Host:
        host = self._inventory.host(name)
        refuse_drained([host], self._what)
        return host


def policy_drains(inventory: Inventory, problems: Mapping[str, list[str]]) -> dict[str, str]:
    """{host: policy} for each host with ``problems`` whose policy drains it and which is not drained yet."""
    out = {}
    for name, found in problems.items():
        host = inventory.hosts.get(name)
        if host is None or not found or host_drain(host) is not None:
            continue
        policy = unhealthy_gpu_policy(host)
        if policy != "ignore":
            out[name] = policy
    return out


def apply_policy(inventory: Inventory, problems: Mapping[str, list[str]]) -> dict[str, Drain]:
    """Drain each host :func:`policy_drains` names, its reason the GPU problems found (cut to fit); ``stop``
    also stops its servers. {host: the drain written}."""
    from rigctl.inventory.schema import MAX_DRAIN_REASON

    done = {}
    for name, policy in policy_drains(inventory, problems).items():
        reason = "unhealthy GPU: " + "; ".join(problems[name])
        reason = reason if len(reason) <= MAX_DRAIN_REASON else reason[:MAX_DRAIN_REASON - 3] + "..."
        done[name] = drain(inventory, name, _plain(reason), by="policy")
        if policy == "stop":
            from rigctl.fleet.servers import stop_servers

            stop_servers(inventory.host(name))
        log.warning("%s: drained by policy %s: %s", name, policy, reason)
    return done


def _plain(text: str) -> str:
    """A host's words (an Xid's text, a recovery action) as a reason: markup characters and controls dropped."""
    return "".join(ch if ch.isprintable() and ch not in "[]<>{}`" else " " for ch in text)
