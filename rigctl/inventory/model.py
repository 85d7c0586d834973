"""The inventory, read through Ansible's own loader, as typed views.

The inventory directory is the single source of truth for Ansible and rigctl alike: this module
never keeps a host list of its own. Host variables are merged exactly as Ansible merges them
(inventory file, group_vars, host_vars) and templated with Ansible's Templar, so a value such as
``"{{ rigctl_lab.dir }}/id_ed25519"`` reads the same here as in a play. The facts a probe writes
(:data:`rigctl.inventory.keys.PROBED_KEYS`) are the exception: they are what a host said, read as the text they
are and never templated, even in a file written before rigctl tagged them ``!unsafe``.
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

import rigctl.inventory.profiles as profiles
from rigctl.errors import ConfigError
from rigctl.hostside import sandbox
from rigctl.inventory.keys import PROBED_KEYS

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


#: The llama_server and models roles' defaults that rigctl's views fall back to where the inventory sets
#: nothing (roles/llama_server/defaults/main.yml, roles/models/defaults/main.yml; a unit test holds these
#: to those files).
LLAMA_SERVER_CONFIG_DIR = "/etc/llama-server"
MODELS_DIR = "/var/lib/rigctl/models"
SERVICE_USER = "llama"


@dataclass(frozen=True)
class Profile:
    """A llama_server profile as one host serves it: the ``extends`` chain merged and the host's
    ``llama_server_profile_overrides`` on top (:func:`rigctl.inventory.profiles.resolve_profile`)."""

    name: str
    settings: Mapping[str, Any]

    @property
    def ctx_size(self) -> int | None:
        value = self.settings.get("ctx_size")
        return None if value is None else int(value)

    @property
    def spec(self) -> Mapping[str, Any] | None:
        """The speculative-decoding block; None when the profile does not draft."""
        return self.settings.get("spec") or None


@dataclass(frozen=True)
class Artifact:
    """A model artifact as the models role names it: ``<models_dir>/<name>.gguf`` on the host, its
    manifest beside it, and the inventory's pin (models_pins) when there is one."""

    name: str
    path: str
    pin: str | None = None

    @property
    def manifest_path(self) -> str:
        return f"{self.path}.manifest.json"


@dataclass(frozen=True)
class ServiceAccount:
    """The account llama-server, rigctl's jobs and the bench's probes run as on one host, with the GPU access
    its units get: the llama_server role's ``llama_server_user``/``_group`` (the gpu_host role's
    ``gpu_host_user``/``_group`` by default), ``llama_server_supplementary_groups`` and
    ``llama_server_device_allow``."""

    user: str
    group: str
    supplementary_groups: tuple[str, ...] = sandbox.SUPPLEMENTARY_GROUPS
    device_allow: tuple[str, ...] = sandbox.DEVICE_ALLOW

    def unit_properties(self, read_write: Iterable[str] = ()) -> list[str]:
        """The ``llama-server@`` unit's account and hardening as ``Key=value`` lines (what ``systemd-run -p``
        takes), writable only ``read_write``."""
        account = [f"User={self.user}", f"Group={self.group}"]
        if self.supplementary_groups:
            account.append("SupplementaryGroups=" + " ".join(self.supplementary_groups))
        return account + sandbox.properties(list(read_write), self.device_allow)


