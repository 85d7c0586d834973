# Part of rigctl's llama_server role.
"""Profiles to llama-server flags: `extends` chains, host overrides, one flag per line.

Pure functions on the controller; rigctl's tests import this file directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    from ansible.errors import AnsibleFilterError
except ImportError:  # imported outside Ansible (tests)
    AnsibleFilterError = ValueError  # type: ignore[misc,assignment]

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


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``; nested mappings (``spec``) merge key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_profile(profiles: Mapping[str, Any], name: str,
                    overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Profile ``name`` with its ``extends`` chain merged (the child wins) and this host's
    ``overrides[name]`` on top. The result has no ``extends`` key."""
    chain: list[str] = []
    current: str | None = name
    while current is not None:
        if current not in profiles:
            where = f"profile {chain[-1]!r} extends" if chain else "no profile named"
            raise AnsibleFilterError(f"llama_server_profiles: {where} {current!r}, which is not defined")
        if current in chain:
            raise AnsibleFilterError(f"llama_server_profiles: extends cycle {' -> '.join([*chain, current])}")
        chain.append(current)
        current = (profiles[current] or {}).get("extends")
    merged: dict[str, Any] = {}
    for link in reversed(chain):
        merged = _merge(merged, profiles[link] or {})
    merged = _merge(merged, (overrides or {}).get(name) or {})
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
                raise AnsibleFilterError(f"spec.draft_model {spec['draft_model']!r} needs its path")
            lines.append(f"-md {draft_model_path}")
        if spec.get("n_gpu_layers_draft") is not None:
            lines.append(f"-ngld {int(spec['n_gpu_layers_draft'])}")
    if api_key_file:
        lines.append(f"--api-key-file {api_key_file}")
    for extra in profile.get("extra_args") or ():
        lines.append(str(extra).strip())
    return lines


def llama_server_profile(name: str, profiles: Mapping[str, Any],
                         overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Jinja: ``'rig' | llama_server_profile(llama_server_profiles, llama_server_profile_overrides)``."""
    return resolve_profile(profiles, name, overrides)


def llama_server_flags(profile: Mapping[str, Any], **kwargs: Any) -> list[str]:
    """Jinja: ``profile | llama_server_flags(model_path=..., port=..., alias=..., ...)``."""
    return server_flags(profile, **kwargs)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"llama_server_profile": llama_server_profile, "llama_server_flags": llama_server_flags}
