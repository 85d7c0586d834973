"""A run's provenance stamp (:class:`rigctl.results.record.Provenance`) for runs the controller drives.

The stamp has one builder, on the host (:func:`rigctl.hostside.stamp.complete`). This module states what
the inventory says of a run (:func:`inventory_stamp`: the host, its GPU, the servers' names, units and
ports, the artifacts' paths, the task...), which is also what a run's record begins with before any host
was asked (:func:`rigctl.results.run.open_run`), and ships it to the host to be completed
(:func:`complete_on_host`: one SSH round trip). What comes back is data: only what the host was asked to
read (each server's argv as deployed, the config files it applied and the names of the llama.cpp variables in
its environment, the GPU, the build, the artifacts' sha256 and manifests) is taken
from it, checked against the record's types, argv redacted once more.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import rigctl
from rigctl.errors import ConfigError, RigctlError
from rigctl.hostside import ship
from rigctl.inputs import error_line
from rigctl.inventory import Host, profiles
from rigctl.results.record import Artifact, Gpu, Provenance, Server, Task, parse_json
from rigctl.trust import redact_argv

if TYPE_CHECKING:
    from rigctl.ssh import SshClient

log = logging.getLogger(__name__)

STAMP_TIMEOUT = 60.0
#: What a host's answer may set on a server and an artifact of the stamp: what it was asked to read.
_HOST_SERVER_FIELDS = ("argv", "argv_from", "pid", "config_files", "environment")
_HOST_ARTIFACT_FIELDS = ("sha256", "sha256_from", "bytes", "manifest")


def inventory_server(host: Host, instance: str, *, unit: str | None = None, port: int | None = None) -> Server:
    """The record's server for ``instance``: what the inventory's view names of it (profile, artifact, port,
    unit); its argv comes from the host. ``unit``/``port``: a probe that serves in the instance's place."""
    known = next((s for s in host.servers if s.name == instance), None)
    return Server(name=instance, host=host.name, unit=unit or (known.unit if known else profiles.unit_name(instance)),
                  profile=known.profile.name if known else None, artifact=known.artifact if known else None,
                  port=port if port is not None else (known.port if known else None))


def inventory_gpu(host: Host) -> Gpu:
    """The inventory's word on ``host``'s GPU (the host's nvidia-smi replaces it, keeping the bandwidth)."""
    gpu = host.gpu
    if gpu is None:
        return Gpu()
    return Gpu(name=gpu.name, vram_mib=gpu.vram_mib, compute_capability=gpu.compute_capability,
               bandwidth_gbs=gpu.bandwidth_gbs)


def inventory_stamp(host: Host, servers: Sequence[Server] = (), *, artifacts: Sequence[str] = (),
                    task: Task | None = None, matrix: dict[str, Any] | None = None, seed: int | None = None,
                    concurrency: int | None = None) -> Provenance:
    """The stamp of a run on ``host`` as far as the inventory knows it: ``servers`` (their names; no argv),
    ``artifacts`` (names, with their paths on the host), the GPU, and the run's task or matrix, seed,
    concurrency."""
    return Provenance(host=host.name, gpu=inventory_gpu(host), servers=list(servers),
                      artifacts=[Artifact(name=name, path=host.artifact(name).path) for name in artifacts],
                      task=task, matrix=matrix, seed=seed, concurrency=concurrency, rigctl_version=rigctl.__version__,
                      rigctl_commit=rigctl.__commit__)


def complete_on_host(ssh: SshClient, stamp: Provenance, *, notes: list[str] | None = None) -> Provenance:
    """``stamp`` completed by :func:`rigctl.hostside.stamp.complete` on the host (one round trip): each
    server's argv as deployed, the GPU, the build, the artifacts' manifests. What the host could not read is
    left as the inventory says and logged, or added to ``notes`` for the caller to say when it matters."""
    request = json.dumps({"stamp": dataclasses.asdict(stamp)})
    result = ssh.run(ship.python_command("stamp", request), timeout=STAMP_TIMEOUT, check=True)
    origin = f"{ssh.host}: its provenance stamp"
    answer = parse_json(result.stdout, origin)  # bounded: it goes into run.json
    if not isinstance(answer, dict) or not isinstance(answer.get("stamp"), dict):
        raise RigctlError(f"{origin} came back as {type(answer).__name__}, not an object with a stamp")
    read = _checked(answer["stamp"], origin)
    for note in answer.get("notes") if isinstance(answer.get("notes"), list) else []:
        line = f"{ssh.host}: {str(note)[:500]}"
        if notes is None:
            log.warning("%s", line)
        else:
            notes.append(line)
    done = dataclasses.replace(stamp, gpu=read.gpu, llama_cpp=read.llama_cpp,
                               servers=[dataclasses.replace(s) for s in stamp.servers],
                               artifacts=[dataclasses.replace(a) for a in stamp.artifacts])
    for mine, theirs in zip(done.servers, read.servers, strict=False):
        for name in _HOST_SERVER_FIELDS:
            setattr(mine, name, getattr(theirs, name))
        mine.argv = redact_argv(mine.argv)
        mine.unit = mine.unit or theirs.unit  # the instance's default unit, which the host read
    for mine_artifact, theirs_artifact in zip(done.artifacts, read.artifacts, strict=False):
        for name in _HOST_ARTIFACT_FIELDS:
            setattr(mine_artifact, name, getattr(theirs_artifact, name))
    return done


def collect_stamp(host: Host, ssh: SshClient, servers: Sequence[Server], *, artifacts: Sequence[str] = (),
                  task: Task | None = None, matrix: dict[str, Any] | None = None, seed: int | None = None,
                  concurrency: int | None = None, notes: list[str] | None = None) -> Provenance:
    """The stamp of a run on ``host`` with ``servers`` (their argv read from the host as they run now),
    ``artifacts`` (names; sha256 from their manifests), and the run's task or matrix, seed, concurrency."""
    return complete_on_host(ssh, inventory_stamp(host, servers, artifacts=artifacts, task=task, matrix=matrix,
                                                 seed=seed, concurrency=concurrency), notes=notes)


_PROVENANCE_ADAPTER: Any = None


def _checked(data: dict[str, Any], origin: str) -> Provenance:
    """A host's stamp checked against the record's types."""
    global _PROVENANCE_ADAPTER
    from pydantic import TypeAdapter, ValidationError

    if _PROVENANCE_ADAPTER is None:
        _PROVENANCE_ADAPTER = TypeAdapter(Provenance)
    try:
        return _PROVENANCE_ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise ConfigError(error_line(exc, origin)) from None


def with_props(server: Server, props: Any, endpoint: Any = None) -> Server:
    """``server`` with what its ``/props`` (a :class:`rigctl.llama_http.Props`) and endpoint say."""
    server.build_info, server.model_path = props.build_info, props.model_path
    server.n_ctx, server.total_slots = props.n_ctx, props.total_slots
    server.chat_template_sha256 = hashlib.sha256(props.chat_template.encode()).hexdigest() if props.chat_template \
        else None
    if endpoint is not None:
        server.endpoint, server.label = endpoint.url, endpoint.label
    return server
