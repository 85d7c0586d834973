"""The fleet's state as it is now, against what the inventory pins: per host, reachability over SSH, the running
llama.cpp build, each model file's sha256, the GPUs (``nvidia-smi``) and the ``llama-server@`` units. Read by the
exporter (:mod:`rigctl.services.exporter`) and the MCP server's ``fleet_status``.

Each host is read with one SSH command (:mod:`rigctl.hostside.fleet_state`) whose raw outputs are parsed by
pure functions (:func:`parse_nvidia_smi` here, :func:`rigctl.fleet.servers.parse_unit_show`,
:func:`rigctl.fleet.build.parse_fact`, :func:`rigctl.fleet.models.parse_manifest`). Every host is read at once,
each bounded by its own timeout, so a dead host costs one timeout and never stalls the others. Model files are
re-hashed only when their size, mtime, ctime or inode change (:func:`rigctl.hostside.model_files.identity`), on a
slower lane of their own (:func:`rigctl.hostside.model_files.hash_unchanged`), so a 4 GB file never holds up a
reading."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from rigctl.errors import ConfigError, RigctlError, one_line
from rigctl.fleet.build import Builds, parse_fact
from rigctl.fleet.models import expected_sha256, parse_manifest
from rigctl.fleet.servers import UNIT_PROPERTIES, UnitState, parse_pending_restarts, parse_unit_show
from rigctl.hostside import nvidia_smi, sandbox, ship
from rigctl.hostside.llama_cpp_fact import FACT_PATH
from rigctl.inventory import Host, Inventory
from rigctl.inventory.advisories import FloorCheck, build_number, check_build, host_allowed
from rigctl.inventory.profiles import unit_name
from rigctl.results.record import parse_json

log = logging.getLogger(__name__)

DEFAULT_HOST_TIMEOUT = 10.0
#: Readings of one machine (address and port) at once. Inventory names beyond this for one machine queue for a
#: turn, each bounded by the host timeout, instead of all sharing its CPU until every one of them runs past it.
READINGS_PER_MACHINE = 4
DEFAULT_HASH_TIMEOUT = 900.0  # sha256 of a few GB on a slow disk
UNIT_PATTERN = unit_name("*")
NVIDIA_SMI_FIELDS = ("index", "uuid", "name", "temperature.gpu", "memory.used", "memory.total", "utilization.gpu")
_MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuSample:
    index: str
    uuid: str
    name: str
    temperature_celsius: float | None
    memory_used_bytes: float | None
    memory_total_bytes: float | None
    utilization_ratio: float | None


@dataclass(frozen=True)
class ModelFact:
    artifact: str
    path: str
    present: bool
    sha256: str | None  # of the file now; None: missing or not hashed yet
    pin: str | None  # the inventory's models_pins entry
    manifest_sha256: str | None  # what the models role recorded when it made the file
    bytes: int | None

    @property
    def expected(self) -> tuple[str | None, str]:
        """The hash the file should have, and where that comes from (inventory pin, else manifest)."""
        return expected_sha256(self.pin, self.manifest_sha256)

    @property
    def drift(self) -> bool | None:
        """True: missing or differs from its pin; False: matches; None: not known (yet)."""
        expected, _ = self.expected
        if not self.present:
            return True
        if self.sha256 is None or expected is None:
            return None
        return self.sha256 != expected


@dataclass
class HostState:
    host: str
    up: bool
    error: str | None = None
    duration_seconds: float = 0.0
    builds: Builds | None = None
    gpus: list[GpuSample] = field(default_factory=list)
    gpu_error: str | None = None
    #: Each GPU's health (:func:`rigctl.hostside.nvidia_smi.parse_health`); health_error: why there is none.
    health: list[nvidia_smi.GpuHealth] = field(default_factory=list)
    health_error: str | None = None
    #: The kernel log's Xid reports since boot; None: the log could not be read (xid_error says why).
    xids: list[nvidia_smi.XidEvent] | None = None
    xid_error: str | None = None
    units: list[UnitState] = field(default_factory=list)
    models: list[ModelFact] = field(default_factory=list)
    #: Running instances whose process differs from their files (files a play wrote and did not apply),
    #: with what differs: :mod:`rigctl.hostside.server_drift`.
    pending_restarts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: The llama.cpp config files on the host (rigctl/hostside/sandbox.py's fact): drift, unless adopted.
    config_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostPlan:
    """What the inventory says a host should run: the pins the facts are compared against."""

    host: str
    pinned_version: str
    pinned_source: str
    servers: Mapping[str, Mapping[str, Any]]  # name -> artifact, profile, port, enabled
    allowed_advisories: Mapping[str, str] = field(default_factory=dict)  # the CVE floor's accepted ids

    @classmethod
    def from_host(cls, host: Host) -> HostPlan:
        pin = host.llama_cpp if "llama_cpp_source" in host.vars else None
        return cls(
            host=host.name,
            pinned_version=pin.version if pin else "",
            pinned_source=pin.source if pin else "",
            servers={s.name: {"artifact": s.artifact, "profile": s.profile.name, "port": s.port, "enabled": s.enabled}
                     for s in host.servers},
            allowed_advisories=host_allowed(host),
        )

    def floor(self, build: int) -> FloorCheck:
        """``build`` against the CVE floor, with this host's accepted advisories."""
        return check_build(build, self.allowed_advisories)

    @property
    def pinned_build(self) -> int | None:
        """The pin's upstream build number, where the pin says it (an archive's ``bNNNN``)."""
        return build_number(self.pinned_version) if self.pinned_source == "archive" else None

    def build_drift(self, builds: Builds | None) -> bool | None:
        """Whether the running build is not the pinned one (None: nothing to compare)."""
        if builds is None or builds.current is None or not self.pinned_version:
            return None if builds is None else True
        current = builds.current
        if self.pinned_source == "git":
            commit, pin = current.commit.lower(), self.pinned_version.lower()
            return not (commit and (commit.startswith(pin) or pin.startswith(commit)))
        return current.version != self.pinned_version


