"""`rigctl exporter`: the fleet's state as Prometheus metrics.

llama-server's own ``/metrics`` says how a server is working; this exporter says whether the fleet is in
the state the inventory pins, and what the latest pulled results are:

* per host: reachability over SSH, the running llama.cpp build against the pinned one, each model file's
  sha256 against its pin, GPU temperature, memory and utilisation (``nvidia-smi``);
* per llama-server instance: the systemd state of ``llama-server@<name>.service``;
* from the controller's results store: the latest bench t/s per test and model, the latest eval score
  per task and artifact.

A background loop collects from every host concurrently, each host bounded by its own timeout, so a
dead host costs one timeout and never stalls the others; a scrape only renders the last completed
collection (with its age), so it never waits on SSH.

Each host is read with one SSH command (:mod:`rigctl.hostside.fleet_probe`) whose raw outputs are parsed by
pure functions (:func:`parse_nvidia_smi` here, :func:`rigctl.servers.parse_unit_show`, :func:`rigctl.build.parse_fact`,
:func:`rigctl.models.parse_manifest`). Model files are re-hashed only when their size, mtime, ctime or
inode change (:func:`rigctl.hostside.model_files.identity`), on a slower lane of their own
(:func:`rigctl.hostside.model_files.hash_unchanged`), so a 4 GB file never holds up a collection.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from rigctl.build import Builds, parse_fact
from rigctl.errors import ConfigError, RigctlError, one_line
from rigctl.fleet.advisories import FloorCheck, build_number, check_build, host_allowed
from rigctl.hostside import ship
from rigctl.hostside.llama_cpp_fact import FACT_PATH
from rigctl.inventory import Host, Inventory
from rigctl.inventory.profiles import unit_name
from rigctl.models import expected_sha256, parse_manifest
from rigctl.results.record import ANSWERS_FILE, parse_json
from rigctl.results.store import ResultsStore, StoredRun, read_jsonl
from rigctl.servers import UNIT_PROPERTIES, UnitState, parse_unit_show

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:9840"
DEFAULT_INTERVAL = 15.0
DEFAULT_HOST_TIMEOUT = 10.0
DEFAULT_HASH_TIMEOUT = 900.0  # sha256 of a few GB on a slow disk
#: The states systemd reports as ActiveState; one series each, 1 for the current one.
UNIT_STATES = ("active", "reloading", "inactive", "failed", "activating", "deactivating")
UNIT_PATTERN = "llama-server@*.service"
NVIDIA_SMI_FIELDS = ("index", "uuid", "name", "temperature.gpu", "memory.used", "memory.total", "utilization.gpu")
_MIB = 1024 * 1024

# ----------------------------------------------------------------------------------------------- records


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
class HostFacts:
    host: str
    up: bool
    error: str | None = None
    duration_seconds: float = 0.0
    builds: Builds | None = None
    gpus: list[GpuSample] = field(default_factory=list)
    gpu_error: str | None = None
    units: list[UnitState] = field(default_factory=list)
    models: list[ModelFact] = field(default_factory=list)


@dataclass(frozen=True)
class BenchResult:
    host: str
    artifact: str
    test: str
    config: str  # llama-bench settings besides the model: ngl, threads, cache types, flash attention
    tokens_per_second: float
    run_id: str
    ended: float  # unix time


@dataclass(frozen=True)
class EvalScore:
    host: str
    task: str
    artifact: str
    score: float
    questions: int
    run_id: str
    ended: float


@dataclass
class Snapshot:
    """One completed collection: what a scrape renders."""

    completed_at: float  # unix time
    duration_seconds: float
    hosts: dict[str, HostFacts]
    bench: list[BenchResult] = field(default_factory=list)
    evals: list[EvalScore] = field(default_factory=list)
    results_error: str | None = None


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


# ----------------------------------------------------------------------------------------------- parsers


def _number(text: str) -> float | None:
    text = text.strip()
    if not text or text.startswith("[") or text.upper() in {"N/A", "NOT SUPPORTED"}:
        return None  # nvidia-smi's [N/A], [Not Supported], [Unknown Error]
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_nvidia_smi(text: str) -> list[GpuSample]:
    """``nvidia-smi --query-gpu=<NVIDIA_SMI_FIELDS> --format=csv,noheader,nounits`` as samples."""
    samples = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(NVIDIA_SMI_FIELDS):
            raise ValueError(f"nvidia-smi line {number}: {len(cells)} fields, expected {len(NVIDIA_SMI_FIELDS)}")
        index, uuid, name, temperature, used, total, utilization = cells
        used_mib, total_mib, util = _number(used), _number(total), _number(utilization)
        samples.append(GpuSample(
            index=index,
            uuid=uuid,
            name=name,
            temperature_celsius=_number(temperature),
            memory_used_bytes=used_mib * _MIB if used_mib is not None else None,
            memory_total_bytes=total_mib * _MIB if total_mib is not None else None,
            utilization_ratio=util / 100.0 if util is not None else None,
        ))
    return samples


def unit_instance(unit: str) -> str:
    """``smollm2`` for ``llama-server@smollm2.service``."""
    stem = unit.removesuffix(".service")
    return stem.split("@", 1)[1] if "@" in stem else stem


def parse_listen(listen: str) -> tuple[str, int]:
    """``127.0.0.1:9840``, ``[::1]:9840`` or ``:9840`` as (address, port). No address means loopback:
    every interface is served only when asked for by name (``0.0.0.0:9840``, ``[::]:9840``)."""
    address, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen {listen!r}: expected ADDRESS:PORT, e.g. {DEFAULT_LISTEN}")
    return address.strip("[]") or "127.0.0.1", int(port)


# ----------------------------------------------------------------------------------------------- results


def _unix(stamp: str | None) -> float:
    from datetime import datetime

    if not stamp:
        return 0.0
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _artifact_of(run: StoredRun) -> str:
    """The artifact an eval run asked: the record's first artifact, else its server's."""
    for artifact in run.record.artifacts:
        if artifact.name:
            return artifact.name
    return str(run.record.server.artifact if run.record.server and run.record.server.artifact else "unknown")


def bench_results(run: StoredRun) -> list[BenchResult]:
    """Mean t/s per model, test and configuration of a bench run, over every repetition of every cell."""
    from rigctl.bench.matrix import load_run_samples

    pooled: dict[tuple[str, str, str], list[float]] = {}
    for sample in load_run_samples(run):
        key = (sample.model, sample.test, f"{sample.config} fa{sample.flash_attn}")
        pooled.setdefault(key, []).extend(sample.samples_ts)
    ended = _unix(run.record.ended)
    return [BenchResult(run.host, model, test, config, sum(values) / len(values), run.id, ended)
            for (model, test, config), values in sorted(pooled.items()) if values]


def eval_score(run: StoredRun) -> EvalScore | None:
    """Mean score over the questions of an eval run's answers file (None without one)."""
    path = run.path / ANSWERS_FILE
    if not path.is_file():
        return None
    rows = read_jsonl(path)
    scores = [float(r["score"]) for r in rows if isinstance(r.get("score"), int | float)]
    if not scores:
        return None
    task = run.record.task.name if run.record.task else "unknown"
    return EvalScore(run.host, task, _artifact_of(run), sum(scores) / len(scores), len(scores), run.id,
                     _unix(run.record.ended))


