"""What an eval runs against: an inventory server (with its provenance stamp) or a bare OpenAI-compatible URL.

An inventory server's provenance is the one run stamp (:func:`rigctl.results.stamp.collect_stamp`: the
artifact's sha256 from its manifest, the llama.cpp build, the argv as deployed, the GPU), read from its host
once, when the target is made: what a fan-out checks its servers against and what the run's record keeps.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rigctl.errors import RigctlError
from rigctl.inventory import Host, Server
from rigctl.llama_http import Endpoint
from rigctl.results.record import Artifact, Provenance
from rigctl.results.record import Server as ServerRecord


@dataclass
class Target:
    """Where answers come from, and what the run's record keeps about it."""

    host: str  # the results tree's host directory
    endpoint: Endpoint
    name: str | None = None  # the llama_server instance; None for a bare URL
    artifact: str | None = None
    stamp: Provenance | None = None  # read from the host (inventory servers), or the endpoint alone
    inventory_host: Host | None = None
    inventory_server: Server | None = None
    #: What the host could not read for the stamp (a server not running has no argv): said when a run
    #: starts with it (:func:`rigctl.evals.runner.target_stamp`), not when a fan-out is refused.
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.host}/{self.name or '?'}"

    @property
    def flags(self) -> dict[str, Any]:
        """The profile as the host serves it (extends chain and host overrides), and the GPU pin."""
        served = self.inventory_server
        if served is None:
            return {}
        flags = dict(served.profile.settings)
        if served.gpu is not None:
            flags["gpu"] = served.gpu
        return flags

    def provenance(self) -> Provenance:
        """The target's stamp: read from its host now when it was not (:func:`read_stamp`), the endpoint's
        alone for a bare URL."""
        if self.stamp is None:
            self.stamp = read_stamp(self)
        return self.stamp


def read_stamp(target: Target) -> Provenance:
    """``target``'s stamp read from its host as its server runs now (one SSH round trip). A host that cannot
    be read over SSH (the server may answer over HTTP while SSH does not) is logged, and the stamp names
    the server and artifact from the inventory, without what the host would have said."""
    from rigctl.results.stamp import collect_stamp, inventory_server
    from rigctl.ssh import session

    host = target.inventory_host
    if host is None or not target.name:
        return Provenance(host=target.host, servers=[ServerRecord(endpoint=target.endpoint.url)])
    artifacts = [target.artifact] if target.artifact else []
    try:
        with session(host) as ssh:
            return collect_stamp(host, ssh, [inventory_server(host, target.name)], artifacts=artifacts,
                                 notes=target.notes)
    except RigctlError as exc:
        target.notes.append(f"{host.name}: provenance not read (the record names the server, no argv): {exc}")
        return Provenance(host=target.host, servers=[inventory_server(host, target.name)],
                          artifacts=[Artifact(name=name) for name in artifacts])


def inventory_target(host: Host, server: str, *, url: str | None = None, api_key: str | None = None,
                     facts: bool = True) -> Target:
    """An inventory server: endpoint and key from the inventory (``url``/``api_key`` override them), and with
    ``facts`` its stamp read from the host now (:func:`read_stamp`; else when the run needs it)."""
    from rigctl.forward import server_endpoint

    served = host.server(server)
    endpoint = Endpoint(url, served.api_key, f"{host.name}/{server}") if url else server_endpoint(host, served)
    if api_key:
        endpoint = replace(endpoint, api_key=api_key)
    target = Target(host=host.name, endpoint=endpoint, name=server, artifact=served.artifact, inventory_host=host,
                    inventory_server=served)
    if facts:
        target.provenance()
    return target


def inventory_targets(servers: Sequence[tuple[Host, str]], *, url: str | None = None, api_key: str | None = None,
                      facts: bool = True) -> list[Target]:
    """:func:`inventory_target` for each (host, server) of a fan-out, in order; with ``facts`` their stamps read
    from every host at once (a host's own servers one after the other), so a fan-out over N hosts waits for
    one SSH round trip, not N in a row."""
    from rigctl.connections import on_each_host

    targets = [inventory_target(host, server, url=url, api_key=api_key, facts=False) for host, server in servers]
    if facts:
        by_host: dict[str, list[Target]] = {}
        for target in targets:
            by_host.setdefault(target.host, []).append(target)
        hosts = [group[0].inventory_host for group in by_host.values() if group[0].inventory_host is not None]
        outcomes = on_each_host(hosts, lambda host: [t.provenance() for t in by_host[host.name]],
                                thread_name_prefix="rigctl-stamps")
        # read_stamp keeps a host it cannot reach; what is left is an answer that could not be read at all.
        failed = [outcome for outcome in outcomes.values() if isinstance(outcome, RigctlError)]
        if failed:
            raise failed[0]
    return targets


def url_target(url: str, *, api_key: str | None = None, host: str | None = None) -> Target:
    """Any OpenAI-compatible endpoint; results file under ``host`` (default: the URL's host name)."""
    endpoint = Endpoint(url, api_key)
    label = host or urllib.parse.urlparse(endpoint.url).hostname or "url"
    return Target(host=label, endpoint=endpoint)