@dataclass(frozen=True)
class Server:
    """One llama_server instance of one host, with everything the role derives for it (the plan of
    :func:`rigctl.inventory.profiles.instance_plan`): the one view every consumer takes."""

    host: str  # inventory host name
    name: str
    artifact: str  # the artifact's name, as llama_server_instances gives it
    profile: Profile
    port: int
    enabled: bool
    gpu: int | str | None  # gpu_host_gpus index or MIG instance UUID, pinned with CUDA_VISIBLE_DEVICES
    model: Artifact  # what it loads
    draft_model: Artifact | None  # the drafter it loads with -md
    address: str  # where the controller reaches the host
    bind: str  # the address the server listens on (loopback: reached through SSH, rigctl.forward.server_endpoint)
    flags: tuple[str, ...]  # the arguments file's lines, as the role writes them
    config_dir: str
    models_dir: str
    account: ServiceAccount  # the account the unit runs as, with its GPU access
    bind_address: str = ""  # the host's llama_server_bind_address ("" keeps the profile's host)
    api_key: str | None = field(default=None, repr=False)

    @property
    def unit(self) -> str:
        return profiles.unit_name(self.name)

    @property
    def user(self) -> str:
        return self.account.user

    @property
    def group(self) -> str:
        return self.account.group

    @property
    def args_file(self) -> str:
        return profiles.instance_file(self.config_dir, self.name, "args")

    @property
    def binary(self) -> str:
        """The link to the build's llama-server that the unit execs."""
        return profiles.instance_file(self.config_dir, self.name, "bin")

    @property
    def env_file(self) -> str:
        """The unit's EnvironmentFile: the GPU pin (CUDA_VISIBLE_DEVICES)."""
        return profiles.instance_file(self.config_dir, self.name, "env")

    @property
    def key_file(self) -> str | None:
        """The API key file the server reads (--api-key-file); None when the host has no key."""
        return profiles.key_file(self.config_dir) if self.api_key else None

    @property
    def argv(self) -> list[str]:
        """The arguments llama-server gets from the arguments file (the launcher's split)."""
        return profiles.args_lines_to_argv(list(self.flags))

    def argv_with(self, *, port: int | None = None, **settings: Any) -> list[str]:
        """:attr:`argv` with ``settings`` over the profile (``ctx_size=4096``) and another ``port``: what a
        probe of this instance runs, rendered by the role's own flag function."""
        lines = profiles.instance_flags(profiles.merge(self.profile.settings, settings), artifact=self.artifact,
                                        port=self.port if port is None else port, models_dir=self.models_dir,
                                        config_dir=self.config_dir, bind_address=self.bind_address,
                                        api_key=bool(self.api_key))
        return profiles.args_lines_to_argv(lines)


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
    def gpu_indexes(self) -> dict[int, bool]:
        """The host's GPUs as nvidia-smi indexes them, each with whether MIG is on (its instances listed)."""
        gpus = self._validated("gpu_host_gpus", None)
        if gpus:
            return {g.index: bool(g.mig) for g in gpus}
        first = self._validated("gpu_host_gpu", None)
        return {0: bool(first.mig)} if first is not None else {}

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
    def servers(self) -> list[Server]:
        """Every llama_server instance of this host, in name order, as the role plans it."""
        instances = self._validated("llama_server_instances", None) or {}
        if not instances:
            return []
        self._validated("llama_server_profiles", None)
        self._validated("llama_server_profile_overrides", None)
        models_dir = str(self.vars.get("llama_server_models_dir") or self.vars.get("models_dir") or MODELS_DIR)
        config_dir = str(self.vars.get("llama_server_config_dir") or LLAMA_SERVER_CONFIG_DIR)
        bind_address = str(self.vars.get("llama_server_bind_address") or "")
        api_key = str(self.vars.get("llama_server_api_key") or "") or None
        try:
            # The raw values, as the role sees them: the plan is the role's, byte for byte.
            plans = profiles.host_plan(self.vars.get("llama_server_instances"),
                                       self.vars.get("llama_server_profiles") or {},
                                       self.vars.get("llama_server_profile_overrides") or {},
                                       models_dir=models_dir, config_dir=config_dir, bind_address=bind_address,
                                       api_key=bool(api_key))
        except profiles.ProfileError as exc:
            raise ConfigError(f"host {self.name}: {exc}") from None
        pins = self.pins
        account = self.service_account
        out = []
        for plan in plans:
            spec = plan["profile"].get("spec") or {}
            draft = str(spec["draft_model"]) if spec.get("draft_model") else None
            out.append(Server(
                host=self.name, name=plan["name"], artifact=plan["artifact"],
                profile=Profile(plan["profile_name"], plan["profile"]), port=plan["port"],
                enabled=plan["enabled"], gpu=_gpu_pin(plan["gpu"]),
                model=Artifact(plan["artifact"], plan["model"], pins.get(plan["artifact"])),
                draft_model=Artifact(draft, plan["draft_model"], pins.get(draft)) if draft else None,
                address=self.address, bind=plan["bind"], flags=tuple(plan["flags"]), config_dir=config_dir,
                models_dir=models_dir, account=account, bind_address=bind_address, api_key=api_key))
        return out

    @property
    def service_account(self) -> ServiceAccount:
        """The account this host's servers, jobs and probes run as, with their GPU access."""
        user = str(self.vars.get("llama_server_user") or self.vars.get("gpu_host_user") or SERVICE_USER)
        group = str(self.vars.get("llama_server_group") or self.vars.get("gpu_host_group") or SERVICE_USER)
        groups = self.vars.get("llama_server_supplementary_groups", sandbox.SUPPLEMENTARY_GROUPS)
        devices = self.vars.get("llama_server_device_allow", sandbox.DEVICE_ALLOW)
        for key, value in (("llama_server_supplementary_groups", groups), ("llama_server_device_allow", devices)):
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v.strip() for v in value):
                raise ConfigError(f"host {self.name}: {key}: expected a list of strings")
        for name in (user, group, *groups):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}", name):
                raise ConfigError(f"host {self.name}: {name!r} is not a user or group name")
        return ServiceAccount(user, group, tuple(groups), tuple(d.strip() for d in devices))

    def server(self, name: str) -> Server:
        """Instance ``name``; ConfigError naming the host and its instances when there is none."""
        servers = {s.name: s for s in self.servers}
        if name not in servers:
            known = ", ".join(sorted(servers)) or "none"
            raise ConfigError(f"host {self.name}: no llama_server instance {name!r} (instances: {known})")
        return servers[name]

    @property
    def pins(self) -> dict[str, str]:
        """models_pins: the sha256 the inventory pins each artifact to."""
        pins = self._validated("models_pins", None) or {}
        return {str(k): str(v).lower() for k, v in pins.items()}

    def artifact(self, name: str) -> Artifact:
        """Artifact ``name`` as the models role keeps it on this host."""
        models_dir = str(self.vars.get("models_dir") or MODELS_DIR)
        return Artifact(name, profiles.artifact_file(models_dir, name), self.pins.get(name))

    @property
    def artifacts(self) -> list[Artifact]:
        """The artifacts the models role keeps on this host: models_artifacts (with the inputs of those
        quantized here), or every artifact of models_catalog."""
        chosen = [str(name) for name in self.vars.get("models_artifacts") or []]
        catalog = self.vars.get("models_catalog") or {}
        if chosen:
            for model in catalog.values():
                for name, art in (model.get("artifacts") or {}).items():
                    if name in chosen and art.get("type") == "quantize" and art["from"] not in chosen:
                        chosen.append(str(art["from"]))
        else:
            chosen = [str(name) for model in catalog.values() for name in (model.get("artifacts") or {})]
        return [self.artifact(name) for name in chosen]

    def _validated(self, key: str, default: Any) -> Any:
        """``vars[key]`` parsed by its schema (``default`` when unset or null); ConfigError naming the key."""
        value = self.vars.get(key)
        if value is None:
            return default
        from rigctl.inventory.schema import validate_value  # pydantic: not needed to read an inventory

        return validate_value(f"host {self.name}", key, value)

    @property
    def serial(self) -> list[int | str] | None:
        """``rigctl_serial``: the batches a provision goes in (Ansible's ``serial``); None: all hosts at once."""
        value = self._validated("rigctl_serial", None)
        return list(value) if value is not None else None

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
            # A fleet with no hosts yet (`rigctl init`'s, before `hosts add`) has its groups; a file that
            # defines neither is no inventory.
            if not manager.get_hosts() and set(manager.groups) <= {"all", "ungrouped"}:
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
                    if key in PROBED_KEYS:
                        merged[str(key)] = _plain(value)
                        continue
                    try:
                        merged[str(key)] = _plain(templar.template(value))
                    except AnsibleError as exc:
                        raise ConfigError(f"host {ahost.name}: {key}: {_first_line(exc)}") from None
                groups = tuple(str(g.name) for g in ahost.get_groups())
                hosts[str(ahost.name)] = Host(
                    name=str(ahost.name),
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
                own_vars[f"group {group.name}"] = _plain(own)
                parents[str(group.name)] = [str(p.name) for p in group.parent_groups]
            for ahost in manager.get_hosts():
                own = dict(ahost.get_vars())
                own.update(get_vars_from_inventory_sources(loader, [str(path)], [ahost], "task"))
                own_vars[f"host {ahost.name}"] = _plain(own)
        except AnsibleError as exc:
            raise ConfigError(f"inventory {path}: {_first_line(exc)}") from None
        log.debug("loaded %d hosts from %s", len(hosts), path)
        return cls(source=path, hosts=hosts, own_vars=own_vars, group_parents=parents)

    def select(self, limit: str | Iterable[str] | None = None, *, where: str = "--limit") -> list[Host]:
        """Hosts named by ``limit`` (names or group names, comma-separated); all when None. ``where``: what
        named them, for the error about a name that is neither."""
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
                raise ConfigError(f"unknown host or group {name!r} in {where} (hosts: {known})")
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
        _cache_collection_routing()
        init_plugin_loader()
        _plugins_ready = True


#: Parsed collection routing tables (runtime.yml) under the cache directory, by the YAML's sha256.
ROUTING_CACHE = "ansible-routing"


def _cache_collection_routing() -> None:
    """Keep Ansible's parsed collection routing tables as JSON in the cache directory.

    Every process that loads an inventory parses ansible.builtin's runtime.yml (370 KB of YAML), about
    0.17 s: a fifth of loading the lab's inventory, and a fixed cost of every fleet command. Ansible
    names its parser as replaceable, handing it a content id "to allow other implementations to cache
    the output"; this one reads the table back from JSON when the YAML's sha256 matches, and parses
    (then stores) it otherwise. The table is scalars, lists and maps of strings, so JSON keeps it exact.
    """
    import hashlib
    import json

    from ansible.utils.collection_loader import _collection_finder

    from rigctl.files import cache_dir, write_atomically

    parse = getattr(_collection_finder, "_meta_yml_to_dict", None)
    if parse is None:  # another Ansible: parse as it does
        return

    def parse_cached(data: bytes | str, content_id: Any) -> Any:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        path = cache_dir() / ROUTING_CACHE / f"{hashlib.sha256(raw).hexdigest()}.json"
        with contextlib.suppress(OSError, ValueError):
            cached = json.loads(path.read_text())
            if isinstance(cached, dict):
                return cached
        parsed = parse(data, content_id)
        with contextlib.suppress(OSError, TypeError, ValueError):
            text = json.dumps(parsed)
            if json.loads(text) == parsed:  # only what JSON keeps exactly
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(path, text)
        return parsed

    _collection_finder._meta_yml_to_dict = parse_cached


def _set_vault_secrets(loader: Any) -> None:
    """Vault-encrypted values (API keys, Hugging Face tokens) decrypt with the password file Ansible itself
    would use: $ANSIBLE_VAULT_PASSWORD_FILE, else ansible.cfg's vault_password_file / vault_identity_list.
    Never prompts; without a password, an encrypted value fails to load naming its key."""
    from ansible import constants

    password_file = os.environ.get("ANSIBLE_VAULT_PASSWORD_FILE") or constants.DEFAULT_VAULT_PASSWORD_FILE
    identities = list(constants.DEFAULT_VAULT_IDENTITY_LIST or [])
    if not password_file and not identities:
        return
    # Ansible's CLI module costs a tenth of a second to import: only with a vault to open.
    from ansible.cli import CLI
    from ansible.errors import AnsibleError
    from ansible.parsing.vault import VaultSecretsContext

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


def _gpu_pin(value: object) -> int | str | None:
    """An instance's GPU pin: a gpu_host_gpus index, or a MIG instance's UUID (kept as text)."""
    if value is None:
        return None
    return value if isinstance(value, str) and value.startswith("MIG-") else int(str(value))
