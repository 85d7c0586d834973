"""``rigctl build bisect``: the first build of an ordered list that is worse than the good end on one metric.

The list runs from ``--good`` to ``--bad``: the versions the package index offers between them, or a
``--candidates`` file (an item is a version, or ``{version, cmake: {NAME: VALUE}}`` to bisect a build option
too). Each build is made as a candidate on the host (only llama-server and llama-bench: what measuring needs;
by build key, so a build made before comes back from the host or the controller's cache) and measured against
the good end with the upgrade's paired method (:mod:`rigctl.upgrade.paired`) on one metric: the bad end first
(it must be worse), then midpoints until two neighbours differ. Each step is a line of the ``bisect`` record's
``steps.jsonl``: the same command again continues an unfinished record, measuring no step twice.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rigctl.errors import BuildError, ConfigError
from rigctl.fleet import candidate
from rigctl.fleet.candidate import CandidateBuild
from rigctl.inventory import Host, Inventory, Server, advisories
from rigctl.inventory.gates import GATES_VAR, BenchGate, Gates, IdentityGate, Matrix, ServerGate
from rigctl.results.run import Run
from rigctl.results.store import ResultsStore, StoredRun
from rigctl.upgrade import gates as g
from rigctl.upgrade import paired
from rigctl.upgrade.record import checked_steps
from rigctl.upgrade.upgrade import UpgradeRefused, _build_dict, _installed, _instances, upgrade_run

Say = Callable[[str], None]
STEPS_FILE = "steps.jsonl"

#: Metrics a bisect can follow: a llama-bench test (tg128, pp512, "tg128 @ d4096"), the server's decode or
#: TTFT, or greedy-output identity.
SERVER_METRICS = ("decode", "ttft")


def metric_gates(gates: Gates, metric: str) -> tuple[Gates, str]:
    """Only the section that measures ``metric``, and the gate name its verdict is read from."""
    if metric in SERVER_METRICS:
        return Gates(speed_margin=gates.speed_margin, level=gates.level, bench=None, identity=None,
                       server=gates.server or ServerGate(), quality=None), f"server {metric}"
    if metric == "identity":
        return Gates(speed_margin=gates.speed_margin, level=gates.level, bench=None, server=None,
                       identity=gates.identity or IdentityGate(), quality=None), "identity"
    if metric.startswith(("pp", "tg")):
        bench = gates.bench or BenchGate()
        measured = bench_tests(bench.matrix)
        if metric not in measured:
            raise ConfigError(f"--metric {metric!r}: the gates' bench matrix does not measure it (it measures "
                              f"{', '.join(measured) or 'nothing'})")
        return Gates(speed_margin=gates.speed_margin, level=gates.level, bench=bench, server=None, identity=None,
                       quality=None), f"bench {metric}"
    raise ConfigError(f"--metric {metric!r}: a llama-bench test (tg128, pp512, ...), decode, ttft or identity")


def bench_tests(matrix: Matrix) -> list[str]:
    """The test names llama-bench reports for ``matrix``: each prompt and each generation length (0: none) at
    each depth."""
    from rigctl.bench.matrix import bench_test_name

    depths = matrix.d or [0]
    return [bench_test_name(p, 0, d) for d in depths for p in matrix.p if p] + \
        [bench_test_name(0, n, d) for d in depths for n in matrix.n if n]


@dataclass(frozen=True)
class BisectCandidate:
    version: str
    cmake: Mapping[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in sorted(self.cmake.items()))
        return f"{self.version} {extra}" if extra else self.version


def parse_candidates(data: Any, origin: str) -> list[BisectCandidate]:
    """An ordered candidate list (YAML): each item a version, or ``{version, cmake: {NAME: VALUE}}``."""
    if not isinstance(data, list) or len(data) < 2:
        raise ConfigError(f"{origin}: expected a list of at least two builds, good end first, bad end last")
    out = []
    for index, item in enumerate(data):
        if isinstance(item, str):
            item = {"version": item}
        if not isinstance(item, Mapping) or set(item) - {"version", "cmake"} or not isinstance(item.get("version"),
                                                                                              str):
            raise ConfigError(f"{origin}: item {index}: a version, or a mapping with version and cmake")
        version = item["version"]
        if not candidate.VERSION.fullmatch(version):
            raise ConfigError(f"{origin}: item {index}: version {version!r}: expected a build label (b11434) or a "
                              "git commit (7 to 40 hex digits)")
        cmake = item.get("cmake") or {}
        if not isinstance(cmake, Mapping) or not all(isinstance(k, str) and isinstance(v, str | int) and
                                                     not isinstance(v, bool) for k, v in cmake.items()):
            raise ConfigError(f"{origin}: item {index}: cmake: expected a mapping of CMake cache entries, "
                              "NAME: VALUE")
        try:
            options = candidate.parse_cmake_options(f"{k}={v}" for k, v in cmake.items())
        except ConfigError as exc:
            raise ConfigError(f"{origin}: item {index}: cmake: {exc}") from None
        out.append(BisectCandidate(version, options))
    labels = [c.label for c in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{origin}: a build is listed twice")
    return out


def offered_versions(host: Host, good: str, bad: str) -> list[BisectCandidate]:
    """The builds the package index offers from ``good`` to ``bad`` (an archive pin's sdist project), in order."""
    from rigctl.hostside import sdist_fetch

    sdist = str(host.vars.get("llama_cpp_archive_sdist") or "")
    lo, hi = advisories.build_number(good), advisories.build_number(bad)
    if not sdist or lo is None or hi is None or host.llama_cpp.source != "archive":
        raise ConfigError(f"host {host.name}: the versions between {good} and {bad} come from the package index "
                          "for an archive pin with llama_cpp_archive_sdist; give --candidates FILE otherwise")
    project, pinned = sdist_fetch.parse_requirement(sdist)
    current = advisories.build_number(host.llama_cpp.version)
    suffix = pinned[len(str(current)):] if current is not None and pinned.startswith(str(current)) else ""
    try:
        listed = sdist_fetch.list_sdists(project)
    except sdist_fetch.SdistFetchError as exc:
        raise BuildError(str(exc)) from None
    numbers = sorted(int(v[: len(v) - len(suffix)]) for v in listed
                     if v.endswith(suffix) and re.fullmatch(r"[0-9]+", v[: len(v) - len(suffix)]))
    found = [n for n in numbers if lo <= n <= hi]
    if not found or found[0] != lo or found[-1] != hi:
        raise ConfigError(f"{project}: the index offers no sdist of {good if lo not in found else bad}")
    return [BisectCandidate(f"b{n}") for n in found]


@dataclass
class Step:
    version: str
    label: str
    build: str
    plan: str
    build_s: float
    verdict: str  # good, bad, undecided (from the metric's gate)
    gate: dict[str, Any]
    runs: list[str] = field(default_factory=list)


@dataclass
class BisectResult:
    run: str
    first_bad: str | None
    last_good: str | None
    steps: list[Step]
    resumed: int  # steps taken from an earlier run of the same bisect


def _identity(host: str, metric: str, labels: Sequence[str], gates: Gates) -> str:
    text = json.dumps({"host": host, "metric": metric, "builds": list(labels), "gates": gates.model_dump()},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _unfinished(store: ResultsStore, host: str, identity: str) -> StoredRun | None:
    runs = [r for r in store.runs(host, kind="bisect") if r.record.extra.get("identity") == identity]
    runs.sort(key=lambda r: r.record.started)
    return runs[-1] if runs and runs[-1].record.status != "done" else None


def bisect(inventory: Inventory, host_name: str, good: str, bad: str, *, metric: str = "tg128",
           candidates: Sequence[BisectCandidate] | None = None, gates_file: Path | None = None,
           store: ResultsStore | None = None, say: Say = lambda _: None,
           on_event: Callable[[Any], None] | None = None) -> BisectResult:
    """The first build of the ordered list from ``good`` to ``bad`` that is worse than ``good`` on ``metric``."""
    store = store or ResultsStore()
    host = inventory.host(host_name)
    loaded = g.load_gates(host.vars.get(GATES_VAR), f"host {host.name}", gates_file)
    g.check_gates(loaded, host, f"--gates {gates_file}" if gates_file else f"host {host.name}: {GATES_VAR}")
    gates, gate_name = metric_gates(loaded, metric)
    order = list(candidates) if candidates else offered_versions(host, good, bad)
    labels = [c.label for c in order]
    try:
        lo, hi = labels.index(good), labels.index(bad)
    except ValueError:
        raise ConfigError(f"--good {good} and --bad {bad} must both be in the candidate list "
                          f"({', '.join(labels)})") from None
    if hi <= lo:
        raise ConfigError(f"--good {good} must come before --bad {bad} in the candidate list")
    order = order[lo:hi + 1]
    # Every build's pin before anything is fetched, built or asked of the host: a version this host cannot
    # build (a commit for an archive pin, a label for a git one) is refused here, not at its turn.
    pins = {item.label: candidate.pin_for(host, item.version, cmake_options=item.cmake,
                                          targets=("llama-server", "llama-bench")) for item in order}
    allowed = advisories.host_allowed(host)
    for item in order:
        number = advisories.build_number(item.version)
        if number is not None:
            check = advisories.check_build(number, allowed)
            if check.vulnerable:
                raise UpgradeRefused([check.refusal(f"bisect candidate {item.version}")])
    servers = g.served(host, gates)
    identity = _identity(host.name, metric, [c.label for c in order], gates)
    previous = _unfinished(store, host.name, identity)
    extra = {"identity": identity, "metric": metric, "gate": gate_name, "good": order[0].label,
             "bad": order[-1].label, "builds": [c.label for c in order], "gates": gates.model_dump(),
             "instances": _instances(servers)}
    with upgrade_run("bisect", host, servers[0], store, extra, previous) as run:
        if previous is not None:
            say(f"resuming bisect {run.ref}")
        steps = {row["label"]: Step(**{k: row[k] for k in Step.__dataclass_fields__ if k in row})
                 for row in checked_steps(run.path / STEPS_FILE)}
        try:
            return _bisect(inventory, host, servers, order, pins, gates, gate_name, run, steps, store, say, on_event)
        finally:
            run.record.extra["steps"] = len(steps)


def _bisect(inventory: Inventory, host: Host, servers: Sequence[Server], order: Sequence[BisectCandidate],
            pins: Mapping[str, candidate.CandidatePin], gates: Gates, gate_name: str, run: Run,
            steps: dict[str, Step], store: ResultsStore, say: Say,
            on_event: Callable[[Any], None] | None) -> BisectResult:
    """Measure the bad end, then midpoints, each step appended to the run's steps file (``steps``: those
    measured before, taken as they are)."""
    record, ref = run.record, run.ref
    resumed = len(steps)

    def build(item: BisectCandidate) -> CandidateBuild:
        pin = candidate.fetch_archive(pins[item.label])
        made = candidate.build_candidate(inventory, host.name, pin, on_event=on_event)
        archive = f", archive sha256 {pin.sha256}" if pin.sha256 else ""
        say(f"{item.label}: {made.build.name} ({made.plan}, {made.seconds:.0f} s{archive})")
        return made

    good_build = build(order[0])
    record.extra["good_build"] = _build_dict(good_build.build)
    run.save()

    def step(index: int) -> Step:
        item = order[index]
        if item.label in steps:
            say(f"{item.label}: {steps[item.label].verdict} (measured before)")
            return steps[item.label]
        nonlocal good_build
        made = build(item)
        if not _installed(host, good_build.build):  # a provision in between pruned it
            good_build = build(order[0])
        measured = paired.measure(host, servers, paired.Side("good", good_build.build),
                                  paired.Side(item.version, made.build), gates, store, run.path,
                                  say=say, record_extra={"bisect": ref})
        # The metric on every instance measured: the build is bad where any instance is.
        result = g.worst([r for r in measured.results if r.gate == gate_name])
        assert result is not None, gate_name
        verdict = {"pass": "good", "fail": "bad"}.get(result.verdict, "undecided")
        found = Step(item.version, item.label, made.build.name, made.plan, round(made.seconds, 1), verdict,
                     result.to_dict(), measured.bench_runs + list(measured.eval_runs.values()))
        steps[item.label] = found
        with (run.path / STEPS_FILE).open("a") as out:
            out.write(json.dumps(asdict(found), sort_keys=True, default=str) + "\n")
        say(f"{item.label}: {verdict}: {result.title}: {result.figures}")
        return found

    first_bad = last_good = None
    end = step(len(order) - 1)
    if end.verdict != "bad":
        raise UpgradeRefused([f"bisect: the bad end {order[-1].label} is {end.verdict} against {order[0].label} "
                              f"on {gate_name}: {end.gate['figures']}"], ref)
    lo, hi = 0, len(order) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        verdict = step(mid).verdict
        if verdict == "good":
            lo = mid
        elif verdict == "bad":
            hi = mid
        else:
            break
    if hi - lo == 1:
        first_bad, last_good = order[hi].label, order[lo].label
        record.extra.update(first_bad=first_bad, last_good=last_good)
        say(f"first bad build: {first_bad} (last good: {last_good})")
    else:
        record.extra.update(undecided_between=[order[lo].label, order[hi].label])
        say(f"undecided: the first bad build is after {order[lo].label} and at or before {order[hi].label}")
    candidate.drop_candidate(inventory, host.name, on_event=on_event)
    return BisectResult(ref, first_bad, last_good, [steps[c.label] for c in order if c.label in steps], resumed)