def parse_nvidia_smi(text: str) -> list[GpuSample]:
    """``nvidia-smi --query-gpu=<NVIDIA_SMI_FIELDS> --format=csv,noheader,nounits`` as samples; a cell the
    driver cannot fill (a unified-memory GPU's memory.total, a MIG GPU's utilization) is None."""
    samples = []
    for row in nvidia_smi.query_rows(text, NVIDIA_SMI_FIELDS):
        used_mib, total_mib = nvidia_smi.number(row["memory.used"]), nvidia_smi.number(row["memory.total"])
        utilization = nvidia_smi.number(row["utilization.gpu"])
        samples.append(GpuSample(
            index=row["index"],
            uuid=row["uuid"],
            name=row["name"],
            temperature_celsius=nvidia_smi.number(row["temperature.gpu"]),
            memory_used_bytes=used_mib * _MIB if used_mib is not None else None,
            memory_total_bytes=total_mib * _MIB if total_mib is not None else None,
            utilization_ratio=utilization / 100.0 if utilization is not None else None,
        ))
    return samples


def read_health(facts: HostState, raw: Mapping[str, Any]) -> None:
    """The GPU health query's and the kernel log's answers of one reading into ``facts``; a driver or kernel
    log that answers nothing costs those metrics (with the reason logged), never the host's other ones."""
    health = raw.get("health") or {}
    fields = health.get("fields")
    if health.get("rc") == 0 and isinstance(fields, list) and fields in (
            list(nvidia_smi.HEALTH_FIELDS), list(nvidia_smi.LEGACY_HEALTH_FIELDS)):
        try:
            facts.health = nvidia_smi.parse_health(str(health.get("out", "")), fields)
        except ValueError as exc:
            facts.health_error = str(exc)
    elif health:
        facts.health_error = (str(health.get("err") or "")).strip()[:300] or f"nvidia-smi exited {health.get('rc')}"
    kernel = raw.get("kernel_xids") or {}
    if kernel.get("rc") == 0:
        facts.xids = nvidia_smi.parse_xids(str(kernel.get("out", "")))
    elif kernel:
        facts.xid_error = (str(kernel.get("err") or "")).strip()[:300] or f"exited {kernel.get('rc')}"
    for what, error in (("GPU health", facts.health_error), ("kernel log", facts.xid_error)):
        if error:
            log.info("%s: no %s: %s", facts.host, what, error)


def unit_instance(unit: str) -> str:
    """``smollm2`` for ``llama-server@smollm2.service``."""
    stem = unit.removesuffix(".service")
    return stem.split("@", 1)[1] if "@" in stem else stem


_STAT_BYTES = 2  # the size in rigctl.hostside.model_files.identity's list


def _stat_key(stat: Sequence[int] | None) -> tuple[int, ...] | None:
    return tuple(int(v) for v in stat) if stat else None


def _machine(host: Host) -> tuple[str, str]:
    """Where ``host``'s sshd listens, as the inventory says it (a bad port is that host's reading's error)."""
    return host.address, str(host.vars.get("ansible_port", 22))


class WarnOnce:
    """Says each distinct warning once: the exporter reads the same hosts and records every few seconds, and a
    bad record or manifest would otherwise repeat its warning at every reading."""

    def __init__(self) -> None:
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, message: str) -> None:
        with self._lock:
            if message in self._said:
                return
            self._said.add(message)
        log.warning("%s", message)


