"""Two llama.cpp builds on one host, measured paired under an upgrade's gates (:mod:`rigctl.upgrade.gates`).

Side A (the current build, or a bisect's good end) and side B (the candidate, or a bisect's midpoint) are
installed builds on the host. Everything reuses the bench, server, eval and compare machinery:

* **llama-bench**: one bench job (:func:`rigctl.bench.matrix.bench_job_spec` with both builds) whose cells
  alternate the builds' llama-bench on each model, clock-gated like every bench; the ratios are
  :func:`rigctl.analysis.speed.compare_bench`'s. The job stops the host's servers for its run, as every bench does.
* **server**: each side's llama-server serving the instance's artifact with the instance's profile — the
  instance itself for the current build, a probe (:func:`rigctl.fleet.servers.probe_server`, the build's own
  llama-server, another port) otherwise — asked the same filler prompts back to back, alternating which
  side goes first (:func:`rigctl.bench.server.measure_prompt`).
* **identity**: greedy replies of both sides to the drafter race's prompts
  (:func:`rigctl.bench.drafting.load_prompts`), byte for byte.
* **quality**: an eval slice on each side (:mod:`rigctl.evals.runner`), paired by
  :func:`rigctl.analysis.compare.compare_pair` (McNemar, TOST at the gate's margin).

A gate whose verdict is undecided at the measured n is measured again with more (bench rounds, server
repeats, eval questions) until it decides or its budget is spent. Raw rows go to the caller's run directory
(``server.jsonl``, ``identity.jsonl``); bench and eval runs are runs of their own in the results store,
named in the result.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rigctl.errors import RigctlError, ServerError
from rigctl.fleet.build import Build
from rigctl.fleet.servers import probe_server, probe_unit, wait_ready
from rigctl.forward import server_endpoint
from rigctl.inventory import Host, Server
from rigctl.inventory.gates import BenchGate, Gates, IdentityGate, QualityGate, ServerGate
from rigctl.llama_http import Endpoint, ServerClient, Timeouts
from rigctl.results.store import ResultsStore
from rigctl.ssh import session
from rigctl.upgrade import gates as g

log = logging.getLogger(__name__)

SERVER_FILE = "server.jsonl"
IDENTITY_FILE = "identity.jsonl"
#: How long a request may take; the lab's shared CPUs make a 512-token prefill slow.
REQUEST_TIMEOUTS = Timeouts(read=600.0)


@dataclass(frozen=True)
class Side:
    """One build under measurement: ``label`` (current, candidate, or a version) and its installed build."""

    label: str
    build: Build

    @property
    def llama_server(self) -> str:
        return f"{self.build.dir}/bin/llama-server"


@dataclass
class PairedResult:
    """What was measured and each gate's verdict."""

    a: Side
    b: Side
    results: list[g.GateResult] = field(default_factory=list)
    bench_runs: list[str] = field(default_factory=list)  # host/run id
    eval_runs: dict[str, str] = field(default_factory=dict)  # side label -> host/run id
    errors: dict[str, int] = field(default_factory=dict)  # side label -> failed requests and bench cells

    @property
    def verdict(self) -> g.Verdict:
        return g.overall(self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"a": {"label": self.a.label, "build": self.a.build.name}, "b": {"label": self.b.label,
                                                                               "build": self.b.build.name},
                "verdict": self.verdict, "results": [r.to_dict() for r in self.results],
                "bench_runs": self.bench_runs, "eval_runs": self.eval_runs, "errors": self.errors}


Say = Callable[[str], None]


