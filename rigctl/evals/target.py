"""What an eval runs against: an inventory server (with its provenance) or a bare OpenAI-compatible URL."""

from __future__ import annotations

import json
import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from rigctl.errors import RigctlError
from rigctl.inventory import Artifact, Host, Server
from rigctl.llama_http import Endpoint, Retry

#: The llama_server role's local fact: the unit's restart delay and each instance's measured load time.
SERVER_FACT_PATH = "/etc/ansible/facts.d/llama_server.fact"

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
    #: Enough retries to ride through a restart of the server (:func:`restart_retry`); None: not known.
    retry: Retry | None = None


def restart_retry(fact: str, server: str) -> Retry | None:
    """The retries that ride through one restart of ``server``, from the llama_server role's fact (the unit's
    restart delay, the load time its last rollout measured); None when the fact does not say."""
    try:
        data = json.loads(fact)
        restart_sec = float(data["restart_sec"])
        load_s = float(data["instances"][server]["load_s"])
    except (ValueError, KeyError, TypeError):
        return None
    return Retry.through_restart(restart_sec, load_s)


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
        statuses = {s.artifact: s for s in inspect_host(host, rehash=False, manifests_only=True)}
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
    target.retry = _server_retry(host, str(target.server.get("name")))


def _server_retry(host: Host, server: str) -> Retry | None:
    from rigctl.ssh import session

    try:
        with session(host) as ssh:
            fact = ssh.run(f"cat {SERVER_FACT_PATH}", timeout=30, check=False).stdout
    except RigctlError as exc:
        log.warning("%s: llama_server fact not read (default retries): %s", host.name, exc)
        return None
    retry = restart_retry(fact, server)
    if retry is None:
        log.info("%s: no measured load time for %s in %s (default retries)", host.name, server, SERVER_FACT_PATH)
    return retry


def url_target(url: str, *, api_key: str | None = None, host: str | None = None) -> Target:
    """Any OpenAI-compatible endpoint; results file under ``host`` (default: the URL's host name)."""
    endpoint = Endpoint(url, api_key)
    label = host or urllib.parse.urlparse(endpoint.url).hostname or "url"
    return Target(host=label, endpoint=endpoint, server={"url": endpoint.url})
