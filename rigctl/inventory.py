"""The inventory, read through Ansible's own loader, as typed views.

The inventory directory is the single source of truth for Ansible and rigctl alike: this module
never keeps a host list of its own. Host variables are merged exactly as Ansible merges them
(inventory file, group_vars, host_vars) and templated with Ansible's Templar, so a value such as
``"{{ rigctl_lab.dir }}/id_ed25519"`` reads the same here as in a play.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigctl.errors import ConfigError

log = logging.getLogger(__name__)

#: Environment variable naming the inventory when none is given on the command line.
INVENTORY_ENV = "RIGCTL_INVENTORY"


@dataclass(frozen=True)
class Gpu:
    name: str
    vram_mib: int
    compute_capability: str

    @property
    def cuda_arch(self) -> str:
        """CMake's CUDA architecture for this compute capability (8.6 -> 86)."""
        return self.compute_capability.replace(".", "")


@dataclass(frozen=True)
class LlamaCppPin:
    source: str  # "git" or "archive"
    version: str  # commit for git; build label (e.g. b11434) for an archive
    location: str  # repository URL, or archive URL/path
    sha256: str | None = None  # archives only

    def __str__(self) -> str:
        return f"{self.version} ({self.source})"


@dataclass(frozen=True)
class ServerInstance:
    name: str
    artifact: str
    profile: str
    port: int
    enabled: bool


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    port: int
    user: str
    groups: tuple[str, ...]
    vars: Mapping[str, Any] = field(repr=False)

    @property
    def gpu(self) -> Gpu | None:
        gpu = self.vars.get("gpu_host_gpu")
        if not isinstance(gpu, Mapping):
            return None
        return Gpu(str(gpu["name"]), int(gpu["vram_mib"]), str(gpu["compute_capability"]))

    @property
    def llama_cpp(self) -> LlamaCppPin:
        v = self.vars
        if v["llama_cpp_source"] == "git":
            return LlamaCppPin("git", str(v["llama_cpp_version"]), str(v["llama_cpp_repo"]))
        archive = v["llama_cpp_archive"]
        location = str(archive.get("url") or archive.get("path"))
        return LlamaCppPin("archive", str(v["llama_cpp_version"]), location, str(archive["sha256"]))

    @property
    def servers(self) -> list[ServerInstance]:
        return [
            ServerInstance(
                name=name,
                artifact=str(spec["artifact"]),
                profile=str(spec["profile"]),
                port=int(spec["port"]),
                enabled=bool(spec.get("enabled", True)),
            )
            for name, spec in sorted((self.vars.get("llama_server_instances") or {}).items())
        ]

    @property
    def known_hosts(self) -> Path:
        return Path(os.path.expanduser(str(self.vars.get("rigctl_known_hosts", "~/.ssh/known_hosts"))))

    @property
    def key_file(self) -> Path | None:
        key = self.vars.get("ansible_ssh_private_key_file") or self.vars.get("ansible_private_key_file")
        return Path(os.path.expanduser(str(key))) if key else None


def default_source(start: Path | None = None) -> Path:
    """The inventory to use when none is named: $RIGCTL_INVENTORY, else ansible.cfg's default."""
    env = os.environ.get(INVENTORY_ENV)
    if env:
        return Path(env)
    from ansible.config.manager import ConfigManager  # Ansible's own lookup of ansible.cfg

    cfg_sources = ConfigManager().get_config_value("DEFAULT_HOST_LIST")
    existing = [Path(p) for p in cfg_sources if Path(p).exists()]
    if not existing:
        raise ConfigError(
            f"no inventory given and none found (ansible.cfg's inventory: {', '.join(cfg_sources)}); "
            f"pass -i or set {INVENTORY_ENV}"
        )
    return existing[0]


