"""Compare pulled eval runs: paired score gaps with bootstrap intervals, exact paired tests, equivalence
(TOST), flipped questions, the smallest detectable gap, sensitivity switches. Answer habits are
:mod:`rigctl.analysis.habits`', speed ratios of bench runs :mod:`rigctl.analysis.speed`'s.

Eval runs are compared question by question: each run's ``answers.jsonl`` (one line per question
with ``id``, ``set``, ``score``, ``cutoff`` and scorer keys such as ``toolless``, ``missed_call``,
``pred``, ``gold``) is keyed by ``(set, id)`` and only questions both runs answered are paired.
Two runs are comparable when their task file and dataset hashes agree; otherwise
:func:`compare_runs` refuses with the reason unless ``force``.

Each gap carries McNemar's exact test (right/wrong scores: the discordant counts b and c) or a
sign-flip permutation test (graded scores), with an equivalence margin a TOST and a verdict, and the
smallest gap detectable at 80 % power with the observed discordance (:mod:`rigctl.stats`). The
questions that flipped between the runs (right -> wrong, wrong -> right) are kept with both replies.

Sensitivity switches re-score before pairing, answering the sceptic's questions: every cut-off
reply as right, every tool-less reply as right, some sets left out. Each comparison carries the
gap as recorded and under each switch, so the report shows how far the gap moves.

Everything here is pure over run directories already on the controller; nothing talks to a host.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigctl.errors import ConfigError
from rigctl.hostside.scorers import GSM8K_SCORES
from rigctl.results.record import ANSWERS_FILE
from rigctl.results.store import StoredRun, iter_jsonl
from rigctl.stats import (
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    Equivalence,
    Interval,
    PairedTest,
    Verdict,
    bootstrap_mean,
    detectable_gap,
    holm,
    paired_bootstrap,
    paired_test,
    planned_gap,
    tost,
    verdict,
)

log = logging.getLogger(__name__)

OVERALL = "overall"


# ----------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunRef:
    """What a table needs to name a run and link to it."""

    host: str
    id: str
    path: Path
    kind: str
    label: str  # artifact (and server) the run measured, for column headers
    task: str | None
    build: str | None
    started: str
    #: How what its servers ran differs from their profiles (:func:`effective_flags`); empty when it does not.
    effective: tuple[str, ...] = ()

    @classmethod
    def of(cls, run: StoredRun) -> RunRef:
        record = run.record
        artifacts = ", ".join(a.name for a in record.artifacts) or \
            str(record.server.name if record.server and record.server.name else "?")
        build = record.llama_cpp.label or None
        return cls(host=run.host, id=run.id, path=run.path, kind=record.kind, label=f"{run.host}:{artifacts}",
                   task=record.task.name if record.task else None, build=build, started=record.started,
                   effective=tuple(effective_flags(run)))

    @property
    def name(self) -> str:
        return f"{self.host}/{self.id}"


def effective_flags(run: StoredRun) -> list[str]:
    """What the run's servers ran that their profiles (argv as deployed) do not say, one line per server and
    difference (:meth:`rigctl.results.record.Server.effective_differences`): a config file applied, a
    llama.cpp variable in the environment, ``/props`` context or slots the flags cannot give."""
    return [f"{server.host or run.host}/{server.name or server.label or server.endpoint or '?'}: {difference}"
            for server in run.record.servers for difference in server.effective_differences()]


def _dataset_hashes(value: Any) -> tuple[str, ...]:
    """A task's dataset identity by content: the sha256s, whatever keys (paths, URLs) they were read under."""
    if isinstance(value, dict):
        return tuple(sorted(str(v) for v in value.values()))
    return () if value is None else (str(value),)


def _short(hashes: tuple[str, ...]) -> str:
    return ",".join(h[:12] for h in hashes) or "none"


def task_identity(run: StoredRun) -> tuple[str | None, str | None, tuple[str, ...]]:
    task = run.record.task
    if task is None:
        return None, None, ()
    return task.name, task.file_sha256, _dataset_hashes(task.dataset_sha256)


