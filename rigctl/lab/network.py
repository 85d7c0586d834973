"""The lab's network on this machine: one bridge with the lab's address, and per rig a network namespace whose
``eth0`` is a veth on that bridge. Names and MACs follow from the lab's config (:func:`rig_tag`,
:func:`veth_name`, :func:`lab_mac`); every link the lab makes carries its marker as alias, so removing one never
touches a stranger's.

The *fence* is an ``unreachable`` route for the lab network at the lowest priority, kept when the lab is down:
anything still aimed at a rig's address then fails at once instead of leaving this machine by its default route.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rigctl.errors import LabError
from rigctl.lab.config import LabConfig, RigSpec
from rigctl.lab.system import COMMAND_TIMEOUT_S, NETNS_DIR, link_exists, run_command

log = logging.getLogger(__name__)

IFNAME_MAX = 15
#: The fence route's metric: the lowest priority, so the bridge's own route for the network always wins.
FENCE_METRIC = 2**32 - 1


def fence(config: LabConfig) -> None:
    """The lab network unreachable whenever the bridge is not there (kept by ``down``)."""
    network = str(ipaddress.IPv4Interface(config.bridge_address).network)
    run_command(["ip", "route", "replace", "unreachable", network, "metric", str(FENCE_METRIC)],
                timeout=COMMAND_TIMEOUT_S)


def ensure_bridge(config: LabConfig) -> bool:
    """The bridge up with its address; True when this call made it."""
    bridge, marker = config.bridge, config.link_marker
    made = not link_exists(bridge)
    if made:
        log.info("lab: bridge %s %s", bridge, config.bridge_address)
        bridge_ip = str(ipaddress.IPv4Interface(config.bridge_address).ip)
        run_command(["ip", "link", "add", bridge, "address", lab_mac(bridge_ip), "type", "bridge"],
                    timeout=COMMAND_TIMEOUT_S)
        run_command(["ip", "link", "set", bridge, "alias", marker], timeout=COMMAND_TIMEOUT_S)
    run_command(["ip", "addr", "replace", config.bridge_address, "dev", bridge], timeout=COMMAND_TIMEOUT_S)
    run_command(["ip", "link", "set", bridge, "up"], timeout=COMMAND_TIMEOUT_S)
    return made


def remove_bridge(config: LabConfig) -> None:
    if link_exists(config.bridge, config.link_marker):
        log.info("lab: removing bridge %s", config.bridge)
        run_command(["ip", "link", "del", config.bridge], timeout=COMMAND_TIMEOUT_S)


def add_rig(config: LabConfig, rig: RigSpec) -> None:
    """The rig's namespace, its veth on the bridge, its address and its dead-end default route."""
    ns, veth = rig_tag(config.bridge, rig.name), veth_name(config.bridge, rig.name)
    prefix = ipaddress.IPv4Interface(config.bridge_address).network.prefixlen
    gateway = str(dead_end_gateway(config.bridge_address))
    mac = lab_mac(rig.address)
    for argv in (
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "address", mac, "netns", ns],
        ["ip", "link", "set", veth, "alias", config.link_marker],
        ["ip", "link", "set", veth, "master", config.bridge, "up"],
        ["ip", "-n", ns, "addr", "add", f"{rig.address}/{prefix}", "dev", "eth0"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "link", "set", "eth0", "up"],
        ["ip", "-n", ns, "route", "add", "default", "via", gateway, "dev", "eth0"],
    ):
        run_command(argv, timeout=COMMAND_TIMEOUT_S)


def remove_rig(config: LabConfig, rig: RigSpec) -> None:
    ns, veth = rig_tag(config.bridge, rig.name), veth_name(config.bridge, rig.name)
    if (NETNS_DIR / ns).exists():
        run_command(["ip", "netns", "del", ns], timeout=COMMAND_TIMEOUT_S)
    if link_exists(veth, config.link_marker):
        try:
            run_command(["ip", "link", "del", veth], timeout=COMMAND_TIMEOUT_S)
        except LabError:
            # The kernel removes a veth pair with its namespace, a moment after `ip netns del`
            # (or a killed nspawn): gone by the time we delete it is gone all the same.
            if link_exists(veth, config.link_marker):
                raise


