"""`rigctl inventory check`: the inventory's variables against the schema the roles and rigctl read.

Each problem is one line naming where it lives (``host NAME`` or ``group NAME``), the key path and
what is wrong. A problem in a value that comes from a group is reported once, against that group.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    ValidationError,
)

from rigctl.errors import ConfigError
from rigctl.inventory.keys import FULL_COMMIT, HEX_COMMIT, HOST_TEXT_MAX, PROBED_KEYS
from rigctl.inventory.model import Host, Inventory
from rigctl.inventory.profiles import ProfileError, resolve_profile
from rigctl.inventory.schema import (
    SCHEMA,
    ControllerSource,
    ConvertArtifact,
    GpuSpec,
    HfSource,
    IndexedGpuSpec,
    InstanceSpec,
    ModelSpec,
    Problem,
    ProfileSpec,
    QuantizeArtifact,
    _adapter,
    arch_runs_on,
    pydantic_problems,
)
from rigctl.trust import data_text_problem

#: Variable prefixes owned by the roles and rigctl: an unknown key with one of these is a typo.
OWNED_PREFIXES = ("gpu_host_", "llama_cpp_", "models_", "llama_server_", "monitoring_", "rigctl_")


REQUIRED = ("llama_cpp_source", "llama_cpp_version", "models_catalog", "llama_server_profiles")


def role_variables(roles_paths: Iterable[Path]) -> set[str]:
    """Public variables the roles declare in their defaults."""
    names: set[str] = set()
    for roles_path in roles_paths:
        for defaults in sorted(Path(roles_path).glob("*/defaults/main.yml")):
            data = yaml.safe_load(defaults.read_text()) or {}
            names.update(str(k) for k in data)
    return names


def check(inventory: Inventory, roles_paths: Iterable[Path] = ()) -> list[Problem]:
    """Every problem in the inventory, each reported once at the place that defines it."""
    known = set(SCHEMA) | role_variables(roles_paths)
    problems: set[Problem] = set(_check_vars_files(inventory))
    for host in inventory.hosts.values():
        for problem in check_host(host, known):
            top = problem.key.split(".", 1)[0].split("[", 1)[0]
            where = inventory.origin(host, top) if top in host.vars else problem.where
            problems.add(Problem(where, problem.key, problem.message, problem.severity))
    return sorted(problems, key=lambda p: (p.severity != "error", p.where, p.key, p.message))


def check_host(host: Host, known: set[str]) -> list[Problem]:
    where = f"host {host.name}"
    out: list[Problem] = []
    v = host.vars
    for key in sorted(v):
        if key.startswith(OWNED_PREFIXES) and key not in known:
            guess = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {guess[0]}?)" if guess else ""
            out.append(Problem(where, key, f"unknown variable{hint}"))
    for key in REQUIRED:
        if key not in v:
            out.append(Problem(where, key, "required but not set"))

    parsed: dict[str, Any] = {}
    for key in SCHEMA:
        if key not in v:
            continue
        try:
            parsed[key] = _adapter(key).validate_python(v[key])
        except ValidationError as exc:
            out.extend(pydantic_problems(where, key, exc))
    out.extend(_check_facts_are_text(where, v))
    out.extend(_check_pin(where, v))
    out.extend(_check_floor(where, v, parsed))
    out.extend(_check_cuda_archs(where, parsed))
    out.extend(_check_catalog(where, parsed.get("models_catalog")))
    out.extend(_check_servers(where, parsed))
    out.extend(_check_pins(where, v, parsed))
    out.extend(_check_exposure(host, parsed))
    out.extend(_check_gpus(where, parsed))
    return out


def _check_facts_are_text(where: str, v: Mapping[str, Any]) -> list[Problem]:
    """The facts a probe writes hold only what a probe would accept from a host: every string printable,
    bounded and free of template markers (a hand edit, or a file written before probes checked them,
    could carry a template that a play would run)."""
    out = []

    def walk(path: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{path}.{key}", item)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(f"{path}.{index}", item)
        elif isinstance(value, str):
            problem = data_text_problem(value, HOST_TEXT_MAX)
            if problem is not None:
                out.append(Problem(where, path, problem))

    for key in sorted(PROBED_KEYS & set(v)):
        walk(key, v[key])
    return out


def _check_gpu_pin(where: str, key: str, pin: int | str | None, gpus: Sequence[GpuSpec]) -> list[Problem]:
    """An instance's GPU pin against the GPUs: an index that exists and, on a GPU with MIG on, a MIG
    instance's UUID instead (CUDA sees no whole GPU there: the index would start the server on none)."""
    if pin is None:
        return []
    if isinstance(pin, str):
        listed = [m.uuid for g in gpus for m in g.mig]
        if pin not in listed:
            return [Problem(where, key, f"{pin} is not a MIG instance of this host's GPUs "
                                        f"({', '.join(listed) or 'none has MIG on'})")]
        return []
    count = max(len(gpus), 1)
    if pin >= count:
        return [Problem(where, key, f"GPU {pin} does not exist: this host has {count} "
                                    f"(gpu_host_gpus indexes 0..{count - 1})")]
    if gpus and gpus[pin].mig:
        return [Problem(where, key, f"GPU {pin} has MIG on: pin the instance to one of its MIG instances by "
                                    f"UUID ({', '.join(m.uuid for m in gpus[pin].mig)})")]
    return []