def _append(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    with path.open("a") as out:
        for row in rows:
            out.write(json.dumps(row, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------- bench


def _bench(host: Host, server: Server, a: Side, b: Side, gate: BenchGate, rounds: int, store: ResultsStore,
           say: Say) -> str:
    """One bench job of ``rounds`` cells per build and model, alternating the builds; its host/run id."""
    from rigctl import jobs
    from rigctl.bench.matrix import BenchSpec, bench_job_spec

    spec = BenchSpec(hosts=[host.name], models=gate.models or [server.artifact], matrix=gate.matrix, rounds=rounds,
                     cooldown=gate.cooldown, stop_servers=gate.stop_servers)
    info = jobs.start(host, bench_job_spec(host, spec, builds=[(a.build.name, a.build.dir),
                                                               (b.build.name, b.build.dir)]))
    say(f"bench job {info.id}: {rounds} round(s) of llama-bench cells alternating {a.build.name} and "
        f"{b.build.name}")
    final = jobs.wait(host, info.id, on_progress=lambda i: say(i.describe()))
    jobs.pull(host, store, runs=[info.id])
    if final.state != "done":
        raise RigctlError(f"{host.name}: bench job {info.id} ended {final.state}" +
                          (f": {final.error}" if final.error else ""))
    return f"{host.name}/{info.id}"


def bench_results(store: ResultsStore, refs: Sequence[str], a: Side, b: Side, margin: float,
                  level: float) -> tuple[list[g.GateResult], dict[str, int]]:
    """A speed gate per llama-bench test (pp, tg, each depth) from the bench runs ``refs``, and the failed cells
    per build. The cells of one round (one per build, back to back) are a pair: the ratio is the geometric
    mean of the rounds' ratios of mean tokens/s, its interval the paired bootstrap's, so load that moves both
    cells of a round alike cancels. The ratio of every repetition pooled, as `rigctl compare` gives it, is
    kept beside it."""
    from rigctl.analysis.speed import compare_bench
    from rigctl.bench.matrix import CELLS_FILE, load_run_samples
    from rigctl.results.store import read_run_jsonl

    samples = []
    rounds: dict[tuple[str, int], int] = {}
    failed = {a.label: 0, b.label: 0}
    sides = {a.build.name: a.label, b.build.name: b.label}
    for ref in refs:
        run = store.find(ref)
        samples += load_run_samples(run)
        for cell in read_run_jsonl(run, CELLS_FILE):
            rounds[(run.id, int(cell.get("index", 0)))] = int(cell.get("round", 0))
            if (cell.get("rc") != 0 or cell.get("error")) and cell.get("build") in sides:
                failed[sides[cell["build"]]] += 1
    comparison = compare_bench(a.build.name, [s for s in samples if s.build == a.build.name],
                               b.build.name, [s for s in samples if s.build == b.build.name])
    out = []
    for ratio in comparison.ratios:
        per_round: dict[tuple[str, int], dict[str, float]] = {}
        for s in samples:
            if (s.test, s.config, s.flash_attn) == (ratio.test, ratio.config, ratio.flash_attn) and not s.throttled:
                per_round.setdefault((s.run_id, rounds.get((s.run_id, s.cell), s.cell)), {})[s.build] = \
                    math.fsum(s.samples_ts) / len(s.samples_ts)
        pairs = [p for p in per_round.values() if a.build.name in p and b.build.name in p]
        current = [p[a.build.name] for p in pairs]
        candidate = [p[b.build.name] for p in pairs]
        interval = g.paired_log_ratio(current, candidate, level=level)
        out.append(g.speed_gate(f"bench {ratio.test}", interval, margin, n_a=len(pairs), n_b=len(pairs),
                                mean_a=math.fsum(current) / len(current) if current else math.nan,
                                mean_b=math.fsum(candidate) / len(candidate) if candidate else math.nan,
                                unit="t/s", paired="rounds",
                                detail={"config": ratio.config, "flash_attn": ratio.flash_attn,
                                        "pooled": ratio.ratio.to_dict(), "files": list(ratio.files)}))
    return out, failed


# ----------------------------------------------------------------------------------------------- serving


@contextmanager
def serving(host: Host, server: Server, side: Side, *, port: int, purpose: str,
            is_instance: bool) -> Iterator[Endpoint]:
    """Where ``side`` answers: the instance itself (``is_instance``: it runs this build), else a probe of the
    instance with the side's llama-server on ``port``, stopped on exit."""
    with session(host) as ssh:
        if is_instance:
            endpoint = server_endpoint(ssh, server)
            wait_ready(ssh, server.unit, endpoint, purpose=purpose)
            yield endpoint
            return
        with probe_server(ssh, server, {}, port, purpose, binary=side.llama_server) as probe:
            yield probe.endpoint


def _server_rows(clients: dict[str, ServerClient], prompts: Sequence[str], gate: ServerGate, repeats: range,
                 order: Sequence[str]) -> list[dict[str, Any]]:
    from rigctl.bench.server import measure_prompt

    rows = []
    for repeat in repeats:
        for index, prompt in enumerate(prompts):
            first = (repeat + index) % 2  # which side goes first alternates, pair by pair
            for label in (order[first], order[1 - first]):
                row: dict[str, Any] = {"repeat": repeat, "prompt": index, "side": label}
                try:
                    point = measure_prompt(clients[label], prompt, gate.max_tokens)
                    row.update(asdict(point))
                except ServerError as exc:
                    row["error"] = str(exc)
                rows.append(row)
    return rows


def server_results(rows: Sequence[dict[str, Any]], a: Side, b: Side, margin: float,
                   level: float) -> list[g.GateResult]:
    """Decode and TTFT speed gates from the paired rows (a pair: one repeat of one prompt, both sides answered)."""
    by_pair: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if "error" not in row and not row.get("warmup"):
            by_pair.setdefault((row["repeat"], row["prompt"]), {})[row["side"]] = row
    pairs = [p for p in by_pair.values() if a.label in p and b.label in p
             and p[a.label]["decode_per_s"] > 0 and p[b.label]["decode_per_s"] > 0
             and p[a.label]["ttft_s"] > 0 and p[b.label]["ttft_s"] > 0]
    out = []
    for metric, key, higher, unit in (("decode", "decode_per_s", True, "t/s"), ("ttft", "ttft_s", False, "s")):
        current = [p[a.label][key] for p in pairs]
        candidate = [p[b.label][key] for p in pairs]
        interval = g.paired_log_ratio(current, candidate, higher_is_better=higher, level=level)
        mean_a = math.fsum(current) / len(current) if current else math.nan
        mean_b = math.fsum(candidate) / len(candidate) if candidate else math.nan
        out.append(g.speed_gate(f"server {metric}", interval, margin, n_a=len(current), n_b=len(candidate),
                                mean_a=mean_a, mean_b=mean_b, unit=unit, paired="requests",
                                detail={"pairs": len(pairs), "file": SERVER_FILE,
                                        "ratio": "candidate/current" if higher else "current/candidate"}))
    return out


def _identity_rows(clients: dict[str, ServerClient], gate: IdentityGate, order: Sequence[str],
                   seed: int) -> list[dict[str, Any]]:
    from rigctl.bench.drafting import load_prompts

    rows = []
    for index, (kind, messages) in enumerate(load_prompts(kinds=gate.kinds or None).items()):
        for label in (order[index % 2], order[1 - index % 2]):
            row: dict[str, Any] = {"kind": kind, "side": label}
            try:
                reply = clients[label].chat(messages, max_tokens=gate.max_tokens, temperature=0.0, seed=seed)
                row.update(text=reply.content, finish_reason=reply.finish_reason,
                           tokens=reply.timings.predicted_n if reply.timings else None)
            except ServerError as exc:
                row["error"] = str(exc)
            rows.append(row)
    return rows


def identity_result(rows: Sequence[dict[str, Any]], a: Side, b: Side, gate: IdentityGate,
                    level: float) -> g.GateResult:
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_kind.setdefault(row["kind"], {})[row["side"]] = row
    same = [by_kind[k][a.label].get("text") == by_kind[k][b.label].get("text")
            for k in by_kind if "error" not in by_kind[k].get(a.label, {"error": 1})
            and "error" not in by_kind[k].get(b.label, {"error": 1})]
    differing = sorted(k for k in by_kind if a.label in by_kind[k] and b.label in by_kind[k]
                       and by_kind[k][a.label].get("text") != by_kind[k][b.label].get("text"))
    return g.identity_gate(same, gate.floor, level=level, detail={"differing": differing, "file": IDENTITY_FILE})


# ----------------------------------------------------------------------------------------------- quality


def _eval_side(host: Host, server: Server, side: Side, endpoint: Endpoint, gate: QualityGate, limit: int,
               store: ResultsStore, run_ref: str | None, probe_unit: str | None, port: int, extra: dict[str, Any],
               ) -> str:
    """Answer ``limit`` questions of the gate's task on ``endpoint`` (continuing run ``run_ref`` when given:
    only the new questions are asked); the run's host/id."""
    from rigctl.evals import runner
    from rigctl.evals.tasks import load_task
    from rigctl.results.record import LlamaCppBuild
    from rigctl.results.run import Run
    from rigctl.results.stamp import collect_stamp, inventory_server

    task = load_task(gate.task, limit=limit)
    options = runner.Options(concurrency=gate.concurrency)
    if run_ref is None:
        with session(host) as ssh:
            stamp = collect_stamp(host, ssh, [inventory_server(host, server.name, unit=probe_unit, port=port)],
                                  artifacts=[server.artifact])
        # The server's build is the side's, whichever build is current on the host.
        stamp.llama_cpp = LlamaCppBuild(name=side.build.name, dir=side.build.dir, commit=side.build.commit,
                                        version=side.build.version, build_key=side.build.key,
                                        build_number=side.build.build_number, cuda=side.build.cuda,
                                        binaries=dict(side.build.binaries))
        run = runner.start_run(task, endpoint, store, host.name, options=options, limit=limit, stamp=stamp,
                               extra=extra)
    else:  # the same run asked the questions it lacks: the bigger slice
        run = Run.reopen(store.find(run_ref))
        run.record.task = runner.task_stamp(task)
        run.record.extra["limit"] = limit
        run.save()
    runner.run(task, endpoint, run, options)
    return run.ref


def quality_result(store: ResultsStore, ref_a: str, ref_b: str, gate: QualityGate) -> g.GateResult:
    """The quality gate from two eval runs paired question by question. A wrong answer (the scorer's ``error``
    says why) counts here and only here, never as a failed request: an eval request that still fails after its
    retries stops its run, and the measurement with it."""
    from rigctl.analysis.compare import compare_pair

    run_a, run_b = store.find(ref_a), store.find(ref_b)
    pair = compare_pair(run_a, run_b, margin=gate.margin)
    overall = pair.recorded.overall
    test, tost = overall.test, overall.equivalence
    return g.quality_gate(n=overall.n, score_a=overall.score_a, score_b=overall.score_b,
                          b=test.b if test else None, c=test.c if test else None,
                          p=test.p if test else math.nan, equivalent=bool(tost and tost.equivalent),
                          tost_p=tost.p if tost else math.nan, low=tost.low if tost else math.nan,
                          high=tost.high if tost else math.nan, margin_points=gate.margin,
                          detail={"runs": [ref_a, ref_b], "task": pair.task,
                                  "gap": overall.gap.to_dict(), "detectable": overall.detectable})


# ----------------------------------------------------------------------------------------------- all of it


def measure(host: Host, server: Server, a: Side, b: Side, gates: Gates, store: ResultsStore, run_dir: Path, *,
            a_is_instance: bool, say: Say = lambda _: None, record_extra: dict[str, Any] | None = None,
            seed: int = 1234) -> PairedResult:
    """Every gate of ``gates`` on ``a`` against ``b`` (B / A), measuring more while a gate is undecided and its
    budget allows; raw rows appended to ``run_dir``."""
    result = PairedResult(a, b)
    errors = {a.label: 0, b.label: 0}
    margin, level = gates.speed_margin, gates.level
    if gates.bench is not None:
        rounds = gates.bench.rounds
        result.bench_runs.append(_bench(host, server, a, b, gates.bench, rounds, store, say))
        while True:
            bench, failed = bench_results(store, result.bench_runs, a, b, margin, level)
            more = min(gates.bench.rounds, gates.bench.max_rounds - rounds)
            if not any(r.verdict == "undecided" for r in bench) or more <= 0:
                break
            undecided = ", ".join(r.gate for r in bench if r.verdict == "undecided")
            say(f"{undecided}: cannot decide at {rounds} round(s); {more} more (budget {gates.bench.max_rounds})")
            rounds += more
            result.bench_runs.append(_bench(host, server, a, b, gates.bench, more, store, say))
        result.results += bench
        for label, count in failed.items():
            errors[label] += count
    if gates.server is None and gates.identity is None and gates.quality is None:
        result.errors = errors
        result.results.append(g.errors_gate(errors[a.label], errors[b.label], gates.new_errors))
        return result
    offset = gates.server.port_offset if gates.server else ServerGate().port_offset
    with ExitStack() as stack:
        endpoints = {a.label: stack.enter_context(serving(host, server, a, port=server.port + offset + 1,
                                                          purpose=f"{a.label} build", is_instance=a_is_instance)),
                     b.label: stack.enter_context(serving(host, server, b, port=server.port + offset,
                                                          purpose=f"{b.label} build", is_instance=False))}
        clients = {label: stack.enter_context(ServerClient(e, timeouts=REQUEST_TIMEOUTS))
                   for label, e in endpoints.items()}
        order = (a.label, b.label)
        if gates.server is not None:
            from rigctl.bench.server import filler_prompt

            tokenizer = clients[a.label]
            prompts = [filler_prompt(n, lambda text: len(tokenizer.tokenize(text)))
                       for n in gates.server.prompt_lengths]
            warm = _server_rows(clients, prompts[:1], gates.server, range(0, 1), order)
            _append(run_dir / SERVER_FILE, [{**row, "warmup": True} for row in warm])
            rows = _server_rows(clients, prompts, gates.server, range(1, gates.server.repeats + 1), order)
            repeats = gates.server.repeats
            while True:
                server_gates = server_results(rows, a, b, margin, level)
                more = min(gates.server.repeats, gates.server.max_repeats - repeats)
                if not any(r.verdict == "undecided" for r in server_gates) or more <= 0:
                    break
                say(f"{', '.join(r.gate for r in server_gates if r.verdict == 'undecided')}: cannot decide at "
                    f"{repeats} repeat(s); {more} more (budget {gates.server.max_repeats})")
                rows += _server_rows(clients, prompts, gates.server, range(repeats + 1, repeats + more + 1), order)
                repeats += more
            _append(run_dir / SERVER_FILE, rows)
            result.results += server_gates
            for row in rows:
                errors[row["side"]] += 1 if "error" in row else 0
            say("; ".join(f"{r.gate}: {r.figures}" for r in server_gates))
        if gates.identity is not None:
            rows = _identity_rows(clients, gates.identity, order, seed)
            _append(run_dir / IDENTITY_FILE, rows)
            result.results.append(identity_result(rows, a, b, gates.identity, level))
            for row in rows:
                errors[row["side"]] += 1 if "error" in row else 0
            say(f"identity: {result.results[-1].figures}")
        if gates.quality is not None:
            limit = gates.quality.limit
            refs: dict[str, str | None] = {a.label: None, b.label: None}
            while True:
                for side, port in ((a, server.port + offset + 1), (b, server.port + offset)):
                    instance = side is a and a_is_instance
                    unit = None if instance else probe_unit(server, f"{side.label} build")
                    refs[side.label] = _eval_side(host, server, side, endpoints[side.label], gates.quality, limit,
                                                  store, refs[side.label], unit, server.port if instance else port,
                                                  {**(record_extra or {}), "side": side.label})
                quality = quality_result(store, str(refs[a.label]), str(refs[b.label]), gates.quality)
                bigger = min(limit * 2, gates.quality.max_limit)
                if quality.verdict != "undecided" or bigger <= limit:
                    break
                say(f"quality: {quality.figures}: cannot decide at {limit} questions; {bigger} (budget "
                    f"{gates.quality.max_limit})")
                limit = bigger
            result.results.append(quality)
            result.eval_runs = {label: str(ref) for label, ref in refs.items()}
            say(f"quality: {quality.figures}")
    result.errors = errors
    result.results.append(g.errors_gate(errors[a.label], errors[b.label], gates.new_errors))
    return result
