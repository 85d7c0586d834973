"""The latest results of a results store, per host and artifact: the mean bench t/s per test and configuration,
the mean eval score per task. What the exporter publishes and the MCP server's ``list_results`` summarises."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rigctl.errors import one_line
from rigctl.fleet.state import WarnOnce
from rigctl.results.record import ANSWERS_FILE
from rigctl.results.store import ResultsStore, StoredRun, read_run_jsonl, run_has

log = logging.getLogger(__name__)


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
    if not run_has(run, ANSWERS_FILE):
        return None
    rows = read_run_jsonl(run, ANSWERS_FILE)
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
        self._parsed: dict[str, list[BenchResult] | list[EvalScore]] = {}
        self._warn = WarnOnce()  # a directory without a readable record, once (the store is read again and again)

    def latest(self) -> tuple[list[BenchResult], list[EvalScore]]:
        newest: dict[tuple[str, ...], BenchResult | EvalScore] = {}
        if not self.store.root.is_dir():
            return [], []
        done = [run for run in self.store.runs(on_skip=lambda path, exc: self._warn(f"skipping {path}: {exc}"))
                if run.record.status == "done" and run.record.kind in ("bench", "eval")]
        # Newest first (the later in the store among equal ends, as a scan from the oldest would keep): an eval
        # run's slot is its record's, so an older run of a filled slot is never read.
        order = sorted(range(len(done)), key=lambda i: (_unix(done[i].record.ended), i), reverse=True)
        for run in (done[i] for i in order):
            if run.record.kind == "eval" and self._eval_slot(run) in newest:
                continue
            for result in self._results(run):
                slot = ((result.host, result.artifact, result.test, result.config) if isinstance(result, BenchResult)
                        else (result.host, result.task, result.artifact))
                if slot not in newest or newest[slot].ended < result.ended:
                    newest[slot] = result
        ordered = [newest[slot] for slot in sorted(newest)]
        return ([r for r in ordered if isinstance(r, BenchResult)], [r for r in ordered if isinstance(r, EvalScore)])

    @staticmethod
    def _eval_slot(run: StoredRun) -> tuple[str, ...]:
        """The slot an eval run's score fills (:func:`eval_score`'s host, task and artifact), from its record."""
        return (run.host, run.record.task.name if run.record.task else "unknown", _artifact_of(run))

    def _results(self, run: StoredRun) -> list[BenchResult] | list[EvalScore]:
        """A finished bench or eval run's results, parsed once."""
        key = f"{run.host}/{run.id}"
        if key not in self._parsed:
            try:
                if run.record.kind == "bench":
                    self._parsed[key] = bench_results(run)
                else:
                    score = eval_score(run)
                    self._parsed[key] = [score] if score is not None else []
            except Exception as exc:  # one run's files, whatever they hold, cost only that run
                log.warning("skipping %s run %s: %s", run.record.kind, key, one_line(exc))
                self._parsed[key] = []
        return self._parsed[key]
