"""Collecting a run's provenance stamp (:class:`rigctl.results.record.Provenance`) from a host.

Runs the controller drives (eval, spec, server-speed, load) call :func:`collect_stamp` while their servers
run: one SSH round trip runs :mod:`rigctl.hostside.stamp` on the host, which reads each server unit's
main process and its ``/proc/<pid>/cmdline`` (the argv as deployed), the llama_cpp role's fact, the GPU
(``nvidia-smi``) and the artifacts' manifests. Jobs on the host (bench, remote eval) collect the same
fields there, with the same host-side code, before their task runs (:mod:`rigctl.hostside.jobrun`): the
host is where the job's record lives while it runs, and a bench stops the servers right after.

The host-side parsers (:func:`rigctl.hostside.llama_cpp_fact.parse_builds`, ``parse_gpu_query``) are the
ones jobs use, so a record reads the same whichever side collected it.
"""

from __future__ import annotations

import configparser
import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rigctl.errors import RigctlError
from rigctl.hostside import llama_cpp_fact, ship
from rigctl.hostside.stamp import parse_gpu_query
from rigctl.inventory import Host, profiles
from rigctl.results.record import Artifact, Gpu, LlamaCppBuild, Provenance, Server, Task, parse_json, rigctl_version
from rigctl.trust import redact_argv

if TYPE_CHECKING:
    from rigctl.ssh import SshClient

log = logging.getLogger(__name__)

STAMP_TIMEOUT = 60.0


def inventory_server(host: Host, instance: str, *, unit: str | None = None, port: int | None = None) -> Server:
    """The record's server for ``instance``: what the inventory's view names of it (profile, artifact, port,
    unit); its argv comes from the host. ``unit``/``port``: a probe that serves in the instance's place."""
    known = next((s for s in host.servers if s.name == instance), None)
    return Server(name=instance, host=host.name, unit=unit or (known.unit if known else profiles.unit_name(instance)),
                  profile=known.profile.name if known else None, artifact=known.artifact if known else None,
                  port=port if port is not None else (known.port if known else None))


def host_facts(ssh: SshClient, units: Sequence[str], manifest_paths: Sequence[str] = ()) -> dict[str, Any]:
    """The answer of :mod:`rigctl.hostside.stamp` on the host (one round trip)."""
    request = json.dumps({"units": list(units), "manifests": list(manifest_paths)})
    result = ssh.run(ship.python_command("stamp", request), timeout=STAMP_TIMEOUT, check=True)
    answer = parse_json(result.stdout, f"{ssh.host}: its provenance stamp")  # bounded: it goes into run.json
    if not isinstance(answer, dict):
        raise RigctlError(f"{ssh.host}: the provenance stamp came back as {type(answer).__name__}")
    return answer


def _deployed(server: Server, entry: Any, host: str) -> Server:
    if not isinstance(entry, dict):
        return server
    argv = entry.get("argv")
    if isinstance(argv, list) and all(isinstance(a, str) for a in argv) and argv:
        server.argv = redact_argv(argv)
        server.argv_from = str(entry.get("argv_from") or "")
        server.pid = int(entry["pid"]) if isinstance(entry.get("pid"), int) else None
    else:
        log.warning("%s: no deployed argv for %s: %s", host, server.unit, entry.get("error") or "not read")
    return server


def collect_stamp(host: Host, ssh: SshClient, servers: Sequence[Server], *, artifacts: Sequence[str] = (),
                  task: Task | None = None, matrix: dict[str, Any] | None = None, seed: int | None = None,
                  concurrency: int | None = None) -> Provenance:
    """The stamp of a run on ``host`` with ``servers`` (their argv read from the host as they run now),
    ``artifacts`` (names; sha256 from their manifests), and the run's task or matrix, seed, concurrency."""
    from rigctl.fleet.models import parse_manifest

    paths = {name: host.artifact(name).path for name in artifacts}
    answer = host_facts(ssh, [s.unit or profiles.unit_name(str(s.name)) for s in servers], list(paths.values()))
    entries = answer.get("servers") if isinstance(answer.get("servers"), list) else []
    stamped = [_deployed(s, entries[i] if i < len(entries) else None, host.name) for i, s in enumerate(servers)]
    build = LlamaCppBuild()
    if isinstance(answer.get("llama_cpp_fact"), str):
        try:
            current = llama_cpp_fact.parse_builds(answer["llama_cpp_fact"])["current"]
        except (configparser.Error, ValueError) as exc:  # a fact the role did not write: recorded as absent
            log.warning("%s: llama.cpp fact not read: %s", host.name, exc)
        else:
            build = LlamaCppBuild(**llama_cpp_fact.record_fields(current)) if current else build
    gpu = Gpu(bandwidth_gbs=host.gpu.bandwidth_gbs if host.gpu else None)
    if isinstance(answer.get("gpu_query"), str) and answer["gpu_query"].strip():
        try:
            gpu = Gpu(**parse_gpu_query(answer["gpu_query"]), bandwidth_gbs=gpu.bandwidth_gbs)
        except ValueError as exc:
            log.warning("%s: nvidia-smi answer not read: %s", host.name, exc)
    elif host.gpu:  # no nvidia-smi answer: the inventory's word, marked by the absent driver
        gpu = Gpu(name=host.gpu.name, vram_mib=host.gpu.vram_mib, compute_capability=host.gpu.compute_capability,
                  bandwidth_gbs=host.gpu.bandwidth_gbs)
    manifests = answer.get("manifests") if isinstance(answer.get("manifests"), dict) else {}
    stamped_artifacts = []
    for name, path in paths.items():
        artifact = Artifact(name=name, path=path)
        text = manifests.get(path)
        if isinstance(text, str):
            try:
                manifest = parse_manifest(text, host.name)
                artifact.sha256, artifact.sha256_from, artifact.bytes = manifest.sha256, "manifest", manifest.bytes
                artifact.manifest = manifest.raw
            except RigctlError as exc:
                log.warning("%s: manifest of %s not read: %s", host.name, name, exc)
        stamped_artifacts.append(artifact)
    return Provenance(host=host.name, gpu=gpu, llama_cpp=build, artifacts=stamped_artifacts, servers=stamped,
                      task=task, matrix=matrix, seed=seed, concurrency=concurrency, rigctl_version=rigctl_version())


def with_props(server: Server, props: Any, endpoint: Any = None) -> Server:
    """``server`` with what its ``/props`` (a :class:`rigctl.llama_http.Props`) and endpoint say."""
    server.build_info, server.model_path = props.build_info, props.model_path
    server.n_ctx, server.total_slots = props.n_ctx, props.total_slots
    if endpoint is not None:
        server.endpoint, server.label = endpoint.url, endpoint.label
    return server
