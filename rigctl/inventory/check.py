"""`rigctl inventory check`: the inventory's variables against the schema the roles and rigctl read.

Each problem is one line naming where it lives (``host NAME`` or ``group NAME``), the key path and
what is wrong. A problem in a value that comes from a group is reported once, against that group.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from rigctl.errors import ConfigError
from rigctl.fleet.gates import Gates
from rigctl.inventory.model import FULL_COMMIT, HEX_COMMIT, SHA256, Host, Inventory
from rigctl.inventory.profiles import ProfileError, resolve_profile
from rigctl.probe import HOST_TEXT_MAX, PROBED_KEYS
from rigctl.trust import MASK, data_text_problem, is_secret_name, mask_secret_values

#: Variable prefixes owned by the roles and rigctl: an unknown key with one of these is a typo.
OWNED_PREFIXES = ("gpu_host_", "llama_cpp_", "models_", "llama_server_", "monitoring_", "rigctl_")


#: A name that becomes part of a systemd unit (llama-server@NAME.service), a file name and a shell word.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _plain_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(f"{value!r} is not usable as a systemd unit, file name and shell word "
                         "(1-64 of letters, digits, _ . -; starting with a letter or digit)")
    return value


Name = Annotated[str, AfterValidator(_plain_name)]

#: Compute capabilities NVIDIA has shipped (and CUDA's matching architectures, 8.6 -> 86).
COMPUTE_CAPABILITIES = ("3.5", "3.7", "5.0", "5.2", "5.3", "6.0", "6.1", "6.2", "7.0", "7.2", "7.5", "8.0", "8.6",
                        "8.7", "8.8", "8.9", "9.0", "10.0", "10.1", "10.3", "11.0", "12.0", "12.1")
CUDA_ARCHS = tuple(cc.replace(".", "") for cc in COMPUTE_CAPABILITIES)
#: Past the memory of any GPU made (the largest hold 288 GB): a bigger vram_mib is a unit mistake.
MAX_VRAM_MIB = 512 * 1024
_ARCH_ITEM = re.compile(r"^(\d{2,3})([af]?)(-real|-virtual)?$")


def _known_cc(value: str) -> str:
    if value not in COMPUTE_CAPABILITIES:
        raise ValueError(f"{value!r} is not a compute capability of any NVIDIA GPU "
                         f"({', '.join(COMPUTE_CAPABILITIES)})")
    return value


def _cuda_archs(value: str) -> str:
    for item in value.split(";"):
        found = _ARCH_ITEM.match(item)
        if not found or found.group(1) not in CUDA_ARCHS:
            raise ValueError(f"{item!r} in {value!r} is not a CUDA architecture (one of {', '.join(CUDA_ARCHS)}, "
                             "optionally with a/f and -real/-virtual, separated by ;)")
    return value


def arch_runs_on(item: str, compute_capability: str) -> Literal["native", "jit", "no"]:
    """Whether code built for CMake architecture ``item`` (``86``, ``90a``, ``80-real``) runs on a GPU of
    ``compute_capability``: natively (SASS of the same major, not newer), by JIT from PTX, or not at all."""
    found = _ARCH_ITEM.match(item)
    if not found:
        return "no"
    number, suffix, kind = found.groups()
    arch, gpu = int(number), int(compute_capability.replace(".", ""))
    same_major = arch // 10 == gpu // 10 and arch <= gpu
    if suffix == "a":  # arch-specific features: that exact GPU only
        return "native" if arch == gpu else "no"
    if suffix == "f":  # family-specific: same major only
        return "native" if same_major else "no"
    if same_major and kind != "-virtual":
        return "native"
    if arch <= gpu and kind != "-real":
        return "jit"
    return "no"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class GpuSpec(_Strict):
    name: str = Field(min_length=1)
    vram_mib: int = Field(gt=0, le=MAX_VRAM_MIB)
    compute_capability: Annotated[str, AfterValidator(_known_cc)]
    bandwidth_gbs: float | None = Field(default=None, gt=0)


class IndexedGpuSpec(GpuSpec):
    """One of several GPUs: ``index`` is nvidia-smi's (and CUDA_VISIBLE_DEVICES')."""

    index: int = Field(ge=0)


class HostFactsSpec(_Strict):
    """What `rigctl hosts add` / `hosts probe --write` recorded about the host."""

    driver_version: str = Field(min_length=1)
    cuda_version: Annotated[str, Field(pattern=r"^\d+\.\d+$")]
    cpu_model: str = Field(min_length=1)
    cpu_flags: list[str]
    cpus: int = Field(gt=0)
    memory_mib: int = Field(gt=0)
    os: str = Field(min_length=1)


class ArchiveSpec(_Strict):
    url: str | None = None
    path: str | None = None
    sha256: Annotated[str, Field(pattern=SHA256.pattern)]
    subdir: str | None = None

    @model_validator(mode="after")
    def _one_location(self) -> ArchiveSpec:
        if (self.url is None) == (self.path is None):
            raise ValueError("give exactly one of url or path")
        return self


class HfSource(_Strict):
    type: Literal["hf"]
    repo: Annotated[str, Field(pattern=r"^[\w.-]+/[\w.-]+$")]
    revision: str = Field(min_length=1)
    files: list[str] | None = None
    token: str | None = None


class UrlSource(_Strict):
    type: Literal["url"]
    url: str = Field(min_length=1)
    sha256: Annotated[str, Field(pattern=SHA256.pattern)]


class ControllerSource(_Strict):
    type: Literal["controller"]
    path: str = Field(min_length=1)


class FileArtifact(_Strict):
    type: Literal["file"]
    file: str = Field(min_length=1)


class ConvertArtifact(_Strict):
    type: Literal["convert"]
    outtype: Literal["bf16", "f16", "f32", "q8_0"]


class ImatrixSpec(_Strict):
    """llama-imatrix over the quantization's input with a calibration text from the controller."""

    calibration: str = Field(min_length=1)
    chunks: int | None = Field(default=None, ge=1)
    ctx_size: int = Field(default=512, ge=16)
    extra_args: list[str] = Field(default_factory=list)