def _plain(value: Any) -> Any:
    """Ansible's tagged containers and strings as plain Python values."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool | type(None)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    return value


# Variables Ansible itself sets per host; rigctl has no use for them in Host.vars.
_MAGIC_VARS = {"groups", "group_names", "inventory_hostname", "inventory_hostname_short", "omit",
               "playbook_dir", "ansible_playbook_python", "ansible_config_file", "ansible_version",
               "ansible_check_mode", "ansible_diff_mode", "ansible_forks", "ansible_inventory_sources",
               "ansible_skip_tags", "ansible_run_tags", "ansible_verbosity", "hostvars", "environment"}


@dataclass
class Inventory:
    """Hosts of one inventory source, merged and templated as Ansible does."""

    source: Path
    hosts: dict[str, Host]
    #: Variables defined on each group (and host) itself, to name where a bad key lives.
    own_vars: dict[str, dict[str, Any]] = field(repr=False, default_factory=dict)
    group_parents: dict[str, list[str]] = field(repr=False, default_factory=dict)

    @classmethod
    def load(cls, source: str | os.PathLike[str] | None = None, *,
             add_hosts: Mapping[str, str] | None = None) -> Inventory:
        """Load ``source``; ``add_hosts`` ({host: group}) adds hosts in memory only, to see the variables
        a host would get there before the files say so."""
        path = Path(source) if source is not None else default_source()
        if not path.exists():
            raise ConfigError(f"inventory {path}: no such file or directory")
        from ansible.errors import AnsibleError
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader
        from ansible.plugins.loader import init_plugin_loader
        from ansible.template import Templar
        from ansible.vars.manager import VariableManager
        from ansible.vars.plugins import get_vars_from_inventory_sources

        _init_ansible_plugins(init_plugin_loader)
        loader = DataLoader()
        _set_vault_secrets(loader)
        try:
            manager = InventoryManager(loader=loader, sources=[str(path)], parse=True)
            for name, group in (add_hosts or {}).items():
                manager.add_group(group)
                manager.add_host(name, group=group)
            if add_hosts:
                manager.reconcile_inventory()  # a new group goes under 'all', as a parsed one would
                manager.clear_caches()
            if not manager.get_hosts():
                raise ConfigError(f"inventory {path}: no hosts (is it an Ansible inventory?)")
            variables = VariableManager(loader=loader, inventory=manager)
            hosts: dict[str, Host] = {}
            for ahost in manager.get_hosts():
                raw = variables.get_vars(host=ahost, include_hostvars=False)
                templar = Templar(loader=loader, variables=raw)
                merged = {}
                for key, value in raw.items():
                    if key in _MAGIC_VARS:
                        continue
                    try:
                        merged[key] = _plain(templar.template(value))
                    except AnsibleError as exc:
                        raise ConfigError(f"host {ahost.name}: {key}: {_first_line(exc)}") from None
                groups = tuple(g.name for g in ahost.get_groups())
                hosts[ahost.name] = Host(
                    name=ahost.name,
                    address=str(merged.get("ansible_host", ahost.name)),
                    port=int(merged.get("ansible_port", 22)),
                    user=str(merged.get("ansible_user", "root")),
                    groups=groups,
                    vars=merged,
                )
            own_vars: dict[str, dict[str, Any]] = {}
            parents: dict[str, list[str]] = {}
            for group in manager.groups.values():
                own = dict(group.get_vars())
                own.update(get_vars_from_inventory_sources(loader, [str(path)], [group], "task"))
                own_vars[f"group {group.name}"] = own
                parents[group.name] = [p.name for p in group.parent_groups]
            for ahost in manager.get_hosts():
                own = dict(ahost.get_vars())
                own.update(get_vars_from_inventory_sources(loader, [str(path)], [ahost], "task"))
                own_vars[f"host {ahost.name}"] = own
        except AnsibleError as exc:
            raise ConfigError(f"inventory {path}: {_first_line(exc)}") from None
        log.debug("loaded %d hosts from %s", len(hosts), path)
        return cls(source=path, hosts=hosts, own_vars=own_vars, group_parents=parents)

    def select(self, limit: str | Iterable[str] | None = None) -> list[Host]:
        """Hosts named by ``limit`` (names or group names, comma-separated); all when None."""
        if limit is None:
            return list(self.hosts.values())
        names = [n.strip() for n in (limit.split(",") if isinstance(limit, str) else limit) if n.strip()]
        chosen: dict[str, Host] = {}
        for name in names:
            if name in self.hosts:
                chosen[name] = self.hosts[name]
                continue
            members = [h for h in self.hosts.values() if name in h.groups]
            if not members:
                known = ", ".join(sorted(self.hosts))
                raise ConfigError(f"unknown host or group {name!r} in --limit (hosts: {known})")
            chosen.update((h.name, h) for h in members)
        return list(chosen.values())

    def host(self, name: str) -> Host:
        if name not in self.hosts:
            raise ConfigError(f"unknown host {name!r} (hosts: {', '.join(sorted(self.hosts))})")
        return self.hosts[name]

    def origin(self, host: Host, key: str) -> str:
        """Where ``key`` for ``host`` is defined: ``host NAME`` or the nearest ``group NAME``."""
        if key in self.own_vars.get(f"host {host.name}", {}):
            return f"host {host.name}"
        for group in self._groups_nearest_first(host):
            if key in self.own_vars.get(f"group {group}", {}):
                return f"group {group}"
        return f"host {host.name}"

    def _groups_nearest_first(self, host: Host) -> list[str]:
        def depth(group: str) -> int:
            parents = self.group_parents.get(group, [])
            return 1 + max((depth(p) for p in parents), default=-1)

        return sorted(host.groups, key=depth, reverse=True)


_plugins_ready = False


def _init_ansible_plugins(init_plugin_loader: Any) -> None:
    # Lookups such as ansible.builtin.env resolve through the collection loader, which Ansible's
    # own CLIs set up once per process.
    global _plugins_ready
    if not _plugins_ready:
        init_plugin_loader()
        _plugins_ready = True


def _set_vault_secrets(loader: Any) -> None:
    """Vault-encrypted values (API keys, Hugging Face tokens) decrypt with the password file Ansible itself
    would use: $ANSIBLE_VAULT_PASSWORD_FILE, else ansible.cfg's vault_password_file / vault_identity_list.
    Never prompts; without a password, an encrypted value fails to load naming its key."""
    from ansible import constants
    from ansible.cli import CLI
    from ansible.errors import AnsibleError
    from ansible.parsing.vault import VaultSecretsContext

    password_file = os.environ.get("ANSIBLE_VAULT_PASSWORD_FILE") or constants.DEFAULT_VAULT_PASSWORD_FILE
    identities = list(constants.DEFAULT_VAULT_IDENTITY_LIST or [])
    if not password_file and not identities:
        return
    try:
        secrets = CLI.setup_vault_secrets(loader, vault_ids=identities,
                                          vault_password_files=[password_file] if password_file else [],
                                          ask_vault_pass=False, auto_prompt=False, initialize_context=False)
    except AnsibleError as exc:
        raise ConfigError(f"vault password {password_file or identities}: {_first_line(exc)}") from None
    loader.set_vault_secrets(secrets)
    # Templating decrypts through one process-wide context, which can be initialised only once:
    # later loads (another inventory, another password file) add their secrets to it.
    context = VaultSecretsContext.current(optional=True)
    if context is None:
        VaultSecretsContext.initialize(VaultSecretsContext(list(secrets)))
    else:
        context.secrets.extend(secret for secret in secrets if secret not in context.secrets)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


HEX_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
FULL_COMMIT = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
