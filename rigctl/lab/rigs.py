"""The local lab rigs: real Debian hosts on this machine for tests and ``make demo``.

Each rig named in the lab inventory (the hosts that set ``rigctl_lab``) is a systemd-nspawn container
booting systemd as PID 1, with sshd, python3 and the build tools, in its own network namespace whose
``eth0`` is a veth on a private bridge. The bridge has no NAT and each rig's default route points at a
gateway that does not exist, so a rig reaches this machine's bridge address and the other rigs, nothing
else. A stand-in ``nvidia-smi`` (``assets/nvidia-smi``) answers from a state file in each rig.

The machine may not run systemd as PID 1, so nspawn runs unregistered (``--register=no --keep-unit``)
in cgroups of its own, under a small supervisor (``assets/rig-supervisor``) that starts nspawn
again when the guest reboots.

Everything ``up`` makes is named after the rig and marked as the lab's, so ``down`` (and a failed
``up``) can remove exactly that, including what a crashed run left behind. One thing stays on
purpose: the *fence*, an ``unreachable`` route for the lab network at the lowest priority. While the
bridge is up its own route wins; once the lab is down, anything still aimed at a rig's address (a
bench, an SSH retry) fails at once with "No route to host" instead of leaving this machine by its
default route.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from rigctl.errors import ConfigError, LabError
from rigctl.files import write_atomically
from rigctl.inventory import Host, Inventory

log = logging.getLogger(__name__)

SUITE = "bookworm"
VARIANT = "minbase"
#: What a rig boots and is managed with (python3-apt: Ansible's apt module needs it and could not
#: fetch it later, rigs having no internet).
SYSTEM_PACKAGES: tuple[str, ...] = (
    *("systemd", "systemd-sysv", "dbus", "openssh-server", "sudo", "procps", "iproute2", "ca-certificates"),
    *("python3", "python3-apt"),
)
#: What a rig builds llama.cpp with; baked in for the same reason.
BUILD_PACKAGES: tuple[str, ...] = ("build-essential", "cmake", "git", "ccache", "python3-venv", "curl")
BASE_PACKAGES = SYSTEM_PACKAGES + BUILD_PACKAGES

#: Bump whenever the build changes what the image holds beyond its package list.
IMAGE_RECIPE_REVISION = 2

#: Host tool -> the Debian package that provides it.
REQUIRED_TOOLS: dict[str, str] = {
    "systemd-nspawn": "systemd-container",
    "debootstrap": "debootstrap",
    "ip": "iproute2",
    "ssh-keygen": "openssh-client",
    "ssh": "openssh-client",
    "zstd": "zstd",
    "tar": "tar",
    "mount": "mount",
    "nsenter": "util-linux",
}

APT_SOURCES_DIR = Path("/etc/apt/sources.list.d")
APT_SOURCES_LIST = Path("/etc/apt/sources.list")
NETNS_DIR = Path("/run/netns")
NSPAWN_RUNTIME_DIR = Path("/run/systemd/nspawn")
GPU_STATE_IN_RIG = Path("etc/rigctl-lab/gpu.json")
NVIDIA_SMI_IN_RIG = Path("usr/local/bin/nvidia-smi")
#: Written into each rig image: rigs resolve names only from /etc/hosts.
RIG_RESOLV_CONF = "# rigctl lab rig: no DNS; names come from /etc/hosts\n"
#: Marks the links the lab made (``ip link ... alias``), so it never touches a stranger's.
LINK_MARKER_PREFIX = "rigctl-lab:"
IFNAME_MAX = 15
DEFAULT_GPU_DRIVER_VERSION = "535.183.01"
DEFAULT_GPU_CUDA_VERSION = "12.2"
IDLE_GPU_TEMPERATURE_C = 35
#: The stand-in's clocks: a card at its boost clock with nothing holding it back.
DEFAULT_GPU_MAX_SM_MHZ = 1950
DEFAULT_GPU_MEM_MHZ = 7000
DEFAULT_GPU_POWER_W = 20.0
#: What one entry of ``clocks_sequence`` may set.
GPU_CLOCK_KEYS = {"clocks_sm_mhz": int, "clocks_mem_mhz": int, "power_draw_w": (int, float),
                  "clocks_event_reasons": int}
ADDITIONAL_GPU_FIELDS = frozenset({"name", "memory_total_mib", "compute_cap", "uuid", "pci_bus_id"})
#: A stranger rig's sshd: root logs in with its password, nothing else is set up.
STRANGER_SSHD_CONF = Path("etc/ssh/sshd_config.d/rigctl-lab-stranger.conf")
STRANGER_SSHD_SETTINGS = ("# rigctl lab: a host not enrolled yet, root with a password only\n"
                          "PermitRootLogin yes\nPasswordAuthentication yes\n")

DEBOOTSTRAP_TIMEOUT_S = 1800
PACK_TIMEOUT_S = 600
UNPACK_TIMEOUT_S = 300
COMMAND_TIMEOUT_S = 30
NSPAWN_START_TIMEOUT_S = 15
SSH_WAIT_TIMEOUT_S = 120
SYSTEM_RUNNING_TIMEOUT_S = 180
STATUS_SSH_TIMEOUT_S = 15
TCP_PROBE_TIMEOUT_S = 0.5
STOP_TIMEOUT_S = 30
KILL_TIMEOUT_S = 10
CGROUP_REMOVE_TIMEOUT_S = 5
REMOVE_TREE_TIMEOUT_S = 900
GPU_LOCK_TIMEOUT_S = 10
#: The fence route's metric: the lowest priority, so the bridge's own route for the network always wins.
FENCE_METRIC = 2**32 - 1
POLL_S = 0.1

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# Supervisors this process started, kept so their exit status is collected (no zombies) even when
# the lab that started them was a different Lab object.
_SUPERVISORS: dict[int, subprocess.Popen[bytes]] = {}


# ----------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class GpuState:
    """What the stand-in nvidia-smi of one rig reports (its JSON state file)."""

    name: str
    memory_total_mib: int
    compute_cap: str
    uuid: str
    driver_version: str = DEFAULT_GPU_DRIVER_VERSION
    cuda_version: str = DEFAULT_GPU_CUDA_VERSION
    temperature: int = IDLE_GPU_TEMPERATURE_C
    #: Each nvidia-smi call that reports the temperature takes the next value; the last one sticks.
    temperature_sequence: tuple[int, ...] = ()
    memory_used_mib: int = 0
    utilization_gpu: int = 0
    persistence_mode: bool = False
    pci_bus_id: str = "00000000:01:00.0"
    clocks_sm_mhz: int = DEFAULT_GPU_MAX_SM_MHZ
    clocks_max_sm_mhz: int = DEFAULT_GPU_MAX_SM_MHZ
    clocks_mem_mhz: int = DEFAULT_GPU_MEM_MHZ
    power_draw_w: float = DEFAULT_GPU_POWER_W
    #: NVML clock event reasons bitmask (0x40: HW thermal slowdown, 0x4: SW power cap, ...).
    clocks_event_reasons: int = 0
    #: Each nvidia-smi call that reports a clock, power or reasons field applies the next entry (a
    #: mapping of GPU_CLOCK_KEYS), which then sticks: how tests throttle a card in the middle of a cell.
    clocks_sequence: tuple[dict[str, Any], ...] = ()
    #: A rig with several GPUs: the second, third... (each its own name, memory_total_mib,
    #: compute_cap, uuid and pci_bus_id); what it does not say comes from the first.
    additional_gpus: tuple[Mapping[str, Any], ...] = ()

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["temperature_sequence"] = list(self.temperature_sequence)
        data["clocks_sequence"] = [dict(entry) for entry in self.clocks_sequence]
        data["additional_gpus"] = [dict(g) for g in self.additional_gpus]
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], origin: str) -> GpuState:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"{origin}: unknown GPU field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        values = dict(data)
        if "temperature_sequence" in values:
            values["temperature_sequence"] = tuple(values["temperature_sequence"] or ())
        if "clocks_sequence" in values:
            values["clocks_sequence"] = tuple(values["clocks_sequence"] or ())
        if isinstance(values.get("power_draw_w"), int) and not isinstance(values["power_draw_w"], bool):
            values["power_draw_w"] = float(values["power_draw_w"])
        if "additional_gpus" in values:
            values["additional_gpus"] = tuple(values["additional_gpus"] or ())
        try:
            state = cls(**values)
        except TypeError as exc:
            raise ConfigError(f"{origin}: {exc}") from None
        state.check(origin)
        return state

    def check(self, origin: str) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = {"int": int, "str": str, "bool": bool, "float": float}.get(str(f.type))
            if expected is not None and (type(value) is not expected):
                raise ConfigError(f"{origin}: GPU field {f.name} must be {f.type}, got {value!r}")
        if not all(type(t) is int for t in self.temperature_sequence):
            raise ConfigError(
                f"{origin}: temperature_sequence must hold whole degrees, got {self.temperature_sequence!r}"
            )
        for entry in self.clocks_sequence:
            if not isinstance(entry, dict) or not entry or not set(entry) <= set(GPU_CLOCK_KEYS) or any(
                    type(v) is bool or not isinstance(v, GPU_CLOCK_KEYS[k]) for k, v in entry.items()):
                raise ConfigError(f"{origin}: clocks_sequence entries must map some of "
                                  f"{', '.join(sorted(GPU_CLOCK_KEYS))} to numbers, got {entry!r}")
        if not 0 <= self.memory_used_mib <= self.memory_total_mib:
            raise ConfigError(f"{origin}: memory_used_mib {self.memory_used_mib} is outside 0..{self.memory_total_mib}")
        for number, extra in enumerate(self.additional_gpus, 1):
            if not isinstance(extra, Mapping) or set(extra) != ADDITIONAL_GPU_FIELDS:
                raise ConfigError(f"{origin}: additional_gpus[{number - 1}] must have exactly "
                                  f"{', '.join(sorted(ADDITIONAL_GPU_FIELDS))}")
            if type(extra["memory_total_mib"]) is not int or not all(
                type(extra[k]) is str for k in ADDITIONAL_GPU_FIELDS - {"memory_total_mib"}
            ):
                raise ConfigError(f"{origin}: additional_gpus[{number - 1}] has a value of the wrong type")


@dataclass(frozen=True)
class RigSpec:
    """One lab rig as the inventory defines it."""

    name: str
    address: str
    port: int
    user: str
    gpu: GpuState
    #: Listed in rigctl_lab.unenrolled: made as a host the fleet has never seen (root with a password,
    #: no key, no fleet user), for `rigctl hosts add` to enrol.
    stranger: bool = False
    #: In the inventory (a stranger is not until `hosts add`): the lab vouches for its host key and
    #: logs in with its key; until then it does neither.
    enrolled: bool = True


@dataclass(frozen=True)
class LabConfig:
    """The lab as the inventory defines it (``rigctl_lab`` and the rigs)."""

    dir: Path
    bridge: str
    bridge_address: str
    cache_dir: Path
    known_hosts: Path
    key_file: Path
    rigs: tuple[RigSpec, ...]
    #: The rigs' ccache directory (``llama_cpp_ccache_dir``), bound to :attr:`compiler_cache`; None: no bind.
    guest_ccache_dir: PurePosixPath | None = None

    @property
    def hosts_dir(self) -> Path:
        return self.dir / "hosts"

    @property
    def lock_file(self) -> Path:
        return self.dir / "lock"

    @property
    def link_marker(self) -> str:
        return f"{LINK_MARKER_PREFIX}{self.dir}"

    @property
    def image_dir(self) -> Path:
        return self.cache_dir / "lab"

    @property
    def compiler_cache(self) -> Path:
        """The controller's directory behind every rig's ccache, one per lab (rigs of one lab share it;
        another slot's compiles never move this lab's ccache counters)."""
        return self.cache_dir / "ccache" / self.dir.name


@dataclass(frozen=True)
class RigPaths:
    """Where one rig's files live on this machine."""

    dir: Path

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs"

    @property
    def upper(self) -> Path:
        """The rig's own changes over the shared base tree (overlayfs upper directory)."""
        return self.dir / "upper"

    @property
    def overlay_work(self) -> Path:
        return self.dir / "work"

    @property
    def supervisor_script(self) -> Path:
        return self.dir / "rig-supervisor"

    @property
    def supervisor_pid(self) -> Path:
        return self.dir / "supervisor.pid"

    @property
    def nspawn_pid(self) -> Path:
        return self.dir / "nspawn.pid"

    @property
    def stop_flag(self) -> Path:
        return self.dir / "stop"

    @property
    def console_log(self) -> Path:
        return self.dir / "console.log"

    @property
    def root_password(self) -> Path:
        """A stranger rig's root password (drawn when the rig is made; mode 0600)."""
        return self.dir / "root-password"


