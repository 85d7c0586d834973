"""llama-server profiles to instance plans: ``extends`` chains, host overrides, one flag per line.

The one home of what the llama_server role derives for an instance (its resolved profile, model and
drafter paths, unit name, bind and check address, arguments-file lines). Both sides import it: the
role's filter plugin loads this file by its path in the repository (so it must stay standard library
only and import nothing from rigctl), and :mod:`rigctl.inventory.model` builds its typed ``Server``
views from the same plan, so that what rigctl records and what the role writes cannot differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Profile keys with one llama-server flag each, in the order they are written.
SIMPLE_FLAGS = (
    ("n_gpu_layers", "-ngl"),
    ("ctx_size", "-c"),
    ("cache_type_k", "-ctk"),
    ("cache_type_v", "-ctv"),
    ("flash_attn", "-fa"),
    ("threads", "-t"),
    ("threads_batch", "-tb"),
    ("parallel", "--parallel"),
    ("reasoning", "--reasoning"),
)

#: The address a profile without ``host`` binds to (llama-server's own default).
DEFAULT_BIND = "127.0.0.1"


class ProfileError(ValueError):
    """A profile that cannot be resolved or rendered (unknown ``extends``, a cycle, a drafter without its path).

    ``profile`` names the profile whose ``extends`` is wrong (None: the name asked for is not defined) and
    ``reason`` says what is wrong, for a checker that reports the key path itself."""

    def __init__(self, message: str, *, profile: str | None = None, reason: str = ""):
        super().__init__(message)
        self.profile = profile
        self.reason = reason or message


def unit_name(instance: str) -> str:
    """The systemd unit of instance ``instance`` (the role's llama-server@.service template)."""
    return f"llama-server@{instance}.service"


def key_file(config_dir: str) -> str:
    """Where the role writes the API key (root:<service group> 0640) that --api-key-file names."""
    return f"{config_dir}/api-key"


def instance_file(config_dir: str, instance: str, kind: str) -> str:
    """``NAME.args`` (flags), ``NAME.bin`` (link to the build's llama-server) or ``NAME.env`` (GPU pin): the
    names the role's launcher and unit read."""
    return f"{config_dir}/{instance}.{kind}"


def artifact_file(models_dir: str, artifact: str) -> str:
    """The GGUF file of ``artifact`` (the models role's ``<models_dir>/<artifact>.gguf``)."""
    return f"{models_dir}/{artifact}.gguf"


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``; nested mappings (a profile's ``spec``, a gates section) merge key by key,
    anything else (a list, null) replaces. The one deep merge: a profile's chain and the gates a ``--gates``
    file lays over the inventory's both take it."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_profile(profiles: Mapping[str, Any], name: str,
                    overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Profile ``name`` with its ``extends`` chain merged (the child wins) and this host's
    ``overrides[name]`` on top. The result has no ``extends`` key. ProfileError on a name that is not
    defined or a cycle."""
    chain: list[str] = []
    current: str | None = name
    while current is not None:
        if current not in profiles:
            where = f"profile {chain[-1]!r} extends" if chain else "no profile named"
            raise ProfileError(f"llama_server_profiles: {where} {current!r}, which is not defined",
                               profile=chain[-1] if chain else None, reason=f"no profile named {current!r}")
        if current in chain:
            cycle = " -> ".join([*chain, current])
            raise ProfileError(f"llama_server_profiles: extends cycle {cycle}", profile=name, reason=f"cycle: {cycle}")
        chain.append(current)
        current = (profiles[current] or {}).get("extends")
    merged: dict[str, Any] = {}
    for link in reversed(chain):
        merged = merge(merged, profiles[link] or {})
    merged = merge(merged, (overrides or {}).get(name) or {})
    merged.pop("extends", None)
    return merged


def _word(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def server_flags(profile: Mapping[str, Any], *, model_path: str, port: int, alias: str,
                 bind_host: str | None = None, draft_model_path: str | None = None,
                 api_key_file: str | None = None) -> list[str]:
    """The arguments file's lines, one flag per line with its value after the first space.

    ``bind_host`` (the host's llama_server_bind_address) wins over the profile's ``host``.
    """
    lines = [f"--model {model_path}", f"--alias {profile.get('alias') or alias}"]
    host = bind_host or profile.get("host")
    if host:
        lines.append(f"--host {host}")
    lines.append(f"--port {int(port)}")
    for key, flag in SIMPLE_FLAGS:
        if profile.get(key) is not None:
            lines.append(f"{flag} {_word(profile[key])}")
    if profile.get("metrics"):
        lines.append("--metrics")
    override = profile.get("override_tensor")
    if override:
        lines.append(f"-ot {','.join(override) if isinstance(override, list | tuple) else override}")
    spec = profile.get("spec") or {}
    if spec:
        lines.append(f"--spec-type {spec['type']}")
        lines.append(f"--spec-draft-n-max {int(spec['draft_n_max'])}")
        if spec.get("draft_model"):
            if not draft_model_path:
                raise ProfileError(f"spec.draft_model {spec['draft_model']!r} needs its path")
            lines.append(f"-md {draft_model_path}")
        if spec.get("n_gpu_layers_draft") is not None:
            lines.append(f"-ngld {int(spec['n_gpu_layers_draft'])}")
    if api_key_file:
        lines.append(f"--api-key-file {api_key_file}")
    for extra in profile.get("extra_args") or ():
        lines.append(str(extra).strip())
    broken = next((line for line in lines if not line.isprintable()), None)
    if broken is not None:
        # One flag per line: a line break inside a value would be read as a flag of its own.
        raise ProfileError(f"{broken!r}: a line break or control character in a profile value would add a "
                           "flag to the arguments file", reason="a line break or control character in a value")
    return lines


def args_lines_to_argv(lines: list[str]) -> list[str]:
    """Arguments-file lines as the launcher turns them into argv: the flag, then the rest of the line
    verbatim as its value; blank lines and ``#`` comments skipped."""
    argv: list[str] = []
    for line in lines:
        if not line.strip() or line.startswith("#"):
            continue
        flag, sep, value = line.partition(" ")
        argv += [flag, value] if sep else [flag]
    return argv


def _enabled(value: Any) -> bool:
    # What Jinja's `| bool` accepts, for an inventory that writes enabled: "yes".
    if isinstance(value, str):
        return value.strip().lower() in {"yes", "on", "1", "true", "y"}
    return bool(value)


def instance_flags(profile: Mapping[str, Any], *, artifact: str, port: int, models_dir: str, config_dir: str,
                   bind_address: str = "", api_key: bool = False) -> list[str]:
    """The arguments-file lines of an instance serving ``artifact`` on ``port`` with resolved ``profile``:
    the drafter's path from ``spec.draft_model``, the key file when the host has an API key."""
    spec = profile.get("spec") or {}
    return server_flags(profile, model_path=artifact_file(models_dir, artifact), port=port, alias=artifact,
                        bind_host=bind_address or None,
                        draft_model_path=artifact_file(models_dir, str(spec["draft_model"]))
                        if spec.get("draft_model") else None,
                        api_key_file=key_file(config_dir) if api_key else None)


def instance_plan(name: str, instance: Mapping[str, Any], profiles: Mapping[str, Any],
                  overrides: Mapping[str, Any] | None = None, *, models_dir: str, config_dir: str,
                  bind_address: str = "", api_key: bool = False) -> dict[str, Any]:
    """Everything the role writes and checks for instance ``name`` of ``llama_server_instances``: the
    resolved profile, model and drafter paths, unit, bind address and the address a local check asks,
    and the flags."""
    profile = resolve_profile(profiles, str(instance["profile"]), overrides)
    artifact = str(instance["artifact"])
    spec = profile.get("spec") or {}
    bind = bind_address or profile.get("host") or DEFAULT_BIND
    port = int(instance["port"])
    return {
        "name": name,
        "unit": unit_name(name),
        "artifact": artifact,
        "profile_name": str(instance["profile"]),
        "profile": profile,
        "port": port,
        "enabled": _enabled(instance.get("enabled", True)),
        "gpu": instance.get("gpu"),
        "model": artifact_file(models_dir, artifact),
        "draft_model": artifact_file(models_dir, str(spec["draft_model"])) if spec.get("draft_model") else "",
        "bind": bind,
        "check_host": DEFAULT_BIND if bind in ("0.0.0.0", "") else ("::1" if bind == "::" else bind),
        "flags": instance_flags(profile, artifact=artifact, port=port, models_dir=models_dir, config_dir=config_dir,
                                bind_address=bind_address, api_key=api_key),
    }


def host_plan(instances: Mapping[str, Any] | None, profiles: Mapping[str, Any],
              overrides: Mapping[str, Any] | None = None, **paths: Any) -> list[dict[str, Any]]:
    """:func:`instance_plan` of every instance of a host, in name order."""
    return [instance_plan(name, (instances or {})[name], profiles, overrides, **paths)
            for name in sorted(instances or {})]