class FleetState:
    """Reads the state of the inventory's hosts (``limit``: a host pattern), all at once; model files are
    hashed on a slower lane whose results later readings use. :meth:`close` when done."""

    def __init__(self, inventory: Inventory, *, limit: str | None = None,
                 host_timeout: float = DEFAULT_HOST_TIMEOUT, hash_timeout: float = DEFAULT_HASH_TIMEOUT):
        self.hosts = inventory.select(limit)
        self.plans = {h.name: HostPlan.from_host(h) for h in self.hosts}
        self.host_timeout = host_timeout
        self.hash_timeout = hash_timeout
        # A hung host keeps its worker until its own SSH timeouts fire; the next reading then skips it.
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.hosts)), thread_name_prefix="rigctl-probe")
        self._hash_pool = ThreadPoolExecutor(max_workers=max(1, len(self.hosts)), thread_name_prefix="rigctl-hash")
        self._inflight: dict[str, Future[HostState]] = {}
        self._hashing: dict[str, Future[None]] = {}
        self._hashes: dict[tuple[str, str], tuple[tuple[int, ...], str]] = {}  # (host, path) -> (stat, sha256)
        self._up: dict[str, bool] = {}  # each host as the last reading found it
        self._warn = WarnOnce()
        self._turns = {_machine(h): threading.BoundedSemaphore(READINGS_PER_MACHINE) for h in self.hosts}

    def read(self) -> dict[str, HostState]:
        """Every host's state now, each bounded by the host timeout."""
        return self.finish_reading(self.start_reading(), time.monotonic())

    def start_reading(self) -> dict[str, Future[HostState]]:
        """Start reading every host (a host still being read from the last time is not asked again)."""
        futures: dict[str, Future[HostState]] = {}
        for host in self.hosts:
            running = self._inflight.get(host.name)
            if running is None or running.done():
                running = self._pool.submit(self._read_host, host)
                self._inflight[host.name] = running
            futures[host.name] = running
        return futures

    def finish_reading(self, futures: Mapping[str, Future[HostState]], started: float) -> dict[str, HostState]:
        """The hosts' states once read, or down with "no answer" at the host timeout after ``started``."""
        remaining = max(0.0, self.host_timeout + 1.0 - (time.monotonic() - started))
        wait_futures(futures.values(), timeout=remaining)
        hosts: dict[str, HostState] = {}
        for name, future in futures.items():
            if future.done():
                hosts[name] = self._answered(name, future, started)
            else:
                hosts[name] = HostState(name, up=False, error=f"no answer within {self.host_timeout:g}s",
                                        duration_seconds=time.monotonic() - started)
        self._log_changes(hosts)
        return hosts

    def _log_changes(self, hosts: Mapping[str, HostState]) -> None:
        """A host going down (or found down at the first reading) is a warning with the reason; one coming back,
        another; a host that stays as it was says nothing."""
        for name, state in hosts.items():
            was = self._up.get(name)
            if not state.up and was is not False:
                log.warning("%s: down: %s", name, state.error)
            elif state.up and was is False:
                log.warning("%s: back up", name)
            self._up[name] = state.up

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._hash_pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _answered(name: str, future: Future[HostState], started: float) -> HostState:
        """A finished reading's state; whatever a host's answer provoked in reading it blanks that host only."""
        try:
            return future.result()
        except Exception as exc:
            error = one_line(exc)
            if not isinstance(exc, RigctlError):
                error = f"its probe answer cannot be read: {error}"
            return HostState(name, up=False, error=error, duration_seconds=time.monotonic() - started)

    def _read_host(self, host: Host) -> HostState:
        started = time.monotonic()
        turn = self._turns[_machine(host)]
        if not turn.acquire(timeout=self.host_timeout):
            return HostState(host.name, up=False, duration_seconds=time.monotonic() - started,
                             error=f"no answer within {self.host_timeout:g}s: {READINGS_PER_MACHINE} readings of "
                                   f"{host.address} (other inventory names for it) took every turn")
        try:
            return self._read_host_now(host, started)
        finally:
            turn.release()

    def _read_host_now(self, host: Host, started: float) -> HostState:
        from rigctl.ssh import SshClient

        plan = self.plans[host.name]
        models = {a.name: a.path for a in host.artifacts}
        servers_by_dir: dict[str, list[str]] = {}
        for server in host.servers:
            servers_by_dir.setdefault(server.config_dir, []).append(server.name)
        args = {
            "fact": FACT_PATH,
            "gpu_fields": ",".join(NVIDIA_SMI_FIELDS),
            "health_fields": [list(nvidia_smi.HEALTH_FIELDS), list(nvidia_smi.LEGACY_HEALTH_FIELDS)],
            "unit_pattern": UNIT_PATTERN,
            "unit_properties": ",".join(UNIT_PROPERTIES),
            "units": [unit_name(name) for name in plan.servers],
            "models": models,
            "servers": servers_by_dir,
            "timeout": max(1.0, self.host_timeout / 2),
        }
        cmd = ship.python_command("fleet_state", json.dumps(args))
        try:
            # One connection per collection: reachability means a new SSH session can be opened now.
            with SshClient.for_host(host, connect_timeout=self.host_timeout, retries=0,
                                    channel_timeout=self.host_timeout) as ssh:
                result = ssh.run(cmd, timeout=self.host_timeout)
        except (RigctlError, OSError) as exc:
            log.debug("%s: %s", host.name, exc)  # finish_reading says when a host goes down
            return HostState(host.name, up=False, error=str(exc), duration_seconds=time.monotonic() - started)
        # An answer that cannot be read raises: finish_reading makes it this host's error (_answered).
        raw = parse_json(result.stdout, "its probe answer")
        if not isinstance(raw, dict):
            raise ConfigError(f"its probe answer is a JSON {type(raw).__name__}, not an object")
        facts = self._state(host, raw)
        facts.duration_seconds = time.monotonic() - started
        return facts

    def _state(self, host: Host, raw: Mapping[str, Any]) -> HostState:
        facts = HostState(host.name, up=True)
        try:
            facts.builds = parse_fact(raw["fact"], host.name) if raw.get("fact") else Builds(host.name, None, None)
        except RigctlError as exc:
            self._warn(str(exc))
        smi = raw.get("nvidia_smi") or {}
        if smi.get("rc") == 0:
            try:
                facts.gpus = parse_nvidia_smi(smi.get("out", ""))
            except ValueError as exc:
                facts.gpu_error = str(exc)
        else:
            facts.gpu_error = (smi.get("err") or "").strip() or f"nvidia-smi exited {smi.get('rc')}"
        if facts.gpu_error:
            log.info("%s: no GPU sample: %s", host.name, facts.gpu_error)
        read_health(facts, raw)
        facts.units = list(parse_unit_show((raw.get("units") or {}).get("out", "")).values())
        try:
            facts.pending_restarts = parse_pending_restarts(raw.get("pending_restarts") or {}, host.name)
        except RigctlError as exc:
            self._warn(str(exc))
        facts.config_files = tuple(sandbox.parse_config_files((raw.get("config_files") or {}).get("out") or ""))
        pins = host.pins
        to_hash: dict[str, list[int]] = {}
        for name, entry in sorted((raw.get("models") or {}).items()):
            path, stat = str(entry["path"]), _stat_key(entry.get("stat"))
            manifest_sha = None
            if entry.get("manifest"):
                try:
                    manifest_sha = parse_manifest(entry["manifest"], host.name).sha256
                except RigctlError as exc:
                    self._warn(str(exc))
            sha = None
            cached = self._hashes.get((host.name, path))
            if stat is not None:
                if cached and cached[0] == stat:
                    sha = cached[1]
                else:
                    to_hash[path] = list(stat)
            facts.models.append(ModelFact(name, path, stat is not None, sha, pins.get(name), manifest_sha,
                                          stat[_STAT_BYTES] if stat and len(stat) > _STAT_BYTES else None))
        if to_hash:
            self._schedule_hash(host, to_hash)
        return facts

    def settle_hashes(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the model hashes being computed; True if any were pending."""
        pending = [f for f in self._hashing.values() if not f.done()]
        if pending:
            wait_futures(pending, timeout=timeout)
        return bool(pending)

    def _schedule_hash(self, host: Host, files: Mapping[str, list[int]]) -> None:
        running = self._hashing.get(host.name)
        if running is not None and not running.done():
            return
        self._hashing[host.name] = self._hash_pool.submit(self._hash_files, host, dict(files))

    def _hash_files(self, host: Host, files: Mapping[str, list[int]]) -> None:
        from rigctl.ssh import SshClient

        cmd = ship.python_command("model_files", "hash", json.dumps(files))
        try:
            with SshClient.for_host(host, connect_timeout=self.host_timeout, retries=0) as ssh:
                hashed = parse_json(ssh.run(cmd, timeout=self.hash_timeout).stdout, f"{host.name}: its model hashes")
        except (RigctlError, ValueError, OSError) as exc:
            log.info("%s: model hashes not read: %s", host.name, exc)
            return
        if not isinstance(hashed, dict):
            log.warning("%s: its model hashes are a JSON %s, not an object", host.name, type(hashed).__name__)
            return
        for path, sha in hashed.items():
            if path in files and isinstance(sha, str):  # only what was asked, as the one shape it has
                self._hashes[(host.name, path)] = (_stat_key(files[path]) or (), sha)
        log.debug("%s: hashed %d model files", host.name, len(hashed))