@dataclass(frozen=True)
class BaseImage:
    """The cached base root file system (a zstd tarball)."""

    path: Path
    size_bytes: int
    #: True when this call built it, False when it came from the cache.
    built: bool
    build_seconds: float = 0.0

    @property
    def tree(self) -> Path:
        """The unpacked image beside the tarball, shared read-only by every rig."""
        return self.path.with_name(self.path.name.removesuffix(".tar.zst") + ".rootfs")


@dataclass(frozen=True)
class RigStatus:
    """One rig as found now."""

    name: str
    address: str
    exists: bool
    supervisor_pid: int | None
    nspawn_pid: int | None
    sshd: bool
    #: ``systemctl is-system-running`` over SSH; None when SSH did not answer.
    systemd: str | None

    @property
    def running(self) -> bool:
        return self.supervisor_pid is not None and self.nspawn_pid is not None

    @property
    def ready(self) -> bool:
        """Booted and reachable: what ``up`` leaves every rig as."""
        return self.running and self.sshd and self.systemd in {"running", "degraded"}


# ----------------------------------------------------------------------------------------------- pure helpers


def apt_mirror(deb822_sources: Sequence[str], one_line_sources: str | None, suite: str = SUITE) -> str:
    """The Debian mirror from apt's configuration: the first deb822 ``URIs:`` (else the first ``deb``
    line of sources.list), preferring an entry that carries ``suite`` itself."""
    candidates: list[tuple[str, list[str]]] = []
    for text in deb822_sources:
        for stanza in _deb822_stanzas(text):
            if stanza.get("enabled", "yes").lower() == "no" or "deb" not in stanza.get("types", "").split():
                continue
            uris = stanza.get("uris", "").split()
            if uris:
                candidates.append((uris[0], stanza.get("suites", "").split()))
    for line in (one_line_sources or "").splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if words:
            candidates.append((words[0], words[1:2]))
    if not candidates:
        raise LabError(f"no Debian mirror found in {APT_SOURCES_DIR}/*.sources or {APT_SOURCES_LIST}")
    for uri, suites in candidates:
        if suite in suites:
            return uri
    return candidates[0][0]


def _deb822_stanzas(text: str) -> Iterator[dict[str, str]]:
    stanza: dict[str, str] = {}
    for line in text.splitlines() + [""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if stanza:
                yield stanza
            stanza = {}
        elif ":" in line and not line[0].isspace():
            key, value = line.split(":", 1)
            stanza[key.strip().lower()] = value.strip()


def image_file_name(suite: str, variant: str, packages: Sequence[str], revision: int) -> str:
    """The cached tarball's name, carrying the hash of what went into it."""
    recipe = "\n".join([suite, variant, str(revision), *sorted(packages)])
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    return f"{suite}-{variant}-{digest}.tar.zst"


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


def check_lab_paths(config: LabConfig) -> None:
    """The lab and cache directories end up in overlayfs mount options, where , and : are separators."""
    for what, path in (("rigctl_lab.dir", config.dir), ("rigctl_cache_dir", config.cache_dir)):
        if not path.is_absolute() or any(c in str(path) for c in ",:"):
            raise LabError(f"{what} {path} must be an absolute path without ',' or ':'")


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


def render_etc_hosts(name: str, rigs: Sequence[RigSpec]) -> str:
    lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{name}", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{rig.address}\t{rig.name}" for rig in rigs]
    return "\n".join(lines) + "\n"


