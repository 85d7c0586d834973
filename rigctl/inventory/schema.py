"""The schema of every inventory variable rigctl itself reads (:data:`SCHEMA`, pydantic), and the one function
that parses a value by it (:func:`validate_value`): what :mod:`rigctl.inventory.model`'s typed views and
``rigctl inventory check`` (:mod:`rigctl.inventory.check`) both hold an inventory to."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

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
from rigctl.hostside import sandbox
from rigctl.inputs import error_message
from rigctl.inventory.gates import Gates
from rigctl.inventory.keys import SHA256
from rigctl.trust import MASK, is_secret_name, mask_secret_values

#: A name that becomes part of a systemd unit (llama-server@NAME.service), a file name and a shell word.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _plain_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(f"{value!r} is not usable as a systemd unit, file name and shell word "
                         "(1-64 of letters, digits, _ . -; starting with a letter or digit)")
    return value


Name = Annotated[str, AfterValidator(_plain_name)]


def _one_line(value: str) -> str:
    # The arguments file holds one flag per line: a line break in a value would start a flag of its own.
    odd = next((ch for ch in value if not ch.isprintable()), None)
    if odd is not None:
        raise ValueError(f"{value!r}: a line break or control character ({odd!r}) in a value would add a flag "
                         "to the arguments file")
    return value


#: A profile's text that becomes (part of) one line of the arguments file.
ArgText = Annotated[str, AfterValidator(_one_line)]
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


#: A MIG instance's UUID as ``nvidia-smi -L`` prints it (``MIG-GPU-<uuid>/<gi>/<ci>`` before R470).
MIG_UUID = r"^MIG-[0-9A-Za-z/-]+$"


class MigSpec(_Strict):
    """One MIG instance of a GPU, as ``nvidia-smi -L`` lists it."""

    device: int = Field(ge=0)
    profile: str = Field(min_length=1)
    uuid: Annotated[str, Field(pattern=MIG_UUID)]


class GpuSpec(_Strict):
    name: str = Field(min_length=1)
    #: A unified-memory GPU's (GB10, Grace Hopper) is the host's memory: what the platform offers it.
    vram_mib: int = Field(gt=0, le=MAX_VRAM_MIB)
    compute_capability: Annotated[str, AfterValidator(_known_cc)]
    bandwidth_gbs: float | None = Field(default=None, gt=0)
    #: The GPU has no memory of its own (nvidia-smi's memory.total is [N/A]); vram_mib is the host's.
    unified_memory: bool = False
    #: MIG instances, when MIG is on: a process sees one instance, not the whole card.
    mig: list[MigSpec] = Field(default_factory=list)


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


class CudaWheelSpec(_Strict):
    """One wheel of a CUDA toolkit from wheels (gpu_host_cuda_source: wheels)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    version: Annotated[str, Field(pattern=r"^[0-9][0-9A-Za-z.+!-]*$")]
    sha256: Annotated[str, Field(pattern=SHA256.pattern)]


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
    draft_model: ArgText | None = None
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
    extends: ArgText | None = None
    host: ArgText | None = None
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
    alias: ArgText | None = None
    override_tensor: ArgText | list[ArgText] | None = None
    spec: SpecDecoding | None = None
    extra_args: list[ArgText] | None = None

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
    draft_model: ArgText | None = None
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
    #: What the instance is pinned to with CUDA_VISIBLE_DEVICES: a GPU (gpu_host_gpus index) or, on a GPU
    #: with MIG on, one of its MIG instances by UUID (an index names no device CUDA can use there).
    gpu: Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=MIG_UUID)] | None = None


class UnenrolledRigSpec(_Strict):
    """A lab rig that starts as a stranger: root with a password only, no fleet user, not in hosts.yml. Its
    stand-in GPUs: made up (``gpus``) or a recorded real nvidia-smi the lab replays (``capture``: a name under
    rigctl/lab/captures/nvidia-smi/)."""

    address: Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+\.\d+$")]
    gpus: list[GpuSpec] | None = Field(default=None, min_length=1)
    capture: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> UnenrolledRigSpec:
        if (self.gpus is None) == (self.capture is None):
            raise ValueError("give either gpus or capture")
        return self


class LabSpec(_Strict):
    dir: str = Field(min_length=1)
    bridge: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,15}$")]
    bridge_address: Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+\.\d+/\d+$")]
    unenrolled: dict[str, UnenrolledRigSpec] | None = None


_BATCH = re.compile(r"^(?:[1-9][0-9]*|(?:[1-9][0-9]?|100)%)$")


def _batch_size(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str) or not _BATCH.match(str(value)):
        raise ValueError(f"{value!r} is not a batch size: a whole number of hosts (1, 2, ...) or a percentage "
                         "of them (1% to 100%)")
    return int(value) if re.fullmatch(r"[0-9]+", str(value)) else str(value)


def parse_serial(value: Any) -> list[int | str]:
    """Batches of a rolling rollout as Ansible's ``serial`` takes them: a count of hosts or a percentage, or a
    list of them whose last repeats (``[1, 25%]``: one host first, then a quarter of them at a time)."""
    if isinstance(value, list):
        if not value:
            raise ValueError("an empty list: give a batch size, or a list of them")
        return [_batch_size(item) for item in value]
    return [_batch_size(value)]


#: ``rigctl_serial``: provision in batches (Ansible's ``serial``), each batch only once the last succeeded.
SerialSpec = Annotated[Any, AfterValidator(parse_serial)]