def task_mismatch(a: StoredRun, b: StoredRun) -> str | None:
    """Why two eval runs may not be compared question by question, or None when they may."""
    for run in (a, b):
        if run.record.kind != "eval":
            return f"{run.host}/{run.id} is a {run.record.kind} run, not an eval run"
        if not run.record.task:
            return f"{run.host}/{run.id} records no task"
    name_a, file_a, data_a = task_identity(a)
    name_b, file_b, data_b = task_identity(b)
    if file_a != file_b:
        return (f"different task files: {a.host}/{a.id} ran {name_a} (sha256 {str(file_a)[:12]}), "
                f"{b.host}/{b.id} ran {name_b} (sha256 {str(file_b)[:12]})")
    if data_a != data_b:
        return (f"different datasets for task {name_a}: {a.host}/{a.id} has sha256 {_short(data_a)}, "
                f"{b.host}/{b.id} has {_short(data_b)}")
    return None


def answers_path(run: StoredRun) -> Path:
    return run.path / ANSWERS_FILE


def load_answers(run: StoredRun) -> list[dict[str, Any]]:
    """The run's per-question rows, whole; each must carry ``id``, ``set`` and ``score``."""
    return list(_checked_answers(answers_path(run), f"{run.host}/{run.id}"))


def _checked_answers(path: Path, name: str) -> Iterator[dict[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"{name}: no {ANSWERS_FILE} (not an eval run, or nothing pulled yet)")
    for number, row in enumerate(iter_jsonl(path), 1):
        missing = [k for k in ("id", "set", "score") if k not in row]
        if missing:
            raise ConfigError(f"{path}: answer {number} lacks {', '.join(missing)}")
        for key in dict.fromkeys(("score", *(k for k in GSM8K_SCORES if k in row))):  # a mean over inf is none
            score = row[key]
            if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
                raise ConfigError(f"{path}: answer {number}: {key} {score!r} is not a finite number")
        yield row


#: What comparing keeps of an answer row besides its reply: the keys :class:`Scoring` and the tables read.
_SCORED_KEYS = ("set", "id", "cutoff", "toolless", *GSM8K_SCORES)


def scored_answers(run: StoredRun) -> list[dict[str, Any]]:
    """The run's rows as comparing needs them (:func:`load_answers`' checks), each cut to its set, id, named
    scores, cut-off and tool-less flags and its reply as :func:`reply_text` shows it: read a line at a time,
    and once per state of the file while it is among the last few read (a matrix of runs, or a report's
    pairs, reads each run once). Shared between callers: read, never change."""
    path = answers_path(run)
    try:
        stat = path.stat()
        state = (stat.st_size, stat.st_mtime_ns)
    except OSError:
        state = (-1, -1)
    return _scored_answers(path, f"{run.host}/{run.id}", state)


@functools.lru_cache(maxsize=8)
def _scored_answers(path: Path, name: str, state: tuple[int, int]) -> list[dict[str, Any]]:
    return [{**{k: row[k] for k in _SCORED_KEYS if k in row}, "reply": reply_text(row)}
            for row in _checked_answers(path, name)]


# ----------------------------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Scoring:
    """How answers are scored before pairing: as recorded, with a sceptic's switch, or by another of the
    named scores the answers carry (``metric``, a key of :data:`scorers.GSM8K_SCORES`: lm-eval's strict-match
    or flexible-extract in place of rigctl's normalised GSM8K score)."""

    cutoff_as_right: bool = False
    toolless_as_right: bool = False
    exclude: tuple[str, ...] = ()
    metric: str = "score"

    @property
    def label(self) -> str:
        parts = [GSM8K_SCORES[self.metric]] if self.metric != "score" else []
        if self.cutoff_as_right:
            parts.append("cut-off as right")
        if self.toolless_as_right:
            parts.append("tool-less as right")
        if self.exclude:
            parts.append("without " + ", ".join(self.exclude))
        return " + ".join(parts) or "as recorded"

    def variants(self, metrics: Sequence[str] = ()) -> list[Scoring]:
        """As recorded, each switch on its own, all of them together when more than one is on, then each of
        ``metrics`` as recorded."""
        single = []
        if self.cutoff_as_right:
            single.append(Scoring(cutoff_as_right=True))
        if self.toolless_as_right:
            single.append(Scoring(toolless_as_right=True))
        if self.exclude:
            single.append(Scoring(exclude=self.exclude))
        return [Scoring(), *single, *([self] if len(single) > 1 else []), *(Scoring(metric=m) for m in metrics)]

    def scores(self, rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for row in rows:
            if row["set"] in self.exclude:
                continue
            score = float(row[self.metric])
            if (self.cutoff_as_right and row.get("cutoff")) or (self.toolless_as_right and row.get("toolless")):
                score = 1.0
            out[(str(row["set"]), str(row["id"]))] = score
        return out


# ----------------------------------------------------------------------------------------------- eval gaps


@dataclass(frozen=True)
class SetGap:
    """One set (or ``overall``): both runs' mean scores on the paired questions and B - A with its interval,
    its paired test, the TOST against the equivalence margin (when one is given) and the smallest gap
    detectable at 80 % power with this many questions and the observed discordance."""

    set: str
    n: int
    score_a: float
    score_b: float
    gap: Interval
    test: PairedTest | None = None
    equivalence: Equivalence | None = None
    detectable: float = math.nan

    def verdict(self, p: float | None = None) -> Verdict:
        """Equivalent / different / not shown; ``p`` overrides the test's p-value (e.g. Holm-adjusted)."""
        if self.test is None:
            return "not shown"
        return verdict(self.test, self.equivalence, p=p)

    def mirrored(self) -> SetGap:
        """The same gap read as A - B."""
        gap = self.gap
        return SetGap(self.set, self.n, self.score_b, self.score_a,
                      Interval(-gap.estimate, -gap.high, -gap.low, gap.n, gap.resamples, gap.level, gap.method),
                      self.test.mirrored() if self.test else None,
                      self.equivalence.mirrored() if self.equivalence else None, self.detectable)


@dataclass(frozen=True)
class Flip:
    """A question one run got right and the other wrong (for graded scores: scored lower or higher)."""

    set: str
    id: str
    score_a: float
    score_b: float
    reply_a: str
    reply_b: str

    @property
    def direction(self) -> str:
        return "right→wrong" if self.score_b < self.score_a else "wrong→right"


def label_text(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def reply_text(row: dict[str, Any]) -> str:
    """What a run answered, as a reader wants to see it: the tool calls, else the reply text, else the
    picked label (choice sets)."""
    calls = row.get("tool_calls")
    if calls:
        return json.dumps(calls, ensure_ascii=False, sort_keys=True)
    reply = row.get("reply")
    if isinstance(reply, str) and reply:
        return reply
    if "pred" in row:
        return f"label {label_text(row['pred']) or '(none)'}"
    return ""


def flips_of(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]], scoring: Scoring) -> list[Flip]:
    """Every paired question whose score differs between A and B under ``scoring``, in (set, id) order."""
    a, b = scoring.scores(rows_a), scoring.scores(rows_b)
    by_key_a = {(str(r["set"]), str(r["id"])): r for r in rows_a}
    by_key_b = {(str(r["set"]), str(r["id"])): r for r in rows_b}
    return [Flip(set=key[0], id=key[1], score_a=a[key], score_b=b[key], reply_a=reply_text(by_key_a[key]),
                 reply_b=reply_text(by_key_b[key]))
            for key in sorted(set(a) & set(b)) if a[key] != b[key]]


@dataclass(frozen=True)
class FlipCount:
    set: str
    right_to_wrong: int
    wrong_to_right: int


def flip_counts(flips: Sequence[Flip], sets: Sequence[str] = ()) -> list[FlipCount]:
    """Per set (``sets``, plus any that flipped) and ``overall``: how many questions went right -> wrong
    and wrong -> right."""
    out = []
    by_set: dict[str, list[Flip]] = {name: [] for name in sets}
    for flip in flips:
        by_set.setdefault(flip.set, []).append(flip)
    for name, group in [*sorted(by_set.items()), (OVERALL, list(flips))]:
        down = sum(f.score_b < f.score_a for f in group)
        out.append(FlipCount(name, down, len(group) - down))
    return out


@dataclass(frozen=True)
class VariantGap:
    scoring: Scoring
    overall: SetGap
    sets: tuple[SetGap, ...]

    @property
    def label(self) -> str:
        return self.scoring.label


@dataclass(frozen=True)
class ReplicateNoise:
    """Two runs of the same artifact and servers, question by question: the share of paired questions they
    score differently (``disagreement``, with its interval) and their gap (replicate - first, with its
    interval). Greedy replies at several slots differ between runs, so this is the noise an A/B difference of
    the same task carries: one whose interval overlaps the replicate gap's is not clearly larger than it."""

    run: RunRef
    n: int
    disagreement: Interval
    gap: Interval

    def covers(self, gap: Interval) -> bool:
        """Whether ``gap`` (an A/B difference) is within this noise: the two intervals overlap."""
        return gap.low <= self.gap.high and self.gap.low <= gap.high


def disagreement(a: dict[tuple[str, str], float], b: dict[tuple[str, str], float], keys: Sequence[tuple[str, str]],
                 *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> Interval:
    """The share of ``keys`` that ``a`` and ``b`` score differently, with its bootstrap interval."""
    return bootstrap_mean([float(a[k] != b[k]) for k in keys], resamples=resamples, seed=seed)


def replicate_noise(first: StoredRun, replicate: StoredRun, *, scoring: Scoring = Scoring(),
                    resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> ReplicateNoise:
    """How two runs of one thing disagree; ConfigError when they are not runs of one task or share no question."""
    mismatch = task_mismatch(first, replicate)
    if mismatch:
        raise ConfigError(f"refusing the replicate: {mismatch}")
    a, b = scoring.scores(scored_answers(first)), scoring.scores(scored_answers(replicate))
    keys = sorted(set(a) & set(b))
    if not keys:
        raise ConfigError(f"replicate {replicate.host}/{replicate.id} shares no question with {first.host}/{first.id}")
    return ReplicateNoise(run=RunRef.of(replicate), n=len(keys),
                          disagreement=disagreement(a, b, keys, resamples=resamples, seed=seed),
                          gap=paired_bootstrap([a[k] for k in keys], [b[k] for k in keys], resamples=resamples,
                                               seed=seed))


@dataclass(frozen=True)
class PairComparison:
    a: RunRef
    b: RunRef
    task: str | None
    variants: tuple[VariantGap, ...]
    only_a: int  # questions answered by A alone (left out of the pairing)
    only_b: int
    forced: str | None = None  # the mismatch that --force overrode
    flips: tuple[Flip, ...] = ()  # as recorded
    margin: float | None = None  # equivalence margin, points
    replicate: ReplicateNoise | None = None  # a second run of A, as recorded
    disagreement: Interval | None = None  # the share of paired questions A and B score differently

    @property
    def within_noise(self) -> bool:
        """The overall gap (as recorded) is not clearly larger than the replicate's noise."""
        return self.replicate is not None and self.replicate.covers(self.recorded.overall.gap)

    @property
    def recorded(self) -> VariantGap:
        return self.variants[0]

    @property
    def files(self) -> tuple[Path, Path]:
        return self.a.path / ANSWERS_FILE, self.b.path / ANSWERS_FILE


@dataclass(frozen=True)
class Comparison:
    """Every pair of the given runs (i < j): a single pair for two runs, a matrix for more."""

    runs: tuple[RunRef, ...]
    pairs: tuple[PairComparison, ...]
    resamples: int
    seed: int
    holm: tuple[float, ...] = ()  # Holm-adjusted p of each pair's overall gap (as recorded), in pair order

    def pair(self, a: str, b: str) -> PairComparison:
        for pair in self.pairs:
            if (pair.a.id, pair.b.id) == (a, b):
                return pair
        raise KeyError((a, b))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (paths as strings, NaN as null), for the MCP tools and ``--json`` style callers."""
        return _jsonable(dataclasses.asdict(self))

    def matrix(self) -> list[list[SetGap | None]]:
        """Row i, column j: the overall gap (column run minus row run); None on the diagonal."""
        index = {run.name: i for i, run in enumerate(self.runs)}
        grid: list[list[SetGap | None]] = [[None] * len(self.runs) for _ in self.runs]
        for pair in self.pairs:
            i, j = index[pair.a.name], index[pair.b.name]
            gap = pair.recorded.overall
            grid[i][j] = gap
            grid[j][i] = gap.mirrored()
        return grid


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _set_gap(name: str, keys: Sequence[tuple[str, str]], a: dict, b: dict, resamples: int, seed: int,
             margin: float | None) -> SetGap:
    xa = [a[k] for k in keys]
    xb = [b[k] for k in keys]
    n = len(keys)
    return SetGap(set=name, n=n, score_a=sum(xa) / n if n else float("nan"),
                  score_b=sum(xb) / n if n else float("nan"),
                  gap=paired_bootstrap(xa, xb, resamples=resamples, seed=seed),
                  test=paired_test(xa, xb, resamples=resamples, seed=seed),
                  equivalence=tost(xa, xb, margin / 100.0) if margin is not None else None,
                  detectable=planned_gap(xa, xb))


def paired_gaps(rows_a: list[dict], rows_b: list[dict], scoring: Scoring, *, resamples: int = DEFAULT_RESAMPLES,
                seed: int = DEFAULT_SEED, margin: float | None = None) -> VariantGap:
    """B - A per set and over all paired questions, under one scoring; ``margin`` (points) adds a TOST."""
    a = scoring.scores(rows_a)
    b = scoring.scores(rows_b)
    keys = sorted(set(a) & set(b))
    by_set: dict[str, list[tuple[str, str]]] = {}
    for key in keys:
        by_set.setdefault(key[0], []).append(key)
    sets = tuple(_set_gap(name, by_set[name], a, b, resamples, seed, margin) for name in sorted(by_set))
    return VariantGap(scoring=scoring, overall=_set_gap(OVERALL, keys, a, b, resamples, seed, margin), sets=sets)


def _check_margin(margin: float | None) -> None:
    if margin is not None and not 0 < margin <= 100:
        raise ConfigError(f"equivalence margin {margin:g}: give points between 0 and 100 (2 means ±2 points)")


def compare_pair(run_a: StoredRun, run_b: StoredRun, *, scoring: Scoring = Scoring(), force: bool = False,
                 resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
                 margin: float | None = None, replicate: StoredRun | None = None) -> PairComparison:
    """B - A under ``scoring`` and its variants; ``replicate`` (a second run of A) adds the noise of running
    twice."""
    mismatch = task_mismatch(run_a, run_b)
    if mismatch and not force:
        raise ConfigError(f"refusing to compare: {mismatch} (--force compares anyway)")
    rows_a, rows_b = scored_answers(run_a), scored_answers(run_b)
    keys_a = {(str(r["set"]), str(r["id"])) for r in rows_a}
    keys_b = {(str(r["set"]), str(r["id"])) for r in rows_b}
    if not keys_a & keys_b:
        raise ConfigError(f"{run_a.host}/{run_a.id} ({len(keys_a)} answers) and {run_b.host}/{run_b.id} "
                          f"({len(keys_b)} answers) share no question: nothing to pair")
    _check_margin(margin)
    variants = tuple(paired_gaps(rows_a, rows_b, s, resamples=resamples, seed=seed, margin=margin)
                     for s in scoring.variants(other_scores(rows_a + rows_b)))
    a, b = Scoring().scores(rows_a), Scoring().scores(rows_b)
    shared = sorted(set(a) & set(b))
    noise = replicate_noise(run_a, replicate, resamples=resamples, seed=seed) if replicate is not None else None
    return PairComparison(a=RunRef.of(run_a), b=RunRef.of(run_b), task=task_identity(run_a)[0], variants=variants,
                          only_a=len(keys_a - keys_b), only_b=len(keys_b - keys_a), forced=mismatch,
                          flips=tuple(flips_of(rows_a, rows_b, Scoring())), margin=margin, replicate=noise,
                          disagreement=disagreement(a, b, shared, resamples=resamples, seed=seed))


def compare_runs(runs: Sequence[StoredRun], *, cutoff_as_right: bool = False, toolless_as_right: bool = False,
                 exclude: Sequence[str] = (), force: bool = False, resamples: int = DEFAULT_RESAMPLES,
                 seed: int = DEFAULT_SEED, exclude_origin: str = "exclude", margin: float | None = None,
                 replicate: StoredRun | None = None) -> Comparison:
    """Compare two or more eval runs of one task pairwise (B - A for every i < j in the given order).
    ``exclude`` must name sets the runs have (a misspelt set would leave everything in, silently);
    ``exclude_origin`` says where it came from in that error (an option, a campaign key). ``margin``
    (points) adds a TOST to every gap. With more than one pair, the overall p-values are also
    Holm-adjusted across the pairs. ``replicate``, a second run of the first run's artifact, sets the noise
    of running twice beside the gap (two runs only)."""
    if len(runs) < 2:
        raise ConfigError(f"compare needs at least two runs, got {len(runs)}")
    if replicate is not None and len(runs) != 2:
        raise ConfigError(f"a replicate goes with two runs (A and B), got {len(runs)}")
    names = [f"{r.host}/{r.id}" for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"a run is given twice: {', '.join(n for n in names if names.count(n) > 1)}")
    check_sets(exclude, runs, exclude_origin)
    scoring = Scoring(cutoff_as_right=cutoff_as_right, toolless_as_right=toolless_as_right, exclude=tuple(exclude))
    _check_margin(margin)
    pairs = tuple(compare_pair(a, b, scoring=scoring, force=force, resamples=resamples, seed=seed, margin=margin,
                               replicate=replicate) for a, b in itertools.combinations(runs, 2))
    adjusted = holm([p.recorded.overall.test.p if p.recorded.overall.test else math.nan for p in pairs])
    return Comparison(runs=tuple(RunRef.of(r) for r in runs), pairs=pairs, resamples=resamples, seed=seed,
                      holm=tuple(adjusted))


def other_scores(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The named scores besides ``score`` that every row carries as a number (GSM8K runs since lm-eval's
    scores were added); older runs carry none."""
    return [key for key in GSM8K_SCORES if key != "score" and rows
            and all(isinstance(row.get(key), int | float) for row in rows)]


def check_sets(names: Sequence[str], runs: Sequence[StoredRun], origin: str) -> None:
    """ConfigError naming ``origin`` when a set in ``names`` is in none of the runs' answers."""
    if not names:
        return
    present = sorted({str(row["set"]) for run in runs for row in scored_answers(run)})
    unknown = [name for name in names if name not in present]
    if unknown:
        raise ConfigError(f"{origin} {', '.join(map(repr, unknown))}: no such set in these runs "
                          f"(sets: {', '.join(present)})")


def run_scores(run: StoredRun, *, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
               metric: str = "score") -> list[SetGap]:
    """One run's mean score (or another named score, ``metric``) per set and overall with intervals (``gap``
    holds the mean's interval)."""
    rows = scored_answers(run)
    by_set: dict[str, list[float]] = {}
    for row in rows:
        by_set.setdefault(str(row["set"]), []).append(float(row[metric]))
    everything = [float(r[metric]) for r in rows]
    out = []
    for name, values in [*sorted(by_set.items()), (OVERALL, everything)]:
        interval = bootstrap_mean(values, resamples=resamples, seed=seed)
        out.append(SetGap(set=name, n=len(values), score_a=interval.estimate, score_b=interval.estimate,
                          gap=interval))
    return out


#: Multiples of the questions in hand that a plan looks at.
PLAN_SCALES = (1, 2, 4, 10)


@dataclass(frozen=True)
class PlanRow:
    """The smallest gap one set of a pair can detect (two-sided 5 %, 80 % power) at n x each scale, from its
    observed discordance (right/wrong scores) or spread (graded: ``discordant`` None)."""

    pair: PairComparison
    gap: SetGap
    discordant: int | None
    discordance: float | None
    detectable: tuple[float, ...]  # per scale, as a fraction


def plan(result: Comparison, scales: Sequence[int] = PLAN_SCALES) -> list[PlanRow]:
    rows = []
    for pair in result.pairs:
        for gap in [*pair.recorded.sets, pair.recorded.overall]:
            test = gap.test
            if test is not None and test.b is not None:
                rows.append(PlanRow(pair, gap, test.b + test.c, test.discordance, tuple(
                    detectable_gap(gap.n * k, discordance=test.discordance) for k in scales)))
            else:  # graded scores: the normal-approximation gap shrinks with the square root of n
                rows.append(PlanRow(pair, gap, None, None, tuple(gap.detectable / math.sqrt(k) for k in scales)))
    return rows


# ----------------------------------------------------------------------------------------------- habits


# ----------------------------------------------------------------------------------------------- bench