def _check_gpus(where: str, parsed: Mapping[str, Any]) -> list[Problem]:
    gpus: list[IndexedGpuSpec] | None = parsed.get("gpu_host_gpus")
    if not gpus:
        return []
    out = []
    if [g.index for g in gpus] != list(range(len(gpus))):
        out.append(Problem(where, "gpu_host_gpus", f"indexes {[g.index for g in gpus]} are not 0..{len(gpus) - 1}"))
    first: GpuSpec | None = parsed.get("gpu_host_gpu")
    if first is not None and first.model_dump() != gpus[0].model_dump(exclude={"index"}):
        out.append(Problem(where, "gpu_host_gpu", "differs from gpu_host_gpus[0], the GPU the roles check"))
    return out


def _check_exposure(host: Host, parsed: Mapping[str, Any]) -> list[Problem]:
    """A warning for each instance served beyond loopback without an API key: anyone who reaches the
    host may use it."""
    if "llama_server_profiles" not in parsed or "llama_server_instances" not in parsed:
        return []
    try:
        servers = host.servers
    except ConfigError:
        return []  # a profile that does not resolve is reported by _check_servers
    return [Problem(f"host {host.name}", f"llama_server_instances.{server.name}",
                    f"serves on {server.bind} without llama_server_api_key: anyone who reaches the host "
                    "can use it (bind 127.0.0.1, or set a key from ansible-vault)", "warning")
            for server in servers if not server.api_key and not _is_loopback(server.bind)]


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _check_pins(where: str, v: Mapping[str, Any], parsed: Mapping[str, Any]) -> list[Problem]:
    artifacts = artifact_names(parsed.get("models_catalog"))
    pins = v.get("models_pins")
    if not artifacts or not isinstance(pins, Mapping):
        return []
    return [Problem(where, f"models_pins.{name}", "not an artifact in models_catalog")
            for name in sorted(pins) if name not in artifacts]


def _check_pin(where: str, v: Mapping[str, Any]) -> list[Problem]:
    out = []
    source, version = v.get("llama_cpp_source"), str(v.get("llama_cpp_version", ""))
    if source == "git":
        if "llama_cpp_repo" not in v:
            out.append(Problem(where, "llama_cpp_repo", "required when llama_cpp_source is git"))
        if version and not HEX_COMMIT.match(version):
            out.append(Problem(where, "llama_cpp_version",
                               f"{version!r} is not a commit hash (7 to 40 hex digits)"))
    elif source == "archive":
        if "llama_cpp_archive" not in v:
            out.append(Problem(where, "llama_cpp_archive", "required when llama_cpp_source is archive"))
        if version and not re.fullmatch(r"[\w.+-]+", version):
            out.append(Problem(where, "llama_cpp_version", f"{version!r} is not a build label"))
    if v.get("llama_cpp_cuda") and "gpu_host_gpu" not in v and "llama_cpp_cuda_architectures" not in v:
        out.append(Problem(where, "llama_cpp_cuda_architectures",
                           "CUDA is on but neither this nor gpu_host_gpu says which architecture"))
    return out


def _check_floor(where: str, v: Mapping[str, Any], parsed: Mapping[str, Any]) -> list[Problem]:
    """A pin inside a published advisory's range (the CVE floor) that the fleet has not accepted; an accepted
    advisory that is not in the table."""
    from rigctl.inventory import advisories

    out = []
    known = {a.id for a in advisories.table()}
    allowed = parsed.get("rigctl_allowed_advisories") or {}
    for ident in sorted(set(allowed) - known):
        out.append(Problem(where, f"rigctl_allowed_advisories.{ident}", "not an advisory of rigctl's table "
                                                                       "(rigctl build advisories lists them)"))
    build = advisories.build_number(str(v.get("llama_cpp_version", "")))
    if v.get("llama_cpp_source") == "archive" and build is not None:
        check = advisories.check_build(build, {k: r for k, r in allowed.items() if k in known})
        if check.vulnerable:
            out.append(Problem(where, "llama_cpp_version", check.refusal(f"pin {v['llama_cpp_version']}")))
    return out


def _check_cuda_archs(where: str, parsed: Mapping[str, Any]) -> list[Problem]:
    """The architectures llama.cpp is built for must run on the host's GPU."""
    archs, gpu = parsed.get("llama_cpp_cuda_architectures"), parsed.get("gpu_host_gpu")
    if not archs or gpu is None:
        return []
    runs = {item: arch_runs_on(item, gpu.compute_capability) for item in archs.split(";")}
    if "native" in runs.values():
        return []
    if "jit" in runs.values():
        return [Problem(where, "llama_cpp_cuda_architectures",
                        f"{archs!r} has no code for compute capability {gpu.compute_capability} (gpu_host_gpu): "
                        "every start JIT-compiles from PTX", "warning")]
    return [Problem(where, "llama_cpp_cuda_architectures",
                    f"{archs!r} does not run on the GPU's compute capability {gpu.compute_capability} "
                    f"(gpu_host_gpu; build for {gpu.compute_capability.replace('.', '')})")]


