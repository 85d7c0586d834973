"""The lab as the inventory defines it (``rigctl_lab`` and the rigs), the names and addresses that follow
from it, and the checks that refuse a lab which would clash with itself or with this machine."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from rigctl.errors import ConfigError, LabError
from rigctl.inventory import Host
from rigctl.lab.gpu import GpuState, gpu_from_capture, gpu_seed, host_gpu_uuid

#: Marks the links the lab made (``ip link ... alias``), so it never touches a stranger's.
LINK_MARKER_PREFIX = "rigctl-lab:"


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


def check_lab_paths(config: LabConfig) -> None:
    """The lab and cache directories end up in overlayfs mount options, where , and : are separators."""
    for what, path in (("rigctl_lab.dir", config.dir), ("rigctl_cache_dir", config.cache_dir)):
        if not path.is_absolute() or any(c in str(path) for c in ",:"):
            raise LabError(f"{what} {path} must be an absolute path without ',' or ':'")


def render_etc_hosts(name: str, rigs: Sequence[RigSpec]) -> str:
    lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{name}", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{rig.address}\t{rig.name}" for rig in rigs]
    return "\n".join(lines) + "\n"


def known_hosts_lines(rig: RigSpec, public_keys: Sequence[str]) -> list[str]:
    """known_hosts entries for the rig's name and address, one per host key (``type base64``)."""
    address = rig.address if rig.port == 22 else f"[{rig.address}]:{rig.port}"
    names = f"{rig.name},{address}" if rig.port == 22 else f"[{rig.name}]:{rig.port},{address}"
    return [f"{names} {' '.join(key.split()[:2])}" for key in public_keys]


def config_from_hosts(hosts: Sequence[Host]) -> LabConfig:
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
        raise ConfigError(f"{first.name}: rigctl_lab.unenrolled must map rig names to {{address, gpus or capture}}")
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
    if not isinstance(spec, Mapping) or not spec.get("address") or (
            bool(spec.get("gpus")) == bool(spec.get("capture"))):
        raise ConfigError(f"{origin}: needs address and either gpus (a list of name, vram_mib, compute_capability) "
                          "or capture (one of the lab's recorded real nvidia-smi captures)")
    if spec.get("capture"):
        try:
            state = gpu_from_capture(str(spec["capture"]), host_gpu_uuid(name))
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {exc}") from None
        return RigSpec(name, str(spec["address"]), 22, "root", state, stranger=True, enrolled=False)
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


#: The most rigs one lab inventory gets: each rig is a booted systemd with sshd (and, provisioned, a
#: llama-server), and the machines this runs on have a few cores and tens of GiB.
MAX_RIGS = 32


def write_lab_inventory(source: Path, dest: Path, rigs: int) -> Path:
    """A copy of the lab inventory ``source`` at ``dest`` with ``rigs`` rigs: its own first, then ``rig3``,
    ``rig4``, ... each with the host variables (the stand-in GPU) of the rig two before it, at the next
    addresses of the lab's subnet. Comments in ``hosts.yml`` are not kept. ConfigError when ``dest`` exists,
    ``rigs`` is out of range or ``source`` is not laid out as ``inventory/lab`` is."""
    import shutil

    import yaml

    if not 1 <= rigs <= MAX_RIGS:
        raise ConfigError(f"--rigs: {rigs} is outside 1..{MAX_RIGS}")
    if dest.exists():
        raise ConfigError(f"{dest}: already exists; give a new directory")
    hosts_file = source / "hosts.yml"
    try:
        hosts = yaml.safe_load(hosts_file.read_text(encoding="utf-8"))
        lab = hosts["all"]["children"]["gpu_hosts"]["children"]["lab"]["hosts"]
        addresses = {name: str(spec["ansible_host"]) for name, spec in lab.items()}
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise ConfigError(f"{hosts_file}: not a lab inventory's hosts (all.children.gpu_hosts.children.lab."
                          f"hosts.NAME.ansible_host): {exc}") from None
    names = list(lab)
    if not names or any("." not in a for a in addresses.values()):
        raise ConfigError(f"{hosts_file}: the lab's rigs need addresses such as 10.213.0.11")
    prefix = addresses[names[0]].rsplit(".", 1)[0]
    taken = {int(a.rsplit(".", 1)[1]) for a in addresses.values() if a.rsplit(".", 1)[1].isdigit()}
    kept = names[:rigs]
    widened = {name: lab[name] for name in kept}
    free = (n for n in range(11, 255) if n not in taken)
    copies = []
    for number in range(len(kept) + 1, rigs + 1):
        like = names[(number - 1) % min(2, len(names))]
        name = f"rig{number}"
        widened[name] = {**lab[like], "ansible_host": f"{prefix}.{next(free)}"}
        copies.append((like, name))
    shutil.copytree(source, dest)
    hosts["all"]["children"]["gpu_hosts"]["children"]["lab"]["hosts"] = widened
    (dest / "hosts.yml").write_text("# The lab inventory with " + str(rigs) + " rigs (rigctl lab inventory).\n"
                                    + yaml.safe_dump(hosts, sort_keys=False), encoding="utf-8")
    for name in names[rigs:]:
        (dest / "host_vars" / f"{name}.yml").unlink(missing_ok=True)
    for like, name in copies:
        shutil.copy(source / "host_vars" / f"{like}.yml", dest / "host_vars" / f"{name}.yml")
    return dest