#: The most a drain reason may say: one line of a table, an alert's label, a skip's reason.
MAX_DRAIN_REASON = 200
_MARKUP = re.compile(r"[\[\]<>{}`]")


def drain_reason(value: str) -> str:
    """A drain's reason: printable plain text of 1..MAX_DRAIN_REASON characters, with nothing a terminal, a page
    or a template reads as markup (no ``[ ] < > { }`` or backquotes), since every report and alert shows it."""
    if not value.strip() or len(value) > MAX_DRAIN_REASON:
        raise ValueError(f"a reason of 1-{MAX_DRAIN_REASON} characters, got {len(value.strip())}")
    odd = next((ch for ch in value if not ch.isprintable()), None) or next(iter(_MARKUP.findall(value)), None)
    if odd is not None:
        raise ValueError(f"plain text without markup, got {odd!r} in it")
    return value


class DrainSpec(_Strict):
    """``rigctl_drain``: the host is out of campaigns, fan-out evals, benches and canaries (``rigctl hosts
    drain``; or the health policy's own drain)."""

    reason: Annotated[str, AfterValidator(drain_reason)]
    since: Annotated[str, Field(pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")]
    by: Literal["operator", "policy"]


class DrainPolicySpec(_Strict):
    """``rigctl_drain_policy``: what an unhealthy GPU (:mod:`rigctl.fleet.health`) does to its host. ``ignore``:
    alerts only; ``drain``: drained, its servers keep serving; ``stop``: drained and its servers stopped."""

    unhealthy_gpu: Literal["ignore", "drain", "stop"] = "ignore"


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
    "llama_cpp_cuda_fleet_build": bool,
    # The llama.cpp config files a host may keep (rigctl's processes never read them; any other is refused).
    "llama_cpp_allow_config_files": list[Literal[sandbox.SYSTEM_CONFIG_FILE]],  # type: ignore[valid-type]
    "gpu_host_cuda_source": Literal["apt", "wheels"],
    "gpu_host_cuda_wheels": list[CudaWheelSpec],
    "models_catalog": dict[Name, ModelSpec],
    "llama_server_profiles": dict[Name, ProfileSpec],
    "llama_server_instances": dict[Name, InstanceSpec],
    "llama_server_profile_overrides": dict[str, ProfileOverride],
    "llama_server_bind_address": ArgText,
    "llama_server_api_key": str,
    "models_pins": dict[str, Annotated[str, Field(pattern=SHA256.pattern)]],
    "models_pin_policy": Literal["fail", "warn"],
    "rigctl_lab": LabSpec,
    "rigctl_lab_slot": Annotated[str, Field(pattern=r"^[0-6]$")],
    "rigctl_known_hosts": str,
    "rigctl_cache_dir": str,
    "rigctl_serial": SerialSpec,
    # {advisory id: the reason the fleet accepts a build inside its range} (rigctl/inventory/advisories.py)
    "rigctl_allowed_advisories": dict[str, Annotated[str, Field(min_length=1)]],
    # {llama-server flag: the reason the fleet uses it} (the dangerous-flag policy, rigctl/inventory/flag_policy.py)
    "rigctl_allowed_server_flags": dict[str, Annotated[str, Field(min_length=1)]],
    # The gates of `rigctl build upgrade` and `build bisect` (rigctl/inventory/gates.py); what needs the host
    # too is checked by rigctl/upgrade/gates.py's check_gates.
    "rigctl_upgrade_gates": Gates | None,
    "ansible_port": Annotated[int, Field(ge=1, le=65535)],
    "rigctl_drain": DrainSpec | None,
    "rigctl_drain_policy": DrainPolicySpec,
}


@dataclass(frozen=True, order=True)
class Problem:
    where: str  # "host NAME" or "group NAME"
    key: str  # dotted path
    message: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        tag = "" if self.severity == "error" else "warning: "
        return f"{self.where}: {self.key}: {tag}{self.message}"


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
        raise ConfigError(str(pydantic_problems(where, key, exc)[0])) from None


def _without_union_tags(loc: tuple[Any, ...]) -> list[str]:
    """The error's key path without the discriminated unions' tags (a source's or an artifact's
    ``type``), which pydantic puts right after ``source`` and after an artifact's name."""
    # A key with a line break or a blank in it is shown quoted: the problem stays one readable line.
    parts = [str(p) if str(p).isprintable() and str(p).strip() == str(p) else repr(str(p)) for p in loc]
    return [p for i, p in enumerate(parts)
            if not ((i >= 1 and parts[i - 1] == "source") or (i >= 2 and parts[i - 2] == "artifacts"))]


def pydantic_problems(where: str, key: str, exc: ValidationError) -> list[Problem]:
    problems = []
    for err in exc.errors():
        # A dict key's own error ends in "[key]": the path already ends with that key.
        loc = [p for p in err["loc"] if p != "[key]"]
        path = ".".join([key, *_without_union_tags(tuple(loc))]).replace(".from_", ".from")
        message = error_message(err)
        # Our own validators' messages name the value already.
        if "input" in err and err["type"] not in {"extra_forbidden", "missing", "value_error", "union_tag_invalid"}:
            # A secret's value (llama_server_api_key, a source's token) is never echoed, nor is one inside the
            # value shown (a source that names no type, quoted whole).
            shown = (MASK if any(is_secret_name(part) for part in path.split("."))
                     else repr(mask_secret_values(err["input"])))
            message = f"{message} (got {shown})"
        problems.append(Problem(where, path, message))
    return problems