class ResultsReader:
    """The latest bench and eval results of a results store; finished runs are parsed once, and a run
    whose files cannot be read (whatever they hold) is left out with a warning naming it."""

    def __init__(self, store: ResultsStore):
        self.store = store
        self._bench: dict[str, list[BenchResult]] = {}
        self._evals: dict[str, EvalScore | None] = {}

    def latest(self) -> tuple[list[BenchResult], list[EvalScore]]:
        bench: dict[tuple[str, str, str, str], BenchResult] = {}
        evals: dict[tuple[str, str, str], EvalScore] = {}
        if not self.store.root.is_dir():
            return [], []
        for run in self.store.runs():
            if run.record.status != "done":
                continue
            key = f"{run.host}/{run.id}"
            if run.record.kind == "bench":
                if key not in self._bench:
                    try:
                        self._bench[key] = bench_results(run)
                    except Exception as exc:  # one run's files, whatever they hold, cost only that run
                        log.warning("skipping bench run %s: %s", key, one_line(exc))
                        self._bench[key] = []
                for result in self._bench[key]:
                    slot = (result.host, result.artifact, result.test, result.config)
                    if slot not in bench or bench[slot].ended <= result.ended:
                        bench[slot] = result
            elif run.record.kind == "eval":
                if key not in self._evals:
                    try:
                        self._evals[key] = eval_score(run)
                    except Exception as exc:  # one run's files, whatever they hold, cost only that run
                        log.warning("skipping eval run %s: %s", key, one_line(exc))
                        self._evals[key] = None
                score = self._evals[key]
                if score is not None:
                    slot = (score.host, score.task, score.artifact)
                    if slot not in evals or evals[slot].ended <= score.ended:
                        evals[slot] = score
        return sorted(bench.values(), key=lambda b: (b.host, b.artifact, b.test, b.config)), sorted(
            evals.values(), key=lambda e: (e.host, e.task, e.artifact))