def _check_vars_files(inventory: Inventory) -> list[Problem]:
    """host_vars and group_vars files for hosts and groups the inventory does not have: their variables
    apply to nothing, which is almost always a typo in the file name."""
    root = Path(inventory.source)
    if not root.is_dir():
        return []
    out = []
    groups = {name.removeprefix("group ") for name in inventory.own_vars if name.startswith("group ")} | {"all"}
    for folder, known, what in (("host_vars", set(inventory.hosts), "host"), ("group_vars", groups, "group")):
        for path in sorted((root / folder).glob("*")):
            if path.name.startswith("."):
                continue
            name = path.name if path.is_dir() else path.stem if path.suffix in {".yml", ".yaml", ".json"} else None
            if name is not None and name not in known:
                guess = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" (did you mean {guess[0]}?)" if guess else ""
                out.append(Problem(f"file {path}", "-", f"no {what} {name!r} in the inventory{hint}"))
    return out


def _check_catalog(where: str, catalog: dict[str, ModelSpec] | None) -> list[Problem]:
    if not catalog:
        return []
    out = []
    owner: dict[str, str] = {}
    for model_name, model in catalog.items():
        base = f"models_catalog.{model_name}"
        converted = any(isinstance(art, ConvertArtifact) for art in model.artifacts.values())
        if isinstance(model.source, HfSource) and not FULL_COMMIT.match(model.source.revision):
            # A warning, so the rest of the inventory stays usable; the models role refuses to convert it
            # (the converter runs over the checkout: it must be the commit that was looked at).
            out.append(Problem(where, f"{base}.source.revision",
                               f"{model.source.revision!r} is a branch or tag, not a pinned commit"
                               + ("; the models role refuses to convert it until it is one (40 hex digits)"
                                  if converted else ""),
                               "warning"))
        for art_name, art in model.artifacts.items():
            if art_name in owner:
                out.append(Problem(where, f"{base}.artifacts.{art_name}",
                                   f"artifact name also used by model {owner[art_name]}"))
            owner[art_name] = model_name
            if isinstance(art, QuantizeArtifact) and art.from_ not in model.artifacts:
                out.append(Problem(where, f"{base}.artifacts.{art_name}.from",
                                   f"{art.from_!r} is not an artifact of model {model_name}"))
            if isinstance(art, ConvertArtifact) and not isinstance(model.source, HfSource | ControllerSource):
                out.append(Problem(where, f"{base}.artifacts.{art_name}",
                                   "convert needs a Hugging Face checkout (source type hf or controller)"))
    return out


def artifact_names(catalog: Mapping[str, ModelSpec] | None) -> set[str]:
    return {name for model in (catalog or {}).values() for name in model.artifacts}


def _check_servers(where: str, parsed: Mapping[str, Any]) -> list[Problem]:
    out = []
    profiles: dict[str, ProfileSpec] = parsed.get("llama_server_profiles") or {}
    instances: dict[str, InstanceSpec] = parsed.get("llama_server_instances") or {}
    artifacts = artifact_names(parsed.get("models_catalog"))
    chains = {name: {"extends": profile.extends} for name, profile in profiles.items()}
    for name, profile in profiles.items():
        try:
            resolve_profile(chains, name)
        except ProfileError as exc:
            out.append(Problem(where, f"llama_server_profiles.{exc.profile}.extends", exc.reason))
        if profile.spec and profile.spec.draft_model and artifacts and profile.spec.draft_model not in artifacts:
            out.append(Problem(where, f"llama_server_profiles.{name}.spec.draft_model",
                               f"{profile.spec.draft_model!r} is not an artifact in models_catalog"))
    for name in parsed.get("llama_server_profile_overrides") or {}:
        if "llama_server_profiles" in parsed and name not in profiles:
            out.append(Problem(where, f"llama_server_profile_overrides.{name}",
                               f"{name!r} is not in llama_server_profiles"))
    ports: dict[int, str] = {}
    gpus: list[IndexedGpuSpec] | None = parsed.get("gpu_host_gpus")
    for name, inst in sorted(instances.items()):
        base = f"llama_server_instances.{name}"
        first_gpu = parsed.get("gpu_host_gpu")
        out.extend(_check_gpu_pin(where, f"{base}.gpu", inst.gpu, gpus or ([first_gpu] if first_gpu else [])))
        if artifacts and inst.artifact not in artifacts:
            out.append(Problem(where, f"{base}.artifact", f"{inst.artifact!r} is not an artifact in models_catalog"))
        # Profiles that failed validation are reported already; don't call every reference to them unknown.
        if "llama_server_profiles" in parsed and inst.profile not in profiles:
            out.append(Problem(where, f"{base}.profile", f"{inst.profile!r} is not in llama_server_profiles"))
        if inst.port in ports:
            out.append(Problem(where, f"{base}.port", f"port {inst.port} is also used by {ports[inst.port]}"))
        else:
            ports[inst.port] = name
    return out
