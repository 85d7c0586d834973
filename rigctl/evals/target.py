"""What an eval runs against: an inventory server (with its provenance) or a bare OpenAI-compatible URL."""

from __future__ import annotations

import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from rigctl.errors import ConfigError, RigctlError
from rigctl.inventory import Host
from rigctl.server import Endpoint

log = logging.getLogger(__name__)


@dataclass
class Target:
    """Where answers come from, and the facts a run record keeps about it."""

    host: str  # the results tree's host directory
    endpoint: Endpoint
    server: dict[str, Any] = field(default_factory=dict)  # name, host, profile, flags, port, artifact
    artifacts: list[dict[str, Any]] = field(default_factory=list)
    gpu: dict[str, Any] = field(default_factory=dict)
    llama_cpp: dict[str, Any] = field(default_factory=dict)
    inventory_host: Host | None = None


def instance_spec(host: Host, server: str) -> dict[str, Any]:
    instances = host.vars.get("llama_server_instances") or {}
    if server not in instances:
        known = ", ".join(sorted(instances)) or "none"
        raise ConfigError(f"host {host.name}: no llama_server instance {server!r} (instances: {known})")
    return dict(instances[server])


def inventory_target(host: Host, server: str, *, url: str | None = None, api_key: str | None = None,
                     facts: bool = True) -> Target:
    """An inventory server: endpoint and key from the inventory (``url``/``api_key`` override them), the
    profile's settings as the server's flags, and with ``facts`` the model's manifest and the llama.cpp
    build read from the host over SSH (a host that cannot be read is logged and left out)."""
    spec = instance_spec(host, server)
    endpoint = Endpoint.from_inventory(host, server)
    if url or api_key:
        endpoint = Endpoint(url or endpoint.url, api_key or endpoint.api_key, f"{host.name}/{server}")
    profile = str(spec.get("profile", ""))
    flags = profile_settings(host, profile)
    flags.update({k: v for k, v in spec.items() if k not in {"artifact", "profile", "port", "enabled", "api_key"}})
    artifact = str(spec.get("artifact", ""))
    target = Target(host=host.name, endpoint=endpoint, inventory_host=host,
                    server={"name": server, "host": host.name, "profile": profile, "flags": flags,
                            "port": int(spec["port"]), "artifact": artifact})
    gpu = host.gpu
    if gpu:
        target.gpu = {"name": gpu.name, "vram_mib": gpu.vram_mib, "compute_capability": gpu.compute_capability}
    if facts:
        _read_facts(target, host, artifact)
    return target


def profile_settings(host: Host, name: str) -> dict[str, Any]:
    """Profile ``name`` as the llama_server role resolves it: its ``extends`` chain (the child wins) and the
    host's ``llama_server_profile_overrides`` on top."""
    profiles = host.vars.get("llama_server_profiles") or {}
    chain: list[str] = []
    current: str | None = name
    while current is not None and current in profiles and current not in chain:
        chain.append(current)
        current = (profiles[current] or {}).get("extends")
    merged: dict[str, Any] = {}
    for link in [*reversed(chain), None]:
        layer = profiles[link] or {} if link else ((host.vars.get("llama_server_profile_overrides") or {}).get(name)
                                                   or {})
        for key, value in layer.items():
            merged[key] = {**merged[key], **value} if isinstance(value, dict) and isinstance(merged.get(key), dict) \
                else value
    merged.pop("extends", None)
    return merged


def _read_facts(target: Target, host: Host, artifact: str) -> None:
    from rigctl.build import read_builds
    from rigctl.models import artifact_path, inspect_host

    try:
        statuses = {s.artifact: s for s in inspect_host(host, rehash=False)}
        status = statuses.get(artifact)
        manifest = status.manifest if status else None
        target.artifacts = [{"name": artifact, "path": artifact_path(host, artifact),
                             "sha256": manifest.sha256 if manifest else None,
                             "manifest": manifest.raw if manifest else None}]
    except RigctlError as exc:
        log.warning("%s: model manifest not read: %s", host.name, exc)
    try:
        current = read_builds(host).current
        if current:
            target.llama_cpp = {"name": current.name, "commit": current.commit, "version": current.version,
                                "build_key": current.key, "cuda": current.cuda}
    except RigctlError as exc:
        log.warning("%s: llama.cpp build fact not read: %s", host.name, exc)


def url_target(url: str, *, api_key: str | None = None, host: str | None = None) -> Target:
    """Any OpenAI-compatible endpoint; results file under ``host`` (default: the URL's host name)."""
    endpoint = Endpoint(url, api_key)
    label = host or urllib.parse.urlparse(endpoint.url).hostname or "url"
    return Target(host=label, endpoint=endpoint, server={"url": endpoint.url})