class QuantizeArtifact(_Strict):
    type: Literal["quantize"]
    from_: str = Field(alias="from", min_length=1)
    qtype: Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+$")]
    imatrix: ImatrixSpec | None = None


class ModelSpec(_Strict):
    source: Annotated[HfSource | UrlSource | ControllerSource, Field(discriminator="type")]
    # The converter loads a checkout with transformers' trust_remote_code=True: a checkout carrying
    # Python files or an auto_map is refused unless its entry says, by this name, to run that code.
    trust_remote_code: StrictBool = False
    artifacts: dict[Name, Annotated[FileArtifact | ConvertArtifact | QuantizeArtifact,
                                   Field(discriminator="type")]] = Field(min_length=1)


class SpecDecoding(_Strict):
    type: Literal["draft-mtp", "draft-simple"]
    draft_n_max: int = Field(ge=1, le=16)
    draft_model: str | None = None
    n_gpu_layers_draft: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _drafter_needs_model(self) -> SpecDecoding:
        # At this llama.cpp build `-md` alone drafts nothing: draft-simple needs both.
        if self.type == "draft-simple" and not self.draft_model:
            raise ValueError("draft-simple needs draft_model (an artifact name)")
        # draft-mtp drafts with the model's own MTP head, or with a separate one given as draft_model
        # (Gemma 4's "assistant" drafters load with -md and --spec-type draft-mtp).
        return self


class ProfileSpec(_Strict):
    extends: str | None = None
    host: str | None = None
    n_gpu_layers: int | None = Field(default=None, ge=0)
    ctx_size: int | None = Field(default=None, ge=0)
    cache_type_k: Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"] | None = None
    cache_type_v: Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"] | None = None
    flash_attn: Literal["on", "off", "auto", "1", "0"] | None = None
    threads: int | None = Field(default=None, ge=1)
    threads_batch: int | None = Field(default=None, ge=1)
    parallel: int | None = Field(default=None, ge=1)
    reasoning: Literal["on", "off", "auto"] | None = None
    metrics: bool | None = None
    alias: str | None = None
    override_tensor: str | list[str] | None = None
    spec: SpecDecoding | None = None
    extra_args: list[str] | None = None

    @field_validator("flash_attn", "reasoning", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: Any) -> Any:
        # YAML reads an unquoted on/off as a boolean; accept what the user meant.
        if isinstance(value, bool):
            return "on" if value else "off"
        return value


class SpecOverride(_Strict):
    """A host's change to a profile's spec block: any of its keys, merged over the profile's."""

    type: Literal["draft-mtp", "draft-simple"] | None = None
    draft_n_max: int | None = Field(default=None, ge=1, le=16)
    draft_model: str | None = None
    n_gpu_layers_draft: int | None = Field(default=None, ge=0)


class ProfileOverride(ProfileSpec):
    """llama_server_profile_overrides.NAME: keys merged over profile NAME for one host (spec key by key)."""

    spec: SpecOverride | None = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _no_extends(self) -> ProfileOverride:
        if self.extends is not None:
            raise ValueError("extends has no effect in an override (the profile's own chain is used)")
        return self


class InstanceSpec(_Strict):
    artifact: str = Field(min_length=1)
    profile: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    enabled: bool = True
    #: The GPU (gpu_host_gpus index) the instance is pinned to with CUDA_VISIBLE_DEVICES.
    gpu: int | None = Field(default=None, ge=0)


class UnenrolledRigSpec(_Strict):
    """A lab rig that starts as a stranger: root with a password only, no fleet user, not in hosts.yml."""

    address: Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+\.\d+$")]
    gpus: list[GpuSpec] = Field(min_length=1)


class LabSpec(_Strict):
    dir: str = Field(min_length=1)
    bridge: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,15}$")]
    bridge_address: Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+\.\d+/\d+$")]
    unenrolled: dict[str, UnenrolledRigSpec] | None = None


