"""Model artifacts on the hosts: manifests, hash pins, `rigctl models verify|pin|list`.

The models role leaves ``<models_dir>/<artifact>.gguf`` with ``<artifact>.gguf.manifest.json`` beside it
(bytes, sha256, tensors and bytes per ggml type, llama.cpp build, source, command, wall time) and checks
each file against ``models_pins`` (host_vars) under ``models_pin_policy``. This module reads the same
inventory variables: it lists the manifests, re-hashes files against their pins without rebuilding
anything, and writes observed hashes into host_vars as a reviewable diff.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigctl.errors import ConfigError, PinError, RigctlError
from rigctl.hostside import hash_cache, ship
from rigctl.inventory import Host, Inventory
from rigctl.inventory.edit import InventoryEdit
from rigctl.inventory.keys import SHA256
from rigctl.results.record import parse_json

log = logging.getLogger(__name__)

SSH_TIMEOUT = 600.0  # sha256 of a 4 GB file on a slow disk


@dataclass(frozen=True)
class TypeStats:
    tensors: int
    bytes: int


@dataclass(frozen=True)
class Manifest:
    artifact: str
    host: str
    path: str
    bytes: int
    sha256: str
    tensor_count: int
    types: dict[str, TypeStats]
    llama_cpp: dict[str, Any]
    source: dict[str, Any]
    command: str
    wall_s: float
    raw: dict[str, Any]

    @property
    def quant_mix(self) -> str:
        """Tensors per type, largest share first: ``194 Q4_0 (806.4 MB), 1 Q6_K (417.2 MB), 140 F32``."""
        parts = []
        for name, stats in sorted(self.types.items(), key=lambda kv: (-kv[1].bytes, kv[0])):
            size = f" ({stats.bytes / 1e6:.1f} MB)" if stats.bytes >= 1e6 else ""
            parts.append(f"{stats.tensors} {name}{size}")
        return ", ".join(parts)


def parse_manifest(text: str, host: str = "?") -> Manifest:
    """A manifest's JSON as :class:`Manifest`; PinError naming the host when it is not one."""
    try:
        data = json.loads(text)
        return Manifest(
            artifact=str(data["artifact"]),
            host=str(data.get("host", host)),
            path=str(data["path"]),
            bytes=int(data["bytes"]),
            sha256=str(data["sha256"]),
            tensor_count=int(data["tensor_count"]),
            types={k: TypeStats(int(v["tensors"]), int(v["bytes"])) for k, v in data["types"].items()},
            llama_cpp=dict(data.get("llama_cpp") or {}),
            source=dict(data.get("source") or {}),
            command=str(data.get("command", "")),
            wall_s=float(data.get("wall_s", 0.0)),
            raw=data,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PinError(f"{host}: not a models manifest: {exc}") from None


@dataclass(frozen=True)
class ArtifactStatus:
    """One artifact on one host: what its manifest says, what the file hashes to, and its pin."""

    host: str
    artifact: str
    path: str
    manifest: Manifest | None
    actual_sha256: str | None  # the file's own hash (read now, or cached for its identity); None: missing
    pin: str | None

    @property
    def sha256(self) -> str | None:
        return self.actual_sha256 or (self.manifest.sha256 if self.manifest else None)

    @property
    def expected(self) -> tuple[str | None, str]:
        return expected_sha256(self.pin, self.manifest.sha256 if self.manifest else None)

    @property
    def status(self) -> str:
        """missing, unpinned, ok or mismatch (against the pin, else against the manifest)."""
        if self.sha256 is None:
            return "missing"
        expected, _ = self.expected
        if self.actual_sha256 is not None and expected is not None and self.actual_sha256 != expected:
            return "mismatch"
        if not self.pin:
            return "unpinned"
        return "ok" if self.pin == self.sha256 else "mismatch"

    def describe(self) -> str:
        if self.status == "mismatch":
            expected, origin = self.expected
            if origin == "manifest":
                return (f"{self.host}: {self.artifact}: no pin, and {self.path} has {self.sha256} but its manifest "
                        f"records {expected} (changed since the models role made it)")
            return f"{self.host}: {self.artifact}: pinned sha256 {self.pin} but {self.path} has {self.sha256}"
        if self.status == "missing":
            return f"{self.host}: {self.artifact}: {self.path} is missing"
        return f"{self.host}: {self.artifact}: {self.status}"


def expected_sha256(pin: str | None, manifest_sha256: str | None) -> tuple[str | None, str]:
    """The hash a model file should have and where that comes from: the inventory's pin, else the manifest
    the models role wrote when it made the file. `models verify` and the exporter's drift both use this."""
    if pin:
        return pin, "inventory"
    if manifest_sha256:
        return manifest_sha256, "manifest"
    return None, "none"


def inspect_host(host: Host, *, rehash: bool, timeout: float = SSH_TIMEOUT) -> list[ArtifactStatus]:
    """Each artifact of ``host`` with its manifest and the sha256 of the file as it is now: with ``rehash``
    read in full, else from the host's hash cache while the file keeps the identity it was hashed with
    (:mod:`rigctl.hostside.hash_cache`; a file changed since is hashed again)."""
    from rigctl.ssh import session

    artifacts = host.artifacts
    names = [a.name for a in artifacts]
    paths = {a.name: a.path for a in artifacts}
    pins = {a.name: a.pin for a in artifacts if a.pin}
    # One round trip: every manifest and every file's hash, as one JSON object.
    if rehash:
        cmd = ship.python_command("model_files", "inspect", json.dumps(paths), "1")
    else:
        cmd = ship.python_command("hash_cache", "inspect", json.dumps(paths), hash_cache.HOST_CACHE)
    with session(host) as ssh:
        result = ssh.run(cmd, timeout=timeout)
    try:
        found = parse_json(result.stdout, f"{host.name}: its model files")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{host.name}: its model files: not JSON ({exc.msg})") from None
    if not isinstance(found, dict):
        raise ConfigError(f"{host.name}: its model files: a JSON {type(found).__name__}, not an object")
    statuses = []
    for name in names:
        entry = found.get(name, {})
        manifest = parse_manifest(entry["manifest"], host.name) if "manifest" in entry else None
        statuses.append(ArtifactStatus(host.name, name, paths[name], manifest, entry.get("sha256"), pins.get(name)))
    return statuses


def _fleet(inventory: Inventory, limit: str | None, *, rehash: bool) -> dict[str, list[ArtifactStatus] | RigctlError]:
    from rigctl.connections import on_each_host

    # Hosts hash their files at the same time: a fleet check takes as long as its slowest host; one host
    # unreachable, or answering what cannot be read, never hides the others.
    return on_each_host(inventory.select(limit), lambda host: inspect_host(host, rehash=rehash), max_workers=16,
                        thread_name_prefix="rigctl-models")


def list_artifacts(inventory: Inventory, limit: str | None = None) -> dict[str, list[ArtifactStatus] | RigctlError]:
    """`rigctl models list`: per host, each artifact's manifest and pin status (no re-hashing)."""
    return _fleet(inventory, limit, rehash=False)


def verify(inventory: Inventory, limit: str | None = None) -> dict[str, list[ArtifactStatus] | RigctlError]:
    """`rigctl models verify`: re-hash every artifact on every host and compare with its pin."""
    return _fleet(inventory, limit, rehash=True)


def problems(results: Mapping[str, list[ArtifactStatus] | RigctlError]) -> list[str]:
    """One line per host that failed, artifact missing, or pin mismatch."""
    lines = []
    for host, outcome in results.items():
        if isinstance(outcome, RigctlError):
            lines.append(str(outcome) if str(outcome).startswith(host) else f"{host}: {outcome}")
            continue
        lines.extend(s.describe() for s in outcome if s.status in {"mismatch", "missing"})
    return lines


def pin(inventory: Inventory, limit: str | None = None) -> dict[str, dict[str, str]]:
    """`rigctl models pin`: write each host's observed sha256s into ``<inventory>/host_vars/<host>.yml``.

    Hashes come from the files themselves (re-hashed now), never from manifests alone. A host that
    cannot be reached or lacks an artifact fails the whole command before anything is written.
    """
    results = verify(inventory, limit)
    bad = [line for line in problems(results) if "pinned sha256" not in line]
    if bad:
        raise PinError("; ".join(bad))
    observed: dict[str, dict[str, str]] = {}
    for host, statuses in results.items():
        if isinstance(statuses, RigctlError):  # problems() above already refused these
            raise statuses
        observed[host] = {s.artifact: s.sha256 for s in statuses if s.sha256 and SHA256.match(s.sha256)}
    write_pins(inventory, observed)
    return observed


def write_pins(inventory: Inventory, pins: Mapping[str, Mapping[str, str]]) -> None:
    """``{host: {artifact: sha256}}`` as each host's ``models_pins`` in its host_vars file, in one edit
    (:mod:`rigctl.inventory.edit`: round trip, and refused with no file written when the result would fail
    ``inventory check``)."""
    from rigctl.fleet.deploy import roles_paths

    host_vars = Path(inventory.source) / "host_vars"
    if not host_vars.is_dir():
        raise ConfigError(f"inventory {inventory.source}: no host_vars directory to write pins into")
    edit = InventoryEdit(inventory.source, roles_paths(), what="models pin")
    for host, host_pins in pins.items():
        edit.update(host_vars / f"{host}.yml", {"models_pins": dict(sorted(host_pins.items()))})
    edit.commit()
    for host, host_pins in pins.items():
        log.info("%s: pinned %d artifacts in %s", host, len(host_pins), host_vars / f"{host}.yml")


def rows(results: Mapping[str, list[ArtifactStatus] | RigctlError]) -> Iterable[tuple[str, ...]]:
    """Table rows for `rigctl models list`: host, artifact, size, quant mix, sha256 (short), pin status."""
    for host, outcome in results.items():
        if isinstance(outcome, RigctlError):
            yield (host, "-", "-", str(outcome), "-", "unreachable")
            continue
        for s in outcome:
            m = s.manifest
            yield (host, s.artifact, f"{m.bytes / 1e6:.1f} MB" if m else "-", m.quant_mix if m else "-",
                   (s.sha256 or "-")[:12], s.status)