def known_hosts_lines(rig: RigSpec, public_keys: Sequence[str]) -> list[str]:
    """known_hosts entries for the rig's name and address, one per host key (``type base64``)."""
    address = rig.address if rig.port == 22 else f"[{rig.address}]:{rig.port}"
    names = f"{rig.name},{address}" if rig.port == 22 else f"[{rig.name}]:{rig.port},{address}"
    return [f"{names} {' '.join(key.split()[:2])}" for key in public_keys]


def cgroup_roots(mountinfo: str) -> list[Path]:
    """Mount points of the hierarchies nspawn's guest needs a cgroup in: systemd's named v1
    hierarchy and the v2 (unified) one."""
    roots = []
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields = before.split()
        fstype, _source, *rest = after.split()
        options = rest[0].split(",") if rest else []
        if fstype == "cgroup2" or (fstype == "cgroup" and "name=systemd" in options):
            roots.append(Path(_unescape_mount_path(fields[4])))
    return roots


def mounts_under(mountinfo: str, path: Path) -> list[Path]:
    """Mount points at or below ``path``, deepest first."""
    found = []
    for line in mountinfo.splitlines():
        point = Path(_unescape_mount_path(line.split()[4]))
        if point == path or path in point.parents:
            found.append(point)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _unescape_mount_path(text: str) -> str:
    return text.encode().decode("unicode_escape") if "\\" in text else text


def rig_tag(bridge: str, rig: str) -> str:
    """The rig's network namespace, cgroup and nspawn machine name; the bridge name makes it the lab's."""
    return f"{bridge}-{rig}"


def veth_name(bridge: str, rig: str) -> str:
    """The host side of the rig's veth. Link names are global and short: a tag of the bridge keeps two
    labs with the same rig names apart; the alias marks whose link it is."""
    return f"r{hashlib.sha256(bridge.encode()).hexdigest()[:3]}-{rig}"


def gpu_seed(host: str, gpu: Mapping[str, Any]) -> GpuState:
    """The stand-in GPU's first state, from the host's ``gpu_host_gpu``."""
    origin = f"{host}: gpu_host_gpu"
    try:
        return GpuState.from_mapping(
            {
                "name": str(gpu["name"]),
                "memory_total_mib": int(gpu["vram_mib"]),
                "compute_cap": str(gpu["compute_capability"]),
                "uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'rigctl-lab:{host}')}",
                **{k: str(gpu[k]) for k in ("driver_version", "cuda_version") if k in gpu},
            },
            origin,
        )
    except KeyError as exc:
        raise ConfigError(f"{origin}: missing {exc.args[0]}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{origin}: {exc}") from None


# ----------------------------------------------------------------------------------------------- the lab