#: Every variable rigctl itself reads, with its schema.
SCHEMA: dict[str, Any] = {
    "gpu_host_gpu": GpuSpec,
    "gpu_host_gpus": list[IndexedGpuSpec],
    "rigctl_host_facts": HostFactsSpec,
    "rigctl_fleet_user": Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")],
    "llama_cpp_source": Literal["git", "archive"],
    "llama_cpp_repo": str,
    "llama_cpp_version": str,
    "llama_cpp_archive": ArchiveSpec,
    "llama_cpp_cuda": bool,
    "llama_cpp_cuda_architectures": Annotated[str, AfterValidator(_cuda_archs)],
    "models_catalog": dict[Name, ModelSpec],
    "llama_server_profiles": dict[Name, ProfileSpec],
    "llama_server_instances": dict[Name, InstanceSpec],
    "llama_server_profile_overrides": dict[str, ProfileOverride],
    "llama_server_bind_address": str,
    "llama_server_api_key": str,
    "models_pins": dict[str, Annotated[str, Field(pattern=SHA256.pattern)]],
    "models_pin_policy": Literal["fail", "warn"],
    "rigctl_lab": LabSpec,
    "rigctl_lab_slot": Annotated[str, Field(pattern=r"^[0-6]$")],
    "rigctl_known_hosts": str,
    "rigctl_cache_dir": str,
    # {advisory id: the reason the fleet accepts a build inside its range} (rigctl/fleet/advisories.py)
    "rigctl_allowed_advisories": dict[str, Annotated[str, Field(min_length=1)]],
    "rigctl_upgrade_gates": Gates,  # rigctl/fleet/gates.py
    "ansible_port": Annotated[int, Field(ge=1, le=65535)],
}

REQUIRED = ("llama_cpp_source", "llama_cpp_version", "models_catalog", "llama_server_profiles")


@dataclass(frozen=True, order=True)
class Problem:
    where: str  # "host NAME" or "group NAME"
    key: str  # dotted path
    message: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        tag = "" if self.severity == "error" else "warning: "
        return f"{self.where}: {self.key}: {tag}{self.message}"


def role_variables(roles_paths: Iterable[Path]) -> set[str]:
    """Public variables the roles declare in their defaults."""
    names: set[str] = set()
    for roles_path in roles_paths:
        for defaults in sorted(Path(roles_path).glob("*/defaults/main.yml")):
            data = yaml.safe_load(defaults.read_text()) or {}
            names.update(str(k) for k in data)
    return names


_ADAPTERS: dict[str, TypeAdapter[Any]] = {}


def _adapter(key: str) -> TypeAdapter[Any]:
    if key not in _ADAPTERS:
        _ADAPTERS[key] = TypeAdapter(SCHEMA[key])
    return _ADAPTERS[key]


def validate_value(where: str, key: str, value: Any) -> Any:
    """``value`` of variable ``key`` parsed by its schema; ConfigError with the first problem, naming
    ``where`` and the key path."""
    try:
        return _adapter(key).validate_python(value)
    except ValidationError as exc:
        raise ConfigError(str(_pydantic_problems(where, key, exc)[0])) from None


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
            out.extend(_pydantic_problems(where, key, exc))
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


def _without_union_tags(loc: tuple[Any, ...]) -> list[str]:
    """The error's key path without the discriminated unions' tags (a source's or an artifact's
    ``type``), which pydantic puts right after ``source`` and after an artifact's name."""
    # A key with a line break or a blank in it is shown quoted: the problem stays one readable line.
    parts = [str(p) if str(p).isprintable() and str(p).strip() == str(p) else repr(str(p)) for p in loc]
    return [p for i, p in enumerate(parts)
            if not ((i >= 1 and parts[i - 1] == "source") or (i >= 2 and parts[i - 2] == "artifacts"))]


def _pydantic_problems(where: str, key: str, exc: ValidationError) -> list[Problem]:
    problems = []
    for err in exc.errors():
        # A dict key's own error ends in "[key]": the path already ends with that key.
        loc = [p for p in err["loc"] if p != "[key]"]
        path = ".".join([key, *_without_union_tags(tuple(loc))]).replace(".from_", ".from")
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required but not set"
        elif err["type"] == "value_error":  # our own validators' messages name the value already
            message = str(err["ctx"]["error"]) if "ctx" in err else message.removeprefix("Value error, ")
        elif "input" in err and err["type"] not in {"union_tag_invalid"}:
            # A secret's value (llama_server_api_key, a source's token) is never echoed, nor is one inside the
            # value shown (a source that names no type, quoted whole).
            shown = (MASK if any(is_secret_name(part) for part in path.split("."))
                     else repr(mask_secret_values(err["input"])))
            message = f"{message} (got {shown})"
        problems.append(Problem(where, path, message))
    return problems


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
    from rigctl.fleet import advisories

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
        if inst.gpu is not None and inst.gpu >= len(gpus or [None]):
            count = len(gpus) if gpus else 1
            out.append(Problem(where, f"{base}.gpu", f"GPU {inst.gpu} does not exist: this host has {count} "
                                                     f"(gpu_host_gpus indexes 0..{count - 1})"))
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
