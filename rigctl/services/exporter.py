"""`rigctl exporter`: the fleet's state as Prometheus metrics.

llama-server's own ``/metrics`` says how a server is working; this exporter says whether the fleet is in
the state the inventory pins, and what the latest pulled results are:

* per host: reachability over SSH, the running llama.cpp build against the pinned one, each model file's
  sha256 against its pin, GPU temperature, memory and utilisation (``nvidia-smi``);
* per llama-server instance: the systemd state of ``llama-server@<name>.service``;
* from the controller's results store: the latest bench t/s per test and model, the latest eval score
  per task and artifact.

A background loop collects the fleet's state (:class:`rigctl.fleet.state.FleetState`: every host
concurrently, each bounded by its own timeout, so a dead host costs one timeout and never stalls the others)
and the latest results (:mod:`rigctl.analysis.latest`); a scrape only renders the last completed collection
(with its age), so it never waits on SSH.
"""

from __future__ import annotations

import logging
import math
import re
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from rigctl.analysis.latest import BenchResult, EvalScore, ResultsReader
from rigctl.errors import ConfigError, one_line
from rigctl.fleet.drain import Drain, apply_policy, host_drain
from rigctl.fleet.health import host_problems, verdicts
from rigctl.fleet.state import (
    DEFAULT_HASH_TIMEOUT,
    DEFAULT_HOST_TIMEOUT,
    FleetState,
    HostPlan,
    HostState,
    unit_instance,
)
from rigctl.inventory import Inventory
from rigctl.inventory.advisories import FloorCheck
from rigctl.results.store import ResultsStore
from rigctl.services.health_metrics import health_families

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:9840"
DEFAULT_INTERVAL = 15.0
#: The states systemd reports as ActiveState; one series each, 1 for the current one.
UNIT_STATES = ("active", "reloading", "inactive", "failed", "activating", "deactivating")


# ----------------------------------------------------------------------------------------------- records


@dataclass
class Snapshot:
    """One completed collection: what a scrape renders."""

    completed_at: float  # unix time
    duration_seconds: float
    hosts: dict[str, HostState]
    bench: list[BenchResult] = field(default_factory=list)
    evals: list[EvalScore] = field(default_factory=list)
    results_error: str | None = None
    #: Each host's drain as the inventory says it at this collection (None: in service).
    drains: dict[str, Drain | None] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- parsers


def parse_listen(listen: str) -> tuple[str, int]:
    """``127.0.0.1:9840``, ``[::1]:9840`` or ``:9840`` as (address, port). No address means loopback:
    every interface is served only when asked for by name (``0.0.0.0:9840``, ``[::]:9840``)."""
    address, sep, port = listen.rpartition(":")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen {listen!r}: expected ADDRESS:PORT, e.g. {DEFAULT_LISTEN}")
    return address.strip("[]") or "127.0.0.1", int(port)


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
    server_pending = g("rigctl_server_pending_restart",
                       "1 if the instance runs other arguments, binary or environment than its files say (a play "
                       "wrote them and did not restart it; the next provision does)", labels=["host", "server"])
    config_file = g("rigctl_llama_cpp_config_file",
                    "1 for each llama.cpp config file on the host (read by every llama.cpp program started there by "
                    "hand; rigctl's sandbox hides it from its own): drift unless llama_cpp_allow_config_files "
                    "adopts it", labels=["host", "path"])
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
            for server in sorted(plan.servers):
                server_pending.add_metric([name, server], 1.0 if server in facts.pending_restarts else 0.0)
            for path in facts.config_files:
                config_file.add_metric([name, path], 1.0)
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
    health = health_families(snapshot.hosts if snapshot else {}, snapshot.drains if snapshot else {})
    return [up, probe, completed, duration, results_ok, build_info, build_drift, vulnerable, model_info, model_drift,
            model_bytes, server_info, server_state, server_pid, server_pending, config_file, server_restarts,
            temperature, mem_used, mem_total, utilization, *health, bench, bench_time, eval_gauge, eval_n]


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


# ----------------------------------------------------------------------------------------------- the exporter


class Exporter:
    """Collects the fleet's state (:class:`~rigctl.fleet.state.FleetState`) and the latest results in the
    background, and serves the last collection to Prometheus."""

    def __init__(
        self,
        inventory: Inventory,
        *,
        limit: str | None = None,
        results: ResultsStore | None = None,
        interval: float = DEFAULT_INTERVAL,
        host_timeout: float = DEFAULT_HOST_TIMEOUT,
        hash_timeout: float = DEFAULT_HASH_TIMEOUT,
        apply_drain_policy: bool = False,
    ):
        if interval <= 0 or host_timeout <= 0:
            raise ConfigError("exporter: --interval and the host timeout must be positive")
        self.fleet = FleetState(inventory, limit=limit, host_timeout=host_timeout, hash_timeout=hash_timeout)
        self.hosts, self.plans, self.host_timeout = self.fleet.hosts, self.fleet.plans, host_timeout
        self.results = ResultsReader(results or ResultsStore())
        self.interval = interval
        self.inventory, self.apply_drain_policy = inventory, apply_drain_policy
        self._drains: dict[str, Drain | None] = {name: host_drain(inventory.hosts[name]) for name in self.plans}
        self._snapshot: Snapshot | None = None
        self._static = exposition(metric_families(None, self.plans))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
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
        self.fleet.close()

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
        """Read every host at once, each bounded by the host timeout, and the results store; publish and return
        the snapshot."""
        started = time.monotonic()
        reading = self.fleet.start_reading()
        results_error = None
        try:
            bench, evals = self.results.latest()
        except Exception as exc:  # the store unreadable costs its results, never the hosts' metrics
            bench, evals, results_error = [], [], one_line(exc)
            log.warning("results store %s: %s", self.results.store.root, results_error)
        hosts = self.fleet.finish_reading(reading, started)
        self._read_drains(hosts)
        snapshot = Snapshot(completed_at=time.time(), duration_seconds=time.monotonic() - started, hosts=hosts,
                            bench=bench, evals=evals, results_error=results_error, drains=dict(self._drains))
        static = exposition(metric_families(snapshot, self.plans))
        with self._lock:
            self._snapshot, self._static = snapshot, static
            self.collections += 1
        return snapshot

    def _read_drains(self, hosts: Mapping[str, HostState]) -> None:
        """The drains as the inventory says them now (``rigctl hosts drain`` from any shell shows at the next
        collection), after the drain policy's own where it applies; an inventory that does not load keeps the
        last ones, with a warning."""
        try:
            inventory = Inventory.load(self.inventory.source)
            if self.apply_drain_policy:
                problems = {name: host_problems(verdicts(facts.health, facts.xids))
                            for name, facts in hosts.items() if facts.up}
                if apply_policy(inventory, problems):
                    inventory = Inventory.load(self.inventory.source)
            self._drains = {name: host_drain(inventory.hosts[name]) if name in inventory.hosts else None
                            for name in self.plans}
        except Exception as exc:  # the inventory mid-edit costs the drains' freshness, never the collection
            log.warning("inventory %s: drains not read again: %s", self.inventory.source, one_line(exc))

    def settle_hashes(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the model hashes being computed; True if any were pending."""
        return self.fleet.settle_hashes(timeout)