# ----------------------------------------------------------------------------------------------- metrics


def metric_families(snapshot: Snapshot | None, plans: Mapping[str, HostPlan]) -> list[Metric]:
    """Every family of one snapshot, with HELP and TYPE even when it has no samples; all but the
    snapshot's age, which changes with every scrape (:func:`age_exposition`)."""
    g = GaugeMetricFamily
    up = g("rigctl_host_up", "1 if the host answered over SSH in the last collection, else 0", labels=["host"])
    probe = g("rigctl_host_probe_duration_seconds", "Time the last collection took on the host", labels=["host"])
    completed = g("rigctl_collection_timestamp_seconds", "Unix time the last collection completed")
    duration = g("rigctl_collection_duration_seconds", "Time the last collection took over all hosts")
    build_info = InfoMetricFamily(
        "rigctl_llama_cpp_build", "llama.cpp build running on the host (current link) and the one pinned",
        labels=["host", "running_version", "running_commit", "running_build_key", "pinned_version"])
    build_drift = g("rigctl_llama_cpp_build_drift", "1 if the running llama.cpp build is not the pinned one",
                    labels=["host"])
    model_info = InfoMetricFamily("rigctl_model", "Model file on the host: its sha256 and the one expected",
                                  labels=["host", "artifact", "sha256", "expected_sha256", "pinned_by"])
    model_drift = g("rigctl_model_drift", "1 if the model file is missing or its sha256 differs from its pin",
                    labels=["host", "artifact"])
    model_bytes = g("rigctl_model_size_bytes", "Size of the model file", labels=["host", "artifact"])
    server_state = g("rigctl_server_state", "systemd ActiveState of llama-server@<server>.service, 1 for the current",
                     labels=["host", "server", "state"])
    server_info = InfoMetricFamily("rigctl_server", "llama-server instance as the inventory defines it",
                                   labels=["host", "server", "artifact", "profile", "port", "enabled"])
    server_pid = g("rigctl_server_main_pid", "MainPID of the instance's unit (0 when not running)",
                   labels=["host", "server"])
    server_restarts = CounterMetricFamily("rigctl_server_restarts", "Automatic restarts of the unit by systemd",
                                          labels=["host", "server"])
    gpu_labels = ["host", "gpu", "name", "uuid"]
    temperature = g("rigctl_gpu_temperature_celsius", "GPU core temperature", labels=gpu_labels)
    mem_used = g("rigctl_gpu_memory_used_bytes", "GPU memory in use", labels=gpu_labels)
    mem_total = g("rigctl_gpu_memory_total_bytes", "GPU memory in total", labels=gpu_labels)
    utilization = g("rigctl_gpu_utilization_ratio", "GPU utilisation over the last sample period (0-1)",
                    labels=gpu_labels)
    bench = g("rigctl_bench_tokens_per_second",
              "Latest pulled llama-bench result: mean tokens/s per model, test and configuration",
              labels=["host", "artifact", "test", "config", "run"])
    bench_time = g("rigctl_bench_run_end_timestamp_seconds", "Unix time the latest bench run per model ended",
                   labels=["host", "artifact", "run"])
    eval_gauge = g("rigctl_eval_score_ratio", "Latest pulled eval result: mean score per task and artifact (0-1)",
                   labels=["host", "task", "artifact", "run"])
    eval_n = g("rigctl_eval_questions", "Questions scored in the latest eval run per task and artifact",
               labels=["host", "task", "artifact", "run"])
    results_ok = g("rigctl_results_readable", "1 if the results store was read in the last collection")
    vulnerable = g("rigctl_build_vulnerable",
                   "1 if the llama.cpp build is inside a published advisory's range the fleet has not accepted "
                   "(the CVE floor); build: the pinned one or the one running",
                   labels=["host", "build", "version", "advisories"])

    if snapshot is not None:
        completed.add_metric([], snapshot.completed_at)
        duration.add_metric([], snapshot.duration_seconds)
        results_ok.add_metric([], 0.0 if snapshot.results_error else 1.0)
        for name, plan in sorted(plans.items()):
            facts = snapshot.hosts.get(name)
            if plan.pinned_build is not None:
                _floor_sample(vulnerable, name, "pinned", plan.pinned_version, plan.floor(plan.pinned_build))
            for server, spec in sorted(plan.servers.items()):
                server_info.add_metric([name, server, str(spec["artifact"]), str(spec["profile"]), str(spec["port"]),
                                        "true" if spec["enabled"] else "false"], {})
            if facts is None:
                continue
            up.add_metric([name], 1.0 if facts.up else 0.0)
            probe.add_metric([name], facts.duration_seconds)
            if not facts.up:
                continue  # what a down host last said is not its state now
            current = facts.builds.current if facts.builds else None
            build_info.add_metric([name, current.version if current else "", current.commit if current else "",
                                   current.key if current else "", plan.pinned_version], {})
            drift = plan.build_drift(facts.builds)
            if drift is not None:
                build_drift.add_metric([name], 1.0 if drift else 0.0)
            if current is not None and current.build_number > 0:
                _floor_sample(vulnerable, name, "running", current.version, plan.floor(current.build_number))
            for model in facts.models:
                expected, pinned_by = model.expected
                model_info.add_metric([name, model.artifact, model.sha256 or "", expected or "", pinned_by], {})
                if model.drift is not None:
                    model_drift.add_metric([name, model.artifact], 1.0 if model.drift else 0.0)
                if model.bytes is not None:
                    model_bytes.add_metric([name, model.artifact], float(model.bytes))
            for unit in facts.units:
                instance = unit_instance(unit.unit)
                for state in UNIT_STATES:
                    server_state.add_metric([name, instance, state], 1.0 if unit.active_state == state else 0.0)
                server_pid.add_metric([name, instance], float(unit.main_pid))
                server_restarts.add_metric([name, instance], float(unit.n_restarts))
            for gpu in facts.gpus:
                labels = [name, gpu.index, gpu.name, gpu.uuid]
                for family, value in ((temperature, gpu.temperature_celsius), (mem_used, gpu.memory_used_bytes),
                                      (mem_total, gpu.memory_total_bytes), (utilization, gpu.utilization_ratio)):
                    if value is not None:
                        family.add_metric(labels, value)
        run_ends: dict[tuple[str, str, str], float] = {}
        for result in snapshot.bench:
            bench.add_metric([result.host, result.artifact, result.test, result.config, result.run_id],
                             result.tokens_per_second)
            run_ends[(result.host, result.artifact, result.run_id)] = result.ended
        for (host, artifact, run_id), ended in sorted(run_ends.items()):
            bench_time.add_metric([host, artifact, run_id], ended)
        for score in snapshot.evals:
            labels = [score.host, score.task, score.artifact, score.run_id]
            eval_gauge.add_metric(labels, score.score)
            eval_n.add_metric(labels, float(score.questions))
    return [up, probe, completed, duration, results_ok, build_info, build_drift, vulnerable, model_info, model_drift,
            model_bytes, server_info, server_state, server_pid, server_restarts, temperature, mem_used, mem_total,
            utilization, bench, bench_time, eval_gauge, eval_n]