class Lab:
    """The lab rigs of one inventory: build the image, bring them up, report, tear down."""

    def __init__(self, config: LabConfig):
        self.config = config

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> Lab:
        hosts = [h for h in inventory.hosts.values() if h.vars.get("rigctl_lab")]
        if not hosts:
            raise ConfigError(f"inventory {inventory.source}: no lab rigs (no host sets rigctl_lab)")
        return cls(_config_from_hosts(hosts))

    # ------------------------------------------------------------------ public API

    def rig(self, name: str) -> RigSpec:
        for rig in self.config.rigs:
            if rig.name == name:
                return rig
        known = ", ".join(r.name for r in self.config.rigs)
        raise ConfigError(f"unknown lab rig {name!r} (lab rigs: {known})")

    def ssh_argv(self, name: str, command: str | Sequence[str] | None = None) -> list[str]:
        """The ``ssh`` command line for rig ``name`` (strict host keys, the lab key, no prompts)."""
        rig = self.rig(name)
        if not rig.enrolled:
            raise LabError(f"{name} is not enrolled yet: no key logs in "
                           f"(rigctl hosts add {name} {rig.address} --ask-pass)")
        argv = ["ssh", "-o", f"UserKnownHostsFile={self.config.known_hosts}", "-o", "StrictHostKeyChecking=yes"]
        argv += ["-o", "BatchMode=yes", "-i", str(self.config.key_file), "-o", "IdentitiesOnly=yes"]
        if rig.port != 22:
            argv += ["-p", str(rig.port)]
        argv.append(f"{rig.user}@{rig.address}")
        if command is not None:
            argv += ["--", command if isinstance(command, str) else shlex.join(command)]
        return argv

    def status(self) -> list[RigStatus]:
        return [self._rig_status(rig) for rig in self.config.rigs]

    def ensure_base_image(self) -> BaseImage:
        """The base image from the cache, built first when the cache has none."""
        self._preflight()
        with self._locked():
            return self._ensure_base_image()

    def up(self) -> list[RigStatus]:
        """Every rig booted and answering SSH; rigs already so are left exactly as they are."""
        started = time.monotonic()
        self._preflight()
        with self._locked():
            self._check_host_conflicts()
            self._fence()
            self._refresh_known_hosts()
            pending = [s.name for s in self.status() if not s.ready]
            pending = [name for name in pending if not self._recovers(self.rig(name))]
            if not pending:
                log.info("lab: all %d rigs already up", len(self.config.rigs))
                return self.status()
            self._bring_up([self.rig(name) for name in pending])
        log.info("lab: up in %.1fs", time.monotonic() - started)
        return self.status()

    @contextlib.contextmanager
    def up_while(self) -> Iterator[list[RigStatus]]:
        """The rigs up for the ``with`` block; left as found: taken down afterwards only when this brought
        them up (a developer's lab, or ``make demo``'s, stays up)."""
        was_up = all(rig.ready for rig in self.status())
        statuses = self.up()
        try:
            yield statuses
        finally:
            if not was_up:
                self.down()

    def down(self) -> None:
        """Stop every rig and remove all the lab made outside the cache but the fence; fine when nothing
        is up."""
        started = time.monotonic()
        _check_root()
        _check_tools(("ip",))
        with self._locked():
            self._fence()  # before the bridge goes: a lab brought up before the fence existed gets it too
            problems = self._remove_rigs(self.config.rigs)
            problems += _collect(self._remove_bridge, "bridge")
            problems += _collect(lambda: self.config.known_hosts.unlink(missing_ok=True), "known_hosts")
            problems += _collect(self._remove_shared_leftovers, "runtime directories")
        if problems:
            raise LabError(f"lab down left {len(problems)} problem(s); first: {problems[0]}")
        log.info("lab: down in %.1fs", time.monotonic() - started)

    def root_password(self, name: str) -> str:
        """The root password of stranger rig ``name`` (what its owner would hand you for first contact)."""
        rig = self.rig(name)
        if not rig.stranger:
            raise LabError(f"{name} is not a stranger rig (rigctl_lab.unenrolled); root logs in with the lab's key")
        try:
            return self._paths(rig).root_password.read_text().strip()
        except OSError as exc:
            raise LabError(f"{name}: no root password ({exc.strerror}); is the lab up?") from None

    def guest_run(self, name: str, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
        """stdout of ``argv`` run inside rig ``name`` without SSH (for tests: what did its sshd log?)."""
        return self._guest(self.rig(name), argv, timeout).stdout

    def remove(self, name: str) -> None:
        """Stop rig ``name`` and remove what it used; the other rigs and the bridge stay."""
        _check_root()
        with self._locked():
            problems = self._remove_rigs([self.rig(name)])
            problems += _collect(self._refresh_known_hosts, "known_hosts")
        if problems:
            raise LabError(f"removing {name} left {len(problems)} problem(s); first: {problems[0]}")

    def gpu_state(self, name: str) -> GpuState:
        path = self._gpu_state_path(self.rig(name))
        with _gpu_lock(path):
            return _read_gpu_state(path, name)

    def set_gpu(self, name: str, /, **fields: Any) -> GpuState:
        """Change what rig ``name``'s nvidia-smi reports (e.g. ``temperature_sequence=[80, 60, 40]``)."""
        path = self._gpu_state_path(self.rig(name))
        with _gpu_lock(path):
            current = dataclasses.asdict(_read_gpu_state(path, name))
            state = GpuState.from_mapping({**current, **fields}, f"{name}: set_gpu")
            write_atomically(path, state.to_json(), 0o644)
        log.info("%s: stand-in GPU set: %s", name, ", ".join(f"{k}={v!r}" for k, v in sorted(fields.items())))
        return state

    # ------------------------------------------------------------------ preflight and lock

    def _preflight(self) -> None:
        check_lab_network(self.config.bridge, self.config.bridge_address, self.config.rigs)
        check_lab_paths(self.config)
        _check_root()
        _check_tools(tuple(REQUIRED_TOOLS))

    def _check_host_conflicts(self) -> None:
        # -d: the details carry each link's alias, the lab's mark.
        links = json.loads(_run(["ip", "-j", "-d", "addr", "show"], timeout=COMMAND_TIMEOUT_S).stdout or "[]")
        problems = find_host_conflicts(links, self.config)
        if problems:
            raise LabError(problems[0])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.config.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.config.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise LabError(
                    f"lab {self.config.dir} is busy: another rigctl lab command (pid {holder}) holds "
                    f"{self.config.lock_file}"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            try:
                yield
            finally:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ base image

    @property
    def image_path(self) -> Path:
        return self.config.image_dir / image_file_name(SUITE, VARIANT, BASE_PACKAGES, IMAGE_RECIPE_REVISION)

    def _ensure_base_image(self) -> BaseImage:
        path = self.image_path
        if path.is_file():
            log.info("base image: %s (cached, %.0f MB)", path, path.stat().st_size / 1e6)
            return BaseImage(path, path.stat().st_size, built=False)
        return _build_base_image(path)

    # ------------------------------------------------------------------ up

    def _recovers(self, rig: RigSpec) -> bool:
        """A rig whose supervisor is alive may just be (re)booting: give it the chance to settle."""
        status = self._rig_status(rig)
        if status.supervisor_pid is None:
            return False
        log.info("%s: running but not ready (systemd %s); waiting for it", rig.name, status.systemd or "unknown")
        try:
            self._wait_ready(rig)
        except LabError as exc:
            log.warning("%s: %s; starting it afresh", rig.name, exc)
            return False
        return True

    def _bring_up(self, rigs: Sequence[RigSpec]) -> None:
        image = self._ensure_base_image()
        tree = _ensure_base_tree(image)
        public_key = self._ensure_key_pair()
        bridge_made = False
        try:
            self._remove_rigs(rigs, strict=True)
            bridge_made = self._ensure_bridge()
            with ThreadPoolExecutor(max_workers=len(rigs)) as pool:
                for future in [pool.submit(self._make_rootfs, rig, tree, public_key) for rig in rigs]:
                    future.result()
            for rig in rigs:
                with _step(rig.name, "network"):
                    self._make_network(rig)
                with _step(rig.name, "boot"):
                    self._boot(rig)
            self._refresh_known_hosts()
            for rig in rigs:
                self._wait_ready(rig, require_running=True)
        except BaseException as exc:
            log.error("lab up failed (%s); removing what it made", exc)
            self._remove_rigs(rigs)
            if bridge_made and not any(self._paths(r).dir.exists() for r in self.config.rigs):
                _collect(self._remove_bridge, "bridge")
            _collect(self._refresh_known_hosts, "known_hosts")
            _collect(self._remove_shared_leftovers, "runtime directories")
            raise

    def _ensure_key_pair(self) -> str:
        key = self.config.key_file
        if not key.is_file():
            log.info("lab: making the lab's SSH key pair %s", key)
            key.parent.mkdir(parents=True, exist_ok=True)
            _run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rigctl-lab", "-f", str(key)],
                timeout=COMMAND_TIMEOUT_S,
            )
        public = _run(["ssh-keygen", "-y", "-f", str(key)], timeout=COMMAND_TIMEOUT_S).stdout
        write_atomically(key.with_name(key.name + ".pub"), public, 0o644)
        return public

    def _fence(self) -> None:
        """The lab network unreachable whenever the bridge is not there (kept by ``down``)."""
        network = str(ipaddress.IPv4Interface(self.config.bridge_address).network)
        _run(["ip", "route", "replace", "unreachable", network, "metric", str(FENCE_METRIC)],
             timeout=COMMAND_TIMEOUT_S)

    def _ensure_bridge(self) -> bool:
        """The bridge up with its address; True when this call made it."""
        bridge, marker = self.config.bridge, self.config.link_marker
        made = not _link_exists(bridge)
        if made:
            log.info("lab: bridge %s %s", bridge, self.config.bridge_address)
            bridge_ip = str(ipaddress.IPv4Interface(self.config.bridge_address).ip)
            _run(
                ["ip", "link", "add", bridge, "address", lab_mac(bridge_ip), "type", "bridge"],
                timeout=COMMAND_TIMEOUT_S,
            )
            _run(["ip", "link", "set", bridge, "alias", marker], timeout=COMMAND_TIMEOUT_S)
        _run(["ip", "addr", "replace", self.config.bridge_address, "dev", bridge], timeout=COMMAND_TIMEOUT_S)
        _run(["ip", "link", "set", bridge, "up"], timeout=COMMAND_TIMEOUT_S)
        return made

    def _make_rootfs(self, rig: RigSpec, base_tree: Path, public_key: str) -> None:
        paths = self._paths(rig)
        with _step(rig.name, "overlay the base image"):
            for directory in (paths.upper, paths.overlay_work, paths.rootfs):
                directory.mkdir(parents=True)
            options = f"lowerdir={base_tree},upperdir={paths.upper},workdir={paths.overlay_work}"
            _run(["mount", "-t", "overlay", "overlay", "-o", options, str(paths.rootfs)], timeout=COMMAND_TIMEOUT_S)
        with _step(rig.name, "configure"):
            root = paths.rootfs
            _run(["ssh-keygen", "-A", "-f", str(root)], timeout=COMMAND_TIMEOUT_S)
            _write_file(root / "etc/hostname", f"{rig.name}\n", 0o644)
            _write_file(root / "etc/hosts", render_etc_hosts(rig.name, self.config.rigs), 0o644)
            if rig.stranger:
                self._make_stranger(rig, root)
            else:
                (root / "root/.ssh").mkdir(mode=0o700, exist_ok=True)
                _write_file(root / "root/.ssh/authorized_keys", public_key, 0o600)
            _write_file(root / NVIDIA_SMI_IN_RIG, _asset_text("nvidia-smi"), 0o755)
            (root / GPU_STATE_IN_RIG).parent.mkdir(parents=True, exist_ok=True)
            _write_file(root / GPU_STATE_IN_RIG, rig.gpu.to_json(), 0o644)

    def _make_stranger(self, rig: RigSpec, root: Path) -> None:
        """Root logs in with a fresh password only: no key, no fleet user."""
        password = secrets.token_urlsafe(18)
        paths = self._paths(rig)
        fd = os.open(paths.root_password, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        # chpasswd reads the password on stdin: never an argument.
        done = subprocess.run(["chroot", str(root), "chpasswd"], input=f"root:{password}\n", text=True,
                              capture_output=True, timeout=COMMAND_TIMEOUT_S)
        if done.returncode != 0:
            raise LabError(f"chpasswd exited {done.returncode}: {_last(done.stderr)}")
        _write_file(root / STRANGER_SSHD_CONF, STRANGER_SSHD_SETTINGS, 0o644)

    def _make_network(self, rig: RigSpec) -> None:
        ns, veth = self._tag(rig), veth_name(self.config.bridge, rig.name)
        prefix = ipaddress.IPv4Interface(self.config.bridge_address).network.prefixlen
        gateway = str(dead_end_gateway(self.config.bridge_address))
        mac = lab_mac(rig.address)
        for argv in (
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "address", mac, "netns", ns],
            ["ip", "link", "set", veth, "alias", self.config.link_marker],
            ["ip", "link", "set", veth, "master", self.config.bridge, "up"],
            ["ip", "-n", ns, "addr", "add", f"{rig.address}/{prefix}", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
            ["ip", "-n", ns, "route", "add", "default", "via", gateway, "dev", "eth0"],
        ):
            _run(argv, timeout=COMMAND_TIMEOUT_S)

    def _boot(self, rig: RigSpec) -> None:
        paths = self._paths(rig)
        cgroups = [root / self._tag(rig) for root in cgroup_roots(_read_mountinfo())]
        for cgroup in cgroups:
            cgroup.mkdir(exist_ok=True)
        _write_file(paths.supervisor_script, _asset_text("rig-supervisor"), 0o755)
        netns = NETNS_DIR / self._tag(rig)
        nspawn = [
            # nspawn mounts the guest's /sys in the network namespace it runs in; started outside the
            # rig's, the guest's /sys/class/net (and so Ansible's facts) would list this machine's links.
            "nsenter",
            f"--net={netns}",
            "--",
            "systemd-nspawn",
            "--quiet",
            "--boot",
            f"--directory={paths.rootfs}",
            f"--machine={self._tag(rig)}",
            # No systemd as this machine's PID 1: nothing to register with, no unit to move into.
            "--register=no",
            "--keep-unit",
            "--link-journal=no",
            "--console=read-only",
            "--resolv-conf=off",
            f"--network-namespace-path={netns}",
        ]
        if self.config.guest_ccache_dir is not None:
            self.config.compiler_cache.mkdir(parents=True, exist_ok=True, mode=0o755)
            nspawn.append(f"--bind={self.config.compiler_cache}:{self.config.guest_ccache_dir}")
        argv = [sys.executable, str(paths.supervisor_script), "--pid-file", str(paths.nspawn_pid)]
        argv += ["--stop-file", str(paths.stop_flag)]
        for cgroup in cgroups:
            argv += ["--cgroup", str(cgroup)]
        with open(paths.console_log, "ab") as console:
            supervisor = subprocess.Popen(
                [*argv, "--", *nspawn],
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        _SUPERVISORS[supervisor.pid] = supervisor
        _write_file(paths.supervisor_pid, f"{supervisor.pid}\n", 0o644)
        if (
            not _wait_until(lambda: paths.nspawn_pid.exists() or supervisor.poll() is not None, NSPAWN_START_TIMEOUT_S)
            or supervisor.poll() is not None
        ):
            raise LabError(f"systemd-nspawn did not start: {_console_tail(paths.console_log)}")
        log.info("%s: booting (supervisor pid %d)", rig.name, supervisor.pid)

    def _wait_ready(self, rig: RigSpec, require_running: bool = False) -> None:
        paths = self._paths(rig)
        with _step(rig.name, "wait for sshd"):
            deadline = time.monotonic() + SSH_WAIT_TIMEOUT_S
            while not (self._ssh_answers(rig) if rig.enrolled else _tcp_answers(rig.address, rig.port)):
                if _live_pid(paths.supervisor_pid, str(paths.supervisor_script)) is None:
                    raise LabError(f"the container stopped: {_console_tail(paths.console_log)}")
                if time.monotonic() > deadline:
                    self._remote(rig, "true", STATUS_SSH_TIMEOUT_S)  # raises with ssh's own reason
                    raise LabError(f"sshd did not answer on {rig.address}:{rig.port} within {SSH_WAIT_TIMEOUT_S}s")
                time.sleep(POLL_S)
        with _step(rig.name, "wait for systemd"):
            state = self._remote(rig, "systemctl is-system-running --wait", SYSTEM_RUNNING_TIMEOUT_S)
            if state == "running" or (state == "degraded" and not require_running):
                log.info("%s: up at %s (systemd %s)", rig.name, rig.address, state)
                return
            failed = self._remote(rig, "systemctl list-units --failed --plain --no-legend", STATUS_SSH_TIMEOUT_S)
            units = ", ".join(line.split()[0] for line in failed.splitlines() if line.strip()) or "none listed"
            raise LabError(f"systemd is {state or 'silent'} (failed units: {units})")

    def _ssh_answers(self, rig: RigSpec) -> bool:
        """sshd accepts a login (sshd may take TCP connections a moment before it can serve them)."""
        if not _tcp_answers(rig.address, rig.port):
            return False
        try:
            self._remote(rig, "true", STATUS_SSH_TIMEOUT_S)
        except LabError:
            return False
        return True

    def _remote(self, rig: RigSpec, command: str, timeout: float) -> str:
        """stdout of ``command`` on the rig over strict-key SSH, whatever its exit status; LabError when
        SSH itself fails. A rig not enrolled has no key to log in with: the command runs in its
        namespaces from here instead, for the lab's own checks."""
        if not rig.enrolled:
            return self._guest(rig, ["sh", "-c", command], timeout).stdout.strip()
        argv = self.ssh_argv(rig.name, command)
        argv[1:1] = ["-o", "ConnectTimeout=5"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise LabError(f"ssh {rig.user}@{rig.address} `{command}` ran past {timeout:.0f}s") from None
        ssh_failed = 255
        if done.returncode == ssh_failed:
            raise LabError(f"ssh {rig.user}@{rig.address}: {_last(done.stderr)}")
        return done.stdout.strip()

    def _refresh_known_hosts(self) -> None:
        """known_hosts as the rigs that exist now are: their real host keys, by name and address."""
        lines: list[str] = []
        for rig in self.config.rigs:
            if not rig.enrolled:  # first contact is `rigctl hosts add`'s to make
                continue
            keys = sorted((self._paths(rig).rootfs / "etc/ssh").glob("ssh_host_*_key.pub"))
            lines += known_hosts_lines(rig, [k.read_text() for k in keys])
        path = self.config.known_hosts
        text = "".join(f"{line}\n" for line in lines)
        if not lines:
            path.unlink(missing_ok=True)
        elif not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, text, 0o644)

    def _guest(self, rig: RigSpec, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the rig (its init's namespaces, by nsenter), whatever its exit status."""
        init = next((pid for pid in sorted(self._rig_pids(rig)) if _is_namespace_init(pid)), None)
        if init is None:
            raise LabError(f"{rig.name}: the container is not running")
        command = ["nsenter", f"--target={init}", "--mount", "--uts", "--ipc", "--net", "--pid", "--", *argv]
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise LabError(f"{rig.name}: `{shlex.join(argv)}` ran past {timeout:.0f}s") from None

    # ------------------------------------------------------------------ status

    def _paths(self, rig: RigSpec) -> RigPaths:
        return RigPaths(self.config.hosts_dir / rig.name)

    def _tag(self, rig: RigSpec) -> str:
        return rig_tag(self.config.bridge, rig.name)

    def _rig_status(self, rig: RigSpec) -> RigStatus:
        paths = self._paths(rig)
        supervisor = _live_pid(paths.supervisor_pid, str(paths.supervisor_script))
        nspawn = _live_pid(paths.nspawn_pid, f"--directory={paths.rootfs}")
        sshd = nspawn is not None and _tcp_answers(rig.address, rig.port)
        systemd = None
        if sshd:
            with contextlib.suppress(LabError):
                systemd = self._remote(rig, "systemctl is-system-running", STATUS_SSH_TIMEOUT_S) or None
        return RigStatus(rig.name, rig.address, paths.rootfs.is_dir(), supervisor, nspawn, sshd, systemd)

    # ------------------------------------------------------------------ down

    def _remove_rigs(self, rigs: Sequence[RigSpec], strict: bool = False) -> list[str]:
        """Stop and remove ``rigs``; the problems met (raised at once when ``strict``)."""
        halting = {rig.name: self._signal_stop(rig) for rig in rigs}
        problems: list[str] = []
        for rig in rigs:
            for step, action in (
                ("stop", lambda r: self._stop(r, halting[r.name])),
                ("cgroups", self._remove_cgroups),
                ("network", self._remove_network),
                ("nspawn runtime", self._remove_nspawn_runtime),
                ("files", lambda r: _remove_tree(self._paths(r).dir)),
            ):
                step_started = time.monotonic()
                problems += _collect(lambda action=action, rig=rig: action(rig), f"{rig.name}: {step}")
                log.debug("%s: %s took %.1fs", rig.name, step, time.monotonic() - step_started)
        if problems and strict:
            raise LabError(problems[0])
        return problems

    def _signal_stop(self, rig: RigSpec) -> bool:
        """Ask the guest to halt (nspawn turns SIGTERM into a clean shutdown); False when there is no
        nspawn or supervisor left to ask (nothing runs, or a crash orphaned the guest)."""
        paths = self._paths(rig)
        if paths.dir.is_dir():
            paths.stop_flag.touch()
        supervisor = _live_pid(paths.supervisor_pid, str(paths.supervisor_script))
        nspawn = _live_pid(paths.nspawn_pid, f"--directory={paths.rootfs}")
        target = nspawn or supervisor
        if target is not None:
            log.info("%s: stopping", rig.name)
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGTERM)
        return target is not None

    def _stop(self, rig: RigSpec, halting: bool) -> None:
        """Wait for the halt asked for; kill whatever is left (all of it when nothing could be asked,
        or when nspawn died without taking its guest along)."""
        if halting and not _wait_until(
            lambda: not self._rig_pids(rig) or not self._nspawn_or_supervisor_alive(rig), STOP_TIMEOUT_S
        ):
            log.warning("%s: did not halt within %ds; killing it", rig.name, STOP_TIMEOUT_S)
        leftover = self._rig_pids(rig)
        if not leftover:
            return
        log.info("%s: killing %d leftover process(es)", rig.name, len(leftover))
        if not _wait_until(lambda: _kill_all(self._rig_pids(rig)), KILL_TIMEOUT_S):
            raise LabError(f"processes {sorted(self._rig_pids(rig))} survived SIGKILL")

    def _nspawn_or_supervisor_alive(self, rig: RigSpec) -> bool:
        paths = self._paths(rig)
        return (
            _live_pid(paths.nspawn_pid, f"--directory={paths.rootfs}") is not None
            or _live_pid(paths.supervisor_pid, str(paths.supervisor_script)) is not None
        )

    def _rig_pids(self, rig: RigSpec) -> set[int]:
        """Live processes of the rig: those in its cgroups, and its supervisor and nspawn even
        outside them (a crash between starting and joining)."""
        paths = self._paths(rig)
        pids = set()
        for root in cgroup_roots(_read_mountinfo()):
            top = root / self._tag(rig)
            for directory, _dirs, _files in os.walk(top):
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in Path(directory, "cgroup.procs").read_text().split())
        pids.update(_pids_with_argument({str(paths.supervisor_script), f"--directory={paths.rootfs}"}))
        return {pid for pid in pids if _alive(pid)}

    def _remove_cgroups(self, rig: RigSpec) -> None:
        for root in cgroup_roots(_read_mountinfo()):
            top = root / self._tag(rig)
            if not top.is_dir():
                continue
            if not _wait_until(lambda top=top: _rmdir_tree(top), CGROUP_REMOVE_TIMEOUT_S):
                raise LabError(f"cannot remove cgroup {top}")

    def _remove_network(self, rig: RigSpec) -> None:
        ns, veth = self._tag(rig), veth_name(self.config.bridge, rig.name)
        if (NETNS_DIR / ns).exists():
            _run(["ip", "netns", "del", ns], timeout=COMMAND_TIMEOUT_S)
        if _link_exists(veth, self.config.link_marker):
            try:
                _run(["ip", "link", "del", veth], timeout=COMMAND_TIMEOUT_S)
            except LabError:
                # The kernel removes a veth pair with its namespace, a moment after `ip netns del`
                # (or a killed nspawn): gone by the time we delete it is gone all the same.
                if _link_exists(veth, self.config.link_marker):
                    raise

    def _remove_nspawn_runtime(self, rig: RigSpec) -> None:
        if NSPAWN_RUNTIME_DIR.is_dir():
            for leftover in NSPAWN_RUNTIME_DIR.glob(f"*/{self._tag(rig)}"):
                _remove_tree(leftover)

    def _remove_bridge(self) -> None:
        if _link_exists(self.config.bridge, self.config.link_marker):
            log.info("lab: removing bridge %s", self.config.bridge)
            _run(["ip", "link", "del", self.config.bridge], timeout=COMMAND_TIMEOUT_S)

    def _remove_shared_leftovers(self) -> None:
        """What rigs share once no rig needs it: the hosts directory, nspawn's and ip's runtime dirs."""
        with contextlib.suppress(OSError):
            self.config.hosts_dir.rmdir()
        _remove_empty_dirs_up_to(NSPAWN_RUNTIME_DIR, stop_at=NSPAWN_RUNTIME_DIR.parent)
        _release_netns_dir()

    def _gpu_state_path(self, rig: RigSpec) -> Path:
        rootfs = self._paths(rig).rootfs
        path = rootfs / GPU_STATE_IN_RIG
        if not path.is_file():
            raise LabError(f"{rig.name}: no stand-in GPU state at {path}; is the lab up? (rigctl lab up)")
        # The guest's root owns this tree: never follow a link it made out of it.
        for parent in [path, *path.parents]:
            if parent == rootfs:
                break
            if parent.is_symlink():
                raise LabError(f"{rig.name}: {parent} is a symlink; refusing to use it")
        return path


# ----------------------------------------------------------------------------------------------- config


def _config_from_hosts(hosts: Sequence[Host]) -> LabConfig:
    first = hosts[0]
    settings = first.vars["rigctl_lab"]
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{first.name}: rigctl_lab must be a mapping (dir, bridge, bridge_address)")
    for host in hosts[1:]:
        if host.vars["rigctl_lab"] != settings:
            raise ConfigError(f"{host.name}: rigctl_lab differs from {first.name}'s; the lab rigs share one lab")
    for key in ("dir", "bridge", "bridge_address"):
        if not settings.get(key):
            raise ConfigError(f"{first.name}: rigctl_lab.{key} is not set")
    lab_dir = Path(str(settings["dir"]))
    if not lab_dir.is_absolute():
        raise ConfigError(f"{first.name}: rigctl_lab.dir {lab_dir} must be an absolute path")
    expected_key = lab_dir / "id_ed25519"
    for host in hosts:
        if host.key_file != expected_key:
            raise ConfigError(
                f"{host.name}: ansible_ssh_private_key_file is {host.key_file}, but the lab's key is {expected_key}"
            )
        if host.known_hosts != first.known_hosts:
            raise ConfigError(f"{host.name}: rigctl_known_hosts differs from {first.name}'s")
    cache = first.vars.get("rigctl_cache_dir")
    if not cache:
        raise ConfigError(f"{first.name}: rigctl_cache_dir is not set")
    strangers = settings.get("unenrolled") or {}
    if not isinstance(strangers, Mapping):
        raise ConfigError(f"{first.name}: rigctl_lab.unenrolled must map rig names to {{address, gpus}}")
    rigs = []
    for host in hosts:
        if host.name in strangers:
            spec = _stranger(host.name, strangers[host.name])
            if spec.address != host.address:
                raise ConfigError(f"{host.name}: ansible_host {host.address} is not "
                                  f"rigctl_lab.unenrolled's {spec.address}")
            rigs.append(dataclasses.replace(spec, port=host.port, user=host.user, enrolled=True))
            continue
        gpu = host.vars.get("gpu_host_gpu")
        if not isinstance(gpu, Mapping):
            raise ConfigError(f"{host.name}: gpu_host_gpu is not set; the lab's stand-in nvidia-smi needs it")
        rigs.append(RigSpec(host.name, host.address, host.port, host.user, gpu_seed(host.name, gpu)))
    known = {host.name for host in hosts}
    rigs += [_stranger(name, spec) for name, spec in strangers.items() if name not in known]
    return LabConfig(
        dir=lab_dir,
        bridge=str(settings["bridge"]),
        bridge_address=str(settings["bridge_address"]),
        cache_dir=Path(os.path.expanduser(str(cache))),
        known_hosts=first.known_hosts,
        key_file=expected_key,
        rigs=tuple(rigs),
        guest_ccache_dir=_guest_ccache_dir(hosts),
    )


def _guest_ccache_dir(hosts: Sequence[Host]) -> PurePosixPath | None:
    """The rigs' ``llama_cpp_ccache_dir``, which the lab binds to its compiler cache; None when unset."""
    first = hosts[0]
    setting = first.vars.get("llama_cpp_ccache_dir")
    if setting is None:
        return None
    for host in hosts[1:]:
        if host.vars.get("llama_cpp_ccache_dir") != setting:
            raise ConfigError(f"{host.name}: llama_cpp_ccache_dir differs from {first.name}'s; "
                              "the lab binds one compiler cache into every rig")
    path = PurePosixPath(str(setting))
    # nspawn's --bind=SOURCE:DEST splits on ':'.
    if not path.is_absolute() or ":" in str(path):
        raise ConfigError(f"{first.name}: llama_cpp_ccache_dir {path} must be an absolute path without ':'")
    return path


def _stranger(name: str, spec: Any) -> RigSpec:
    """A rig of rigctl_lab.unenrolled: its address and GPUs (the first as the stand-in's main one)."""
    origin = f"rigctl_lab.unenrolled.{name}"
    if not isinstance(spec, Mapping) or not spec.get("address") or not spec.get("gpus"):
        raise ConfigError(f"{origin}: needs address and gpus (a list of name, vram_mib, compute_capability)")
    gpus = spec["gpus"]
    if not isinstance(gpus, Sequence) or not all(isinstance(g, Mapping) for g in gpus):
        raise ConfigError(f"{origin}.gpus: must be a list of GPUs (name, vram_mib, compute_capability)")
    first = gpu_seed(name, gpus[0])
    extra = []
    for index, gpu in enumerate(gpus[1:], 1):
        seed = gpu_seed(f"{name}-gpu{index}", gpu)
        extra.append({"name": seed.name, "memory_total_mib": seed.memory_total_mib, "compute_cap": seed.compute_cap,
                      "uuid": seed.uuid, "pci_bus_id": f"00000000:{index + 1:02x}:00.0"})
    state = GpuState.from_mapping({**dataclasses.asdict(first), "additional_gpus": extra}, origin)
    return RigSpec(name, str(spec["address"]), 22, "root", state, stranger=True, enrolled=False)


# ----------------------------------------------------------------------------------------------- base image


def _build_base_image(target: Path) -> BaseImage:
    started = time.monotonic()
    mirror = apt_mirror(
        [p.read_text() for p in sorted(APT_SOURCES_DIR.glob("*.sources"))],
        APT_SOURCES_LIST.read_text() if APT_SOURCES_LIST.is_file() else None,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_work(target.parent)
    workdir = Path(tempfile.mkdtemp(prefix=f".build-{os.getpid()}-", dir=target.parent))
    try:
        rootfs = workdir / "rootfs"
        log.info("base image: debootstrap %s (%s) from %s; takes minutes", SUITE, VARIANT, mirror)
        _debootstrap(rootfs, mirror, workdir / "debootstrap.log")
        log.info("base image: debootstrap done in %.0fs; trimming", time.monotonic() - started)
        _trim_image_rootfs(rootfs)
        partial = workdir / target.name
        log.info("base image: packing %s", target.name)
        _pack(rootfs, partial)
        os.replace(partial, target)
    finally:
        _remove_tree(workdir)
    seconds = time.monotonic() - started
    size = target.stat().st_size
    log.info("base image: built %s in %.0fs (%.0f MB)", target, seconds, size / 1e6)
    return BaseImage(target, size, built=True, build_seconds=seconds)


def _ensure_base_tree(image: BaseImage) -> Path:
    tree = image.tree
    if tree.is_dir():
        return tree
    with _step("base image", "unpack"):
        _remove_abandoned_work(image.path.parent)
        workdir = Path(tempfile.mkdtemp(prefix=f".unpack-{os.getpid()}-", dir=image.path.parent))
        try:
            staged = workdir / "rootfs"
            staged.mkdir()
            _unpack(image.path, staged)
            staged.rename(tree)
        finally:
            _remove_tree(workdir)
    _remove_unused_base_trees(keep=tree)
    return tree


def _remove_unused_base_trees(keep: Path) -> None:
    """Trees of older images that no rig's overlay still uses (their tarballs stay cached)."""
    mountinfo = _read_mountinfo()
    for tree in keep.parent.glob("*.rootfs"):
        if tree != keep and f"lowerdir={tree}" not in mountinfo:
            log.info("base image: removing the unused tree %s", tree)
            _remove_tree(tree)


def _remove_abandoned_work(image_dir: Path) -> None:
    """Build and unpack directories of a run that was killed (its pid is in the name and is gone)."""
    for leftover in [*image_dir.glob(".build-*"), *image_dir.glob(".unpack-*")]:
        pid = leftover.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            log.info("base image: removing the abandoned %s", leftover)
            _remove_tree(leftover)


def _debootstrap(rootfs: Path, mirror: str, log_path: Path) -> None:
    argv = ["debootstrap", f"--variant={VARIANT}", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(rootfs), mirror]
    with open(log_path, "wb") as out:
        try:
            done = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=DEBOOTSTRAP_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise LabError(f"base image: debootstrap ran past {DEBOOTSTRAP_TIMEOUT_S}s") from None
    if done.returncode != 0:
        lines = log_path.read_text(errors="replace").splitlines()
        errors = [line for line in lines if line.startswith("E:")] or lines or ["no output"]
        raise LabError(f"base image: debootstrap exited {done.returncode}: {errors[-1]}")


def _trim_image_rootfs(rootfs: Path) -> None:
    """What every rig gets anew (host keys, machine id) out, caches out, no DNS."""
    _run(["chroot", str(rootfs), "apt-get", "clean"], timeout=COMMAND_TIMEOUT_S * 4)
    for item in (rootfs / "var/lib/apt/lists").iterdir():
        if item.is_file() and item.name != "lock":
            item.unlink()
    for key in (rootfs / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    _write_file(rootfs / "etc/machine-id", "", 0o444)
    # dbus keeps a copy of its own; as a file it would give every rig the build's id.
    dbus_machine_id = rootfs / "var/lib/dbus/machine-id"
    if dbus_machine_id.parent.is_dir():
        dbus_machine_id.unlink(missing_ok=True)
        dbus_machine_id.symlink_to("/etc/machine-id")
    (rootfs / "etc/resolv.conf").unlink(missing_ok=True)
    _write_file(rootfs / "etc/resolv.conf", RIG_RESOLV_CONF, 0o644)


_TAR_OPTIONS = ["--numeric-owner", "--xattrs", "--xattrs-include=*"]


def _pack(rootfs: Path, out: Path) -> None:
    with open(out, "wb") as sink:
        _pipeline(
            ["tar", "-C", str(rootfs), *_TAR_OPTIONS, "-cf", "-", "."],
            ["zstd", "-q", "-T0", "-3"],
            sink,
            PACK_TIMEOUT_S,
        )


def _unpack(tarball: Path, rootfs: Path) -> None:
    _pipeline(
        ["zstd", "-dcq", str(tarball)],
        ["tar", "-C", str(rootfs), *_TAR_OPTIONS, "-xpf", "-"],
        subprocess.DEVNULL,
        UNPACK_TIMEOUT_S,
    )


def _pipeline(first: list[str], second: list[str], sink: Any, timeout: float) -> None:
    """``first | second > sink``; LabError naming the failed side."""
    deadline = time.monotonic() + timeout
    head = subprocess.Popen(first, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        tail = subprocess.Popen(second, stdin=head.stdout, stdout=sink, stderr=subprocess.PIPE)
    except BaseException:
        head.kill()
        head.wait()
        raise
    assert head.stdout is not None
    head.stdout.close()
    try:
        _, tail_err = tail.communicate(timeout=max(deadline - time.monotonic(), 1))
        _, head_err = head.communicate(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        for proc in (head, tail):
            proc.kill()
            proc.wait()
        raise LabError(f"`{first[0]} | {second[0]}` ran past {timeout:.0f}s") from None
    for proc, argv, err in ((head, first, head_err), (tail, second, tail_err)):
        if proc.returncode != 0:
            raise LabError(f"`{shlex.join(argv)}` exited {proc.returncode}: {_last(err.decode(errors='replace'))}")


# ----------------------------------------------------------------------------------------------- system helpers


def _check_root() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab rigs need root (network namespaces, systemd-nspawn, debootstrap); run as root")


def _check_tools(tools: Sequence[str]) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            raise LabError(f"{tool} not found; install the {REQUIRED_TOOLS[tool]} package")


def _run(argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LabError(f"`{shlex.join(argv)}` ran past {timeout:.0f}s") from None
    except FileNotFoundError:
        package = REQUIRED_TOOLS.get(argv[0])
        raise LabError(f"{argv[0]} not found" + (f"; install the {package} package" if package else "")) from None
    if done.returncode != 0:
        raise LabError(f"`{shlex.join(argv)}` exited {done.returncode}: {_last(done.stderr or done.stdout)}")
    return done


def _last(text: str) -> str:
    """The last non-empty line, without the terminal colours a guest's console carries."""
    lines = [_ANSI_ESCAPE.sub("", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    return lines[-1] if lines else "no output"


def _console_tail(path: Path) -> str:
    """The console's last line from nspawn or the guest (the supervisor's own notes say less)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"no {path.name}"
    return _last("\n".join(line for line in text.splitlines() if not line.startswith("rig-supervisor:")))


@contextlib.contextmanager
def _step(rig: str, step: str) -> Iterator[None]:
    """Names the rig and step in whatever goes wrong inside."""
    log.info("%s: %s", rig, step)
    try:
        yield
    except LabError as exc:
        raise LabError(f"{rig}: {step}: {exc}") from exc
    except (OSError, subprocess.SubprocessError) as exc:
        raise LabError(f"{rig}: {step}: {exc}") from exc


def _collect(action: Callable[[], object], what: str) -> list[str]:
    """Run one teardown step; its failure as a message, so the next steps still run."""
    try:
        action()
    except (LabError, OSError, subprocess.SubprocessError) as exc:
        log.warning("%s: %s", what, exc)
        return [f"{what}: {exc}"]
    return []


def _wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)


def _tcp_answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=TCP_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; collects it first if it is a supervisor this process started."""
    supervisor = _SUPERVISORS.get(pid)
    if supervisor is not None and supervisor.poll() is not None:
        del _SUPERVISORS[pid]
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # A zombie has exited; only its parent's wait (PID 1 reaps orphans late here) is missing.
    return stat.rpartition(")")[2].split()[0] not in {"Z", "X"}


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _live_pid(pid_file: Path, argument: str) -> int | None:
    """The pid in ``pid_file`` if that process runs and has ``argument`` on its command line (a
    recycled pid does not)."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) and argument in _cmdline(pid) else None


def _pids_with_argument(arguments: set[str]) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and arguments.intersection(_cmdline(int(entry.name))):
            found.add(int(entry.name))
    return found


def _kill_all(pids: set[int]) -> bool:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return not any(_alive(pid) for pid in pids)


def _rmdir_tree(top: Path) -> bool:
    """Remove an (empty of processes) cgroup tree; False while the kernel still holds part of it."""
    try:
        for directory, _dirs, _files in os.walk(top, topdown=False):
            os.rmdir(directory)
    except OSError:
        return False
    return True


def _read_mountinfo() -> str:
    return Path("/proc/self/mountinfo").read_text()


def _unmount_under(path: Path) -> None:
    for point in mounts_under(_read_mountinfo(), path):
        log.info("unmounting %s", point)
        try:
            _run(["umount", str(point)], timeout=COMMAND_TIMEOUT_S)
        except LabError:
            _run(["umount", "--lazy", str(point)], timeout=COMMAND_TIMEOUT_S)


def _remove_tree(path: Path) -> None:
    """Remove ``path`` without ever crossing into a mounted file system."""
    if not path.exists() and not path.is_symlink():
        return
    _unmount_under(path)
    _run(["rm", "-rf", "--one-file-system", "--", str(path)], timeout=REMOVE_TREE_TIMEOUT_S)


def _remove_empty_dirs_up_to(path: Path, stop_at: Path) -> None:
    if not path.is_dir():
        return
    for directory, _dirs, _files in os.walk(path, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(directory)
    while path != stop_at and path.is_dir():
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


def _release_netns_dir() -> None:
    """`ip netns add` makes /run/netns a mount point; once the last namespace is gone, undo that."""
    if not NETNS_DIR.is_dir() or any(NETNS_DIR.iterdir()):
        return
    _unmount_under(NETNS_DIR)
    with contextlib.suppress(OSError):
        NETNS_DIR.rmdir()


def _link_exists(name: str, marker: str | None = None) -> bool:
    """Whether link ``name`` exists (and, given ``marker``, carries it as its alias)."""
    done = subprocess.run(
        ["ip", "-j", "link", "show", "dev", name],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        return False
    links = json.loads(done.stdout or "[]")
    return bool(links) and (marker is None or links[0].get("ifalias") == marker)


def _write_file(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)




def _asset_text(name: str) -> str:
    return resources.files("rigctl.lab").joinpath("assets", name).read_text()


@contextlib.contextmanager
def _gpu_lock(state_path: Path) -> Iterator[None]:
    """The lock the stand-in nvidia-smi takes around its own read-modify-write of the state."""
    lock_path = f"{state_path}.lock"
    fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        if not _wait_until(lambda: _try_flock(fd), GPU_LOCK_TIMEOUT_S):
            raise LabError(f"{lock_path} stayed locked for {GPU_LOCK_TIMEOUT_S}s")
        yield
    finally:
        os.close(fd)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _is_namespace_init(pid: int) -> bool:
    """Whether ``pid`` is PID 1 of a PID namespace below this one (a container's init)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            ids = line.split()[1:]
            return len(ids) > 1 and ids[-1] == "1"
    return False


def _read_gpu_state(path: Path, rig: str) -> GpuState:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LabError(f"{rig}: cannot read the stand-in GPU state {path}: {exc}") from None
    return GpuState.from_mapping(data, f"{rig}: {path}")