def dead_end_gateway(bridge_address: str) -> ipaddress.IPv4Address:
    """The rigs' default gateway: the network's last host address, which nothing ever holds."""
    network = ipaddress.IPv4Interface(bridge_address).network
    return network.broadcast_address - 1


def check_lab_network(bridge: str, bridge_address: str, rigs: Sequence[RigSpec]) -> None:
    """Raise LabError unless the bridge and every rig address fit together."""
    try:
        interface = ipaddress.ip_interface(bridge_address)
    except ValueError:
        raise LabError(f"rigctl_lab.bridge_address {bridge_address!r} is not an address/prefix") from None
    if not isinstance(interface, ipaddress.IPv4Interface) or interface.network.prefixlen > 29:
        raise LabError(f"rigctl_lab.bridge_address {bridge_address} must be IPv4 with a prefix of /29 or wider")
    if len(bridge) > IFNAME_MAX:
        raise LabError(f"rigctl_lab.bridge {bridge!r} is longer than {IFNAME_MAX} characters")
    network = interface.network
    gateway = dead_end_gateway(bridge_address)
    reserved = {
        interface.ip: "the bridge's own address",
        gateway: "the rigs' dead-end gateway",
        network.network_address: "the network address",
        network.broadcast_address: "the broadcast address",
    }
    seen: dict[ipaddress.IPv4Address, str] = {}
    for rig in rigs:
        try:
            address = ipaddress.IPv4Address(rig.address)
        except ValueError:
            raise LabError(f"{rig.name}: ansible_host {rig.address!r} is not an IPv4 address") from None
        if address not in network:
            raise LabError(f"{rig.name}: address {address} is not inside the lab network {network} ({bridge})")
        if address in reserved:
            raise LabError(f"{rig.name}: address {address} is {reserved[address]}")
        if address in seen:
            raise LabError(f"{rig.name}: address {address} is also {seen[address]}'s")
        seen[address] = rig.name
        link = veth_name(bridge, rig.name)
        if len(link) > IFNAME_MAX:
            raise LabError(f"{rig.name}: rig name too long for a link name ({link!r} > {IFNAME_MAX})")


def find_host_conflicts(links: Sequence[Mapping[str, Any]], config: LabConfig) -> list[str]:
    """What on this machine (``ip -j -d addr show``) clashes with the lab; the lab's own links don't."""
    ours = {config.bridge, *(veth_name(config.bridge, r.name) for r in config.rigs)}
    network = ipaddress.IPv4Interface(config.bridge_address).network
    problems: list[str] = []
    for link in links:
        name = str(link.get("ifname", ""))
        marked = link.get("ifalias") == config.link_marker
        if name in ours and not marked:
            what = "the lab bridge" if name == config.bridge else "a lab link"
            problems.append(f"{name} ({what}'s name) is already used by an interface that is not this lab's")
            continue
        if name in ours:
            continue
        for addr in link.get("addr_info", []):
            if addr.get("family") != "inet":
                continue
            other = ipaddress.IPv4Interface(f"{addr['local']}/{addr['prefixlen']}")
            if other.network.overlaps(network):
                problems.append(f"address {other} on {name} overlaps the lab network {network}")
    return problems


def lab_mac(address: str) -> str:
    """A fixed, locally administered MAC for a lab address: a rig made again (or the bridge, whose MAC
    would otherwise follow its ports) keeps the MAC its neighbours have cached, so traffic does not
    stall until their ARP entries go stale."""
    return "02:72:" + ":".join(f"{octet:02x}" for octet in ipaddress.IPv4Address(address).packed)


def rig_tag(bridge: str, rig: str) -> str:
    """The rig's network namespace, cgroup and nspawn machine name; the bridge name makes it the lab's."""
    return f"{bridge}-{rig}"


def veth_name(bridge: str, rig: str) -> str:
    """The host side of the rig's veth. Link names are global and short: a tag of the bridge keeps two
    labs with the same rig names apart; the alias marks whose link it is."""
    return f"r{hashlib.sha256(bridge.encode()).hexdigest()[:3]}-{rig}"
