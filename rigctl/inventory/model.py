"""The inventory, read through Ansible's own loader, as typed views.

The inventory directory is the single source of truth for Ansible and rigctl alike: this module
never keeps a host list of its own. Host variables are merged exactly as Ansible merges them
(inventory file, group_vars, host_vars) and templated with Ansible's Templar, so a value such as
``"{{ rigctl_lab.dir }}/id_ed25519"`` reads the same here as in a play.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rigctl.errors import ConfigError

log = logging.getLogger(__name__)

#: Environment variable naming the inventory when none is given on the command line.
INVENTORY_ENV = "RIGCTL_INVENTORY"


@dataclass(frozen=True)
class Gpu:
    name: str
    vram_mib: int
    compute_capability: str
    bandwidth_gbs: float | None = None  # memory bandwidth, GB/s (10^9 bytes): the bound on decode speed

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
    user: str
    groups: tuple[str, ...]
    vars: Mapping[str, Any] = field(repr=False)

    # The typed views below check the value they read against inventory_check's schema (the one home
    # of what a valid value is) and raise ConfigError naming the host and key, never a bare KeyError.

    @property
    def port(self) -> int:
        return int(self._validated("ansible_port", 22))

    @property
    def gpu(self) -> Gpu | None:
        gpu = self._validated("gpu_host_gpu", None)
        if gpu is None:
            return None
        return Gpu(gpu.name, gpu.vram_mib, gpu.compute_capability, gpu.bandwidth_gbs)

    @property
    def llama_cpp(self) -> LlamaCppPin:
        source = self._validated("llama_cpp_source", None)
        if source is None:
            raise ConfigError(f"host {self.name}: llama_cpp_source: required but not set")
        version = str(self._validated("llama_cpp_version", ""))
        if not version:
            raise ConfigError(f"host {self.name}: llama_cpp_version: required but not set")
        if source == "git":
            repo = self._validated("llama_cpp_repo", None)
            if not repo:
                raise ConfigError(f"host {self.name}: llama_cpp_repo: required when llama_cpp_source is git")
            return LlamaCppPin("git", version, str(repo))
        archive = self._validated("llama_cpp_archive", None)
        if archive is None:
            raise ConfigError(f"host {self.name}: llama_cpp_archive: required when llama_cpp_source is archive")
        return LlamaCppPin("archive", version, str(archive.url or archive.path), archive.sha256)

    @property
    def servers(self) -> list[ServerInstance]:
        instances = self._validated("llama_server_instances", None) or {}
        return [ServerInstance(name=name, artifact=spec.artifact, profile=spec.profile, port=spec.port,
                               enabled=spec.enabled)
                for name, spec in sorted(instances.items())]

    def _validated(self, key: str, default: Any) -> Any:
        """``vars[key]`` parsed by its schema (``default`` when unset or null); ConfigError naming the key."""
        value = self.vars.get(key)
        if value is None:
            return default
        from rigctl.inventory.check import validate_value

        return validate_value(f"host {self.name}", key, value)

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

        check_yaml_files(path)
        _init_ansible_plugins(init_plugin_loader)
        loader = DataLoader()
        _set_vault_secrets(loader)
        try:
            with _ansible_warnings() as warnings:
                manager = InventoryManager(loader=loader, sources=[str(path)], parse=True)
                for name, group in (add_hosts or {}).items():
                    manager.add_group(group)
                    manager.add_host(name, group=group)
                if add_hosts:
                    manager.reconcile_inventory()  # a new group goes under 'all', as a parsed one would
                    manager.clear_caches()
            if not manager.get_hosts():
                reason = next((w for w in warnings if "Failed to parse" in w), None)
                raise ConfigError(f"inventory {path}: " + (reason or "no hosts (is it an Ansible inventory?)"))
            for warning in warnings:
                log.warning("inventory %s: %s", path, warning)
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


#: The inventory's own YAML files: the inventory file(s) and every group_vars/host_vars file.
_YAML_SUFFIXES = (".yml", ".yaml")


class _AnyTagLoader(yaml.SafeLoader):
    """Safe YAML that accepts Ansible's tags (!vault, !unsafe) without constructing them: only the syntax is checked."""


_AnyTagLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def check_yaml_files(source: Path) -> None:
    """ConfigError naming file, line and column for the first inventory YAML file that does not parse.

    Ansible tries each inventory plugin in turn and, when all fail, prints every plugin's complaint as a
    warning and then finds "no hosts": the one real cause (a tab, a bad indent) is lost in that noise."""
    files = [source] if source.is_file() else sorted(
        p for p in source.rglob("*") if p.is_file() and p.suffix in _YAML_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(source).parts))
    for path in files:
        if path.suffix not in _YAML_SUFFIXES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"inventory {path}: not UTF-8 text (byte {exc.start})") from None
        try:
            yaml.load(text, Loader=_AnyTagLoader)  # noqa: S506 (safe loader; tags are not constructed)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            what = " ".join(part for part in (exc.context, exc.problem) if part)
            hint = " (YAML indents with spaces, never tabs)" if r"'\t'" in (exc.problem or "") else ""
            raise ConfigError(f"inventory {where}: {what}{hint}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"inventory {path}: {_first_line(exc)}") from None


@contextlib.contextmanager
def _ansible_warnings() -> Iterator[list[str]]:
    """Ansible's inventory warnings, collected instead of printed: the caller turns them into one error
    (nothing parsed) or log records."""
    from ansible.inventory import manager

    collected: list[str] = []
    display = manager.display

    def warning(msg: str, *args: Any, **kwargs: Any) -> None:
        collected.append(_first_line(Exception(msg)))

    def error_as_warning(msg: str | None, exception: BaseException, *args: Any, **kwargs: Any) -> None:
        collected.append(f"{msg} {_first_line(exception)}" if msg else _first_line(exception))

    saved = display.warning, display.error_as_warning
    display.warning, display.error_as_warning = warning, error_as_warning
    try:
        yield collected
    finally:
        display.warning, display.error_as_warning = saved


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