def _floor_sample(family: GaugeMetricFamily, host: str, which: str, version: str, check: FloorCheck) -> None:
    family.add_metric([host, which, version, ",".join(a.id for a in check.refused)], 1.0 if check.vulnerable else 0.0)


AGE_METRIC = "rigctl_collection_age_seconds"
_AGE_HEAD = (f"# HELP {AGE_METRIC} Seconds since the last completed collection (NaN before the first)\n"
             f"# TYPE {AGE_METRIC} gauge\n").encode()


def age_exposition(age_seconds: float) -> bytes:
    """The one family computed per scrape: the age of the collection being served."""
    return _AGE_HEAD + f"{AGE_METRIC} {floatToGoString(age_seconds)}\n".encode()


def exposition(families: Iterable[Metric]) -> bytes:
    """Families in Prometheus's text format (prometheus-client's own encoder)."""
    registry = CollectorRegistry(auto_describe=False)
    fixed = list(families)

    class _Fixed(Collector):
        def collect(self) -> Iterable[Metric]:
            return fixed

    registry.register(_Fixed())
    return generate_latest(registry)


# ----------------------------------------------------------------------------------------------- collection


_STAT_BYTES = 2  # the size in rigctl.hostside.model_files.identity's list


def _stat_key(stat: Sequence[int] | None) -> tuple[int, ...] | None:
    return tuple(int(v) for v in stat) if stat else None


