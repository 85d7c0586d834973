"""What an eval runs against: an inventory server (with its provenance) or a bare OpenAI-compatible URL."""

from __future__ import annotations

import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from rigctl.errors import RigctlError
from rigctl.inventory import Artifact, Host, Server
from rigctl.llama_http import Endpoint

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
    inventory_server: Server | None = None


def inventory_target(host: Host, server: str, *, url: str | None = None, api_key: str | None = None,
                     facts: bool = True) -> Target:
    """An inventory server: endpoint and key from the inventory (``url``/``api_key`` override them), the
    profile as the host serves it (extends chain and host overrides) as the server's flags, and with
    ``facts`` the model's manifest and the llama.cpp build read from the host over SSH (a host that cannot
    be read is logged and left out)."""
    served = host.server(server)
    endpoint = served.endpoint
    if url or api_key:
        endpoint = Endpoint(url or endpoint.url, api_key or endpoint.api_key, f"{host.name}/{server}")
    flags = dict(served.profile.settings)
    if served.gpu is not None:
        flags["gpu"] = served.gpu
    target = Target(host=host.name, endpoint=endpoint, inventory_host=host, inventory_server=served,
                    server={"name": server, "host": host.name, "profile": served.profile.name, "flags": flags,
                            "port": served.port, "artifact": served.artifact})
    gpu = host.gpu
    if gpu:
        target.gpu = {"name": gpu.name, "vram_mib": gpu.vram_mib, "compute_capability": gpu.compute_capability}
    if facts:
        _read_facts(target, host, served.model)
    return target


def _read_facts(target: Target, host: Host, artifact: Artifact) -> None:
    from rigctl.fleet.build import read_builds
    from rigctl.fleet.models import inspect_host

    try:
        statuses = {s.artifact: s for s in inspect_host(host, rehash=False)}
        status = statuses.get(artifact.name)
        manifest = status.manifest if status else None
        target.artifacts = [{"name": artifact.name, "path": artifact.path,
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