class Exporter:
    """Collects the fleet's facts in the background and serves the last collection to Prometheus."""

    def __init__(
        self,
        inventory: Inventory,
        *,
        limit: str | None = None,
        results: ResultsStore | None = None,
        interval: float = DEFAULT_INTERVAL,
        host_timeout: float = DEFAULT_HOST_TIMEOUT,
        hash_timeout: float = DEFAULT_HASH_TIMEOUT,
    ):
        if interval <= 0 or host_timeout <= 0:
            raise ConfigError("exporter: --interval and the host timeout must be positive")
        self.hosts = inventory.select(limit)
        self.plans = {h.name: HostPlan.from_host(h) for h in self.hosts}
        self.results = ResultsReader(results or ResultsStore())
        self.interval = interval
        self.host_timeout = host_timeout
        self.hash_timeout = hash_timeout
        self._snapshot: Snapshot | None = None
        self._static = exposition(metric_families(None, self.plans))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # A hung host keeps its worker until its own SSH timeouts fire; the next collection then skips it.
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(self.hosts)), thread_name_prefix="rigctl-probe")
        self._hash_pool = ThreadPoolExecutor(max_workers=max(1, len(self.hosts)), thread_name_prefix="rigctl-hash")
        self._inflight: dict[str, Future[HostFacts]] = {}
        self._hashing: dict[str, Future[None]] = {}
        self._hashes: dict[tuple[str, str], tuple[tuple[int, ...], str]] = {}  # (host, path) -> (stat, sha256)
        self.collections = 0

    # -------------------------------------------------------------------------------- serving

    @property
    def snapshot(self) -> Snapshot | None:
        with self._lock:
            return self._snapshot

    def render(self) -> bytes:
        """What a scrape gets: the last collection's exposition, rendered when it was published, and its
        age now."""
        with self._lock:
            snapshot, static = self._snapshot, self._static
        age = math.nan if snapshot is None else max(0.0, time.time() - snapshot.completed_at)
        return static + age_exposition(age)

    def serve(self, listen: str = DEFAULT_LISTEN) -> tuple[ThreadingHTTPServer, threading.Thread]:
        """Serve ``GET /metrics`` on ``listen`` from a thread; returns the server (``shutdown()`` stops it)."""
        address, port = parse_listen(listen)
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection to a target
            disable_nagle_algorithm = True  # headers and body are two writes; no delayed-ACK stall between

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    self._reply(404, b"rigctl exporter: see /metrics\n", "text/plain; charset=utf-8")
                    return
                self._reply(200, exporter.render(), CONTENT_TYPE_LATEST)

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("%s %s", self.address_string(), format % args)

        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        server_class = type("ExporterHTTPServer", (ThreadingHTTPServer,),
                            {"address_family": family, "daemon_threads": True})
        try:
            server = server_class((address, port), Handler)
        except OSError as exc:
            raise ConfigError(f"exporter: cannot listen on {listen}: {exc.strerror or exc}") from None
        thread = threading.Thread(target=server.serve_forever, name="rigctl-exporter-http", daemon=True)
        thread.start()
        return server, thread

    def start(self) -> None:
        """Collect now and then every ``interval`` seconds, in a background thread."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="rigctl-exporter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.host_timeout + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._hash_pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.collect_once()
            except Exception:  # the loop outlives any one bad collection; the age metric shows it
                log.exception("collection failed")
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    # -------------------------------------------------------------------------------- collecting

    def collect_once(self) -> Snapshot:
        """Collect from every host at once, each bounded by the host timeout; publish and return it."""
        started = time.monotonic()
        futures: dict[str, Future[HostFacts]] = {}
        for host in self.hosts:
            running = self._inflight.get(host.name)
            if running is None or running.done():
                running = self._pool.submit(self._probe_host, host)
                self._inflight[host.name] = running
            futures[host.name] = running
        results_error = None
        try:
            bench, evals = self.results.latest()
        except Exception as exc:  # the store unreadable costs its results, never the hosts' metrics
            bench, evals, results_error = [], [], one_line(exc)
            log.warning("results store %s: %s", self.results.store.root, results_error)
        remaining = max(0.0, self.host_timeout + 1.0 - (time.monotonic() - started))
        wait_futures(futures.values(), timeout=remaining)
        hosts: dict[str, HostFacts] = {}
        for name, future in futures.items():
            if future.done():
                hosts[name] = self._answered(name, future, started)
            else:
                hosts[name] = HostFacts(name, up=False, error=f"no answer within {self.host_timeout:g}s",
                                        duration_seconds=time.monotonic() - started)
                log.warning("%s: no answer within %gs", name, self.host_timeout)
        snapshot = Snapshot(completed_at=time.time(), duration_seconds=time.monotonic() - started, hosts=hosts,
                            bench=bench, evals=evals, results_error=results_error)
        static = exposition(metric_families(snapshot, self.plans))
        with self._lock:
            self._snapshot, self._static = snapshot, static
            self.collections += 1
        return snapshot

    @staticmethod
    def _answered(name: str, future: Future[HostFacts], started: float) -> HostFacts:
        """A finished probe's facts; whatever a host's answer provoked in reading it blanks that host only."""
        try:
            return future.result()
        except Exception as exc:
            error = one_line(exc)
            if not isinstance(exc, RigctlError):
                error = f"its probe answer cannot be read: {error}"
            log.warning("%s: %s", name, error)
            return HostFacts(name, up=False, error=error, duration_seconds=time.monotonic() - started)

    def _probe_host(self, host: Host) -> HostFacts:
        from rigctl.ssh import SshClient

        started = time.monotonic()
        plan = self.plans[host.name]
        models = {a.name: a.path for a in host.artifacts}
        args = {
            "fact": FACT_PATH,
            "gpu_fields": ",".join(NVIDIA_SMI_FIELDS),
            "unit_pattern": UNIT_PATTERN,
            "unit_properties": ",".join(UNIT_PROPERTIES),
            "units": [unit_name(name) for name in plan.servers],
            "models": models,
            "timeout": max(1.0, self.host_timeout / 2),
        }
        cmd = ship.python_command("fleet_probe", json.dumps(args))
        try:
            # One connection per collection: reachability means a new SSH session can be opened now.
            with SshClient.for_host(host, connect_timeout=self.host_timeout, retries=0,
                                    channel_timeout=self.host_timeout) as ssh:
                result = ssh.run(cmd, timeout=self.host_timeout)
        except (RigctlError, OSError) as exc:
            log.info("%s: down: %s", host.name, exc)
            return HostFacts(host.name, up=False, error=str(exc), duration_seconds=time.monotonic() - started)
        # An answer that cannot be read raises: collect_once makes it this host's error (_answered).
        raw = parse_json(result.stdout, "its probe answer")
        if not isinstance(raw, dict):
            raise ConfigError(f"its probe answer is a JSON {type(raw).__name__}, not an object")
        facts = self._facts(host, raw)
        facts.duration_seconds = time.monotonic() - started
        return facts

    def _facts(self, host: Host, raw: Mapping[str, Any]) -> HostFacts:
        facts = HostFacts(host.name, up=True)
        try:
            facts.builds = parse_fact(raw["fact"], host.name) if raw.get("fact") else Builds(host.name, None, None)
        except RigctlError as exc:
            log.warning("%s", exc)
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
        facts.units = list(parse_unit_show((raw.get("units") or {}).get("out", "")).values())
        pins = host.pins
        to_hash: dict[str, list[int]] = {}
        for name, entry in sorted((raw.get("models") or {}).items()):
            path, stat = str(entry["path"]), _stat_key(entry.get("stat"))
            manifest_sha = None
            if entry.get("manifest"):
                try:
                    manifest_sha = parse_manifest(entry["manifest"], host.name).sha256
                except RigctlError as exc:
                    log.warning("%s", exc)
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

