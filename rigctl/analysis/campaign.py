"""Campaign files: a whole study (hosts, artifacts, benches, evals, the comparisons that matter) as one
YAML file, the pulled runs that answer it, and running what is missing.

    name: lab
    title: SmolLM2 Q4_1 vs the Q4_0 requantized from it
    hosts: [desktop]
    artifacts:                       # artifact name -> how tables call it
      smollm2-135m-q4_1: {label: SmolLM2 Q4_1}
    benches:                         # rigctl.bench.matrix.BenchSpec fields, plus a name
      - {name: speed, hosts: [desktop], models: [smollm2-135m-q4_1, smollm2-135m-q4_0], matrix: {...}}
    evals:                           # a task (shipped name or file, relative to the campaign file) and
      - name: suite                  # the servers that answer it
        task: tasks/suite.yaml
        limit: null
        runs: [{host: desktop, server: smollm2, artifact: smollm2-135m-q4_1},
               # fan-out: one run over several servers of the same artifact and build
               {servers: [{host: desktop, server: smollm2}, {host: laptop, server: smollm2}],
                artifact: smollm2-135m-q4_1}]
    comparisons:                     # B - A per eval task (targets as "<artifact>@<host>[+<host>...][#n]")
      - {name: ..., section: quantisation, a: smollm2-135m-q4_1@desktop, b: smollm2-135m-q4_0@desktop,
         equivalence_margin: 2,      # points; TOST says equivalent / different / not shown either way
         replicate: smollm2-135m-q4_1@desktop#2}   # a second run of A (a target with replicate: 2): its
                                     # disagreement with A is the noise the A/B difference is set against
    equivalence_margin: 2            # the default for every comparison (none: no equivalence test)
    sensitivity: {cutoff_as_right: true, toolless_as_right: true, exclude: [civil_comments]}
    drafting:                        # drafter races (rigctl bench spec) through running instances
      - {name: mtp, host: desktop, baseline: qwen, drafters: [qwen-mtp], repeats: 3}
    loads:                           # load curves (rigctl bench load) through a probe of an instance
      - {name: curve, host: desktop, server: smollm2, concurrency: [1, 2, 4, 8], max_tokens: 32,
         requests: 16, max_requests: 64, precision: 0.1, warmup: 1}   # least and most a level, the
                                     # intervals' half-width asked, warm-up requests per client
    klds:                            # KL divergence against a reference (rigctl eval kld): a job per host;
      - {name: q4, hosts: [desktop], reference: qwen-bf16, models: [qwen-q4_0],   # text: relative to
         text: corpus/wiki.test.raw, ctx: 512, chunks: 100}                       # the campaign file
    not_measured: [thinking on, ...] # for the report's scope line

:func:`locate` finds, for every bench (per host) and every eval target, the newest pulled run that answers it;
:func:`run_campaign` runs only what is missing (resuming stopped eval runs), skipping a drained host's steps.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rigctl.bench.matrix import BenchSpec
from rigctl.errors import ConfigError, DrainedError, JobBusyError, RigctlError
from rigctl.evals.kld import KldSpec, corpus_identity
from rigctl.evals.tasks import check_task_sets, load_task
from rigctl.fleet.drain import InService
from rigctl.inputs import error_line, read_mapping
from rigctl.inventory import Host, Inventory
from rigctl.results.store import ResultsStore, StoredRun

if TYPE_CHECKING:  # rigctl.jobs brings paramiko
    from rigctl import jobs

log = logging.getLogger(__name__)

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ArtifactInfo(_Strict):
    label: str
    note: str = ""


class CampaignBench(BenchSpec):
    """A bench of the campaign: a name and rigctl.bench's spec."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")

    def spec(self, host: str) -> BenchSpec:
        return BenchSpec(**{**self.model_dump(exclude={"name"}), "hosts": [host]})


class ServerRef(_Strict):
    host: str
    server: str


class EvalTarget(_Strict):
    """The servers that answer an eval: one (``host`` + ``server``) or several serving the same artifact
    (``servers``; fan-out, one run). ``host`` and ``server`` name the first of them either way."""

    host: str
    server: str
    artifact: str
    servers: list[ServerRef] = []
    # A second (third...) run of the same servers and artifact: what two runs of one thing disagree on is the
    # noise every A/B difference carries (batch order at several slots changes greedy replies).
    replicate: int = Field(default=1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _first_server(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("servers") is not None:
            if "host" in data or "server" in data:
                raise ValueError("give host and server, or servers, not both")
            servers = data["servers"]
            if not isinstance(servers, list) or len(servers) < 2:
                raise ValueError("servers: a fan-out needs a list of at least two {host, server}")
            first = servers[0] if isinstance(servers[0], dict) else {}
            data = {**data, "host": first.get("host"), "server": first.get("server")}
        return data

    @model_validator(mode="after")
    def _distinct(self) -> EvalTarget:
        pairs = [(s.host, s.server) for s in self.members]
        if len(set(pairs)) != len(pairs):
            raise ValueError("servers: a server is listed twice")
        return self

    @property
    def members(self) -> list[ServerRef]:
        return list(self.servers) or [ServerRef(host=self.host, server=self.server)]

    @property
    def fanout(self) -> bool:
        return len(self.members) > 1

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(s.host for s in self.members))

    @property
    def base_id(self) -> str:
        """The id of the first run of this target (replicates share it)."""
        return f"{self.artifact}@{'+'.join(self.hosts)}"

    @property
    def id(self) -> str:
        return self.base_id + (f"#{self.replicate}" if self.replicate > 1 else "")


class CampaignEval(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    task: str
    limit: int | None = Field(default=None, ge=1)
    concurrency: int = Field(default=8, ge=1)
    runs: list[EvalTarget] = Field(min_length=1)


class CampaignComparison(_Strict):
    name: str
    section: Literal["headline", "quantisation", "qat", "other"] = "headline"
    a: str  # eval target ids (<artifact>@<host>)
    b: str
    evals: list[str] = []  # none: every eval both targets ran
    equivalence_margin: float | None = Field(default=None, gt=0, le=100)  # points; none: the campaign's
    # A replicate of ``a`` (``<a>#2``): the report sets their disagreement beside the A/B difference.
    replicate: str | None = None


class Sensitivity(_Strict):
    cutoff_as_right: bool = False
    toolless_as_right: bool = False
    exclude: list[str] = []


class CampaignDrafting(_Strict):
    """A drafter race (rigctl.bench.drafting.run_race): a baseline instance against its drafting instances."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    host: str
    baseline: str  # llama_server instance without drafting
    drafters: list[str] = []  # none: every instance of the same artifact with a drafting profile
    repeats: int = Field(default=3, ge=1)
    max_tokens: int = Field(default=256, ge=1)
    temperatures: list[float] = [0.0, 0.8]


class CampaignLoad(_Strict):
    """A load curve (rigctl.bench.load.run_load): a probe of ``server`` with a slot per client."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    host: str
    server: str
    concurrency: list[Annotated[int, Field(ge=1, le=64)]] = Field(default=[1, 2, 4, 8], min_length=1)
    requests: int | None = Field(default=None, ge=1, le=1000)  # least per level; none: 4 per client, at least 8
    max_requests: int | None = Field(default=None, ge=1, le=1000)  # most per level; none: 4 x the least
    precision: float = Field(default=0.10, gt=0, lt=1)  # the intervals' half-width asked, relative
    warmup: int = Field(default=1, ge=0, le=16)  # warm-up requests per client before each level
    max_tokens: int = Field(default=32, ge=1, le=4096)
    slot_ctx: int = Field(default=1024, ge=64)
    level_timeout_s: float = Field(default=120.0, gt=0)


class CampaignUpgrade(_Strict):
    """A gated llama.cpp upgrade (rigctl.upgrade.upgrade.upgrade) of the canary's fleet, as a step: run once;
    its record (passed or refused) is the step's result and the report's "Upgrades" section."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    to: str
    canary: str
    gates: str | None = None  # a gates file, relative to the campaign file
    cmake: dict[str, str] = {}  # CMake cache entries for the candidate (its build key)

    @model_validator(mode="after")
    def _as_the_command_takes_them(self) -> CampaignUpgrade:  # `build upgrade --to/--cmake`'s checks, at load
        from rigctl.fleet.candidate import VERSION, parse_cmake_options

        if not VERSION.fullmatch(self.to):
            raise ValueError(f"to {self.to!r}: expected a build label (b11434) or a git commit")
        try:
            parse_cmake_options(f"{k}={v}" for k, v in self.cmake.items())
        except ConfigError as exc:
            raise ValueError(f"cmake: {exc}") from None
        return self


class CampaignKld(KldSpec):
    """A KLD step of the campaign: a name and rigctl.evals.kld's spec (``text`` relative to the campaign file)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")

    def spec(self, host: str, text: Path) -> KldSpec:
        return KldSpec(**{**self.model_dump(exclude={"name"}), "hosts": [host], "text": text})


class Campaign(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    title: str
    hosts: list[str] = Field(min_length=1)
    artifacts: dict[str, ArtifactInfo] = {}
    benches: list[CampaignBench] = []
    evals: list[CampaignEval] = []
    comparisons: list[CampaignComparison] = []
    sensitivity: Sensitivity = Sensitivity()
    drafting: list[CampaignDrafting] = []
    loads: list[CampaignLoad] = []
    upgrades: list[CampaignUpgrade] = []
    klds: list[CampaignKld] = []
    not_measured: list[str] = []
    equivalence_margin: float | None = Field(default=None, gt=0, le=100)  # points, for every comparison
    seed: int = 0
    resamples: int = Field(default=10_000, ge=100)

    @model_validator(mode="after")
    def _consistent(self) -> Campaign:
        targets = {t.id: t for e in self.evals for t in e.runs}
        for evaluation in self.evals:
            ids = [t.id for t in evaluation.runs]
            twice = sorted({i for i in ids if ids.count(i) > 1})
            if twice:
                raise ValueError(f"eval {evaluation.name!r}: target {twice[0]!r} is listed twice "
                                 f"(a second run of it is a replicate: replicate: 2)")
        for comparison in self.comparisons:
            for side in (comparison.a, comparison.b, *([comparison.replicate] if comparison.replicate else [])):
                if side not in targets:
                    raise ValueError(f"comparison {comparison.name!r}: {side!r} is no eval target "
                                     f"(targets: {', '.join(sorted(targets)) or 'none'})")
            if comparison.replicate and (comparison.replicate == comparison.a or
                                         targets[comparison.replicate].base_id != targets[comparison.a].base_id):
                raise ValueError(f"comparison {comparison.name!r}: replicate {comparison.replicate!r} is not "
                                 f"another run of {comparison.a!r} (give {targets[comparison.a].base_id}#2)")
            unknown = sorted(set(comparison.evals) - {e.name for e in self.evals})
            if unknown:
                raise ValueError(f"comparison {comparison.name!r}: no eval named {', '.join(unknown)}")
        hosts = set(self.hosts)
        used = {h for b in self.benches for h in b.hosts} | {
            h for e in self.evals for t in e.runs for h in t.hosts} | {d.host for d in self.drafting} | {
            load.host for load in self.loads} | {u.canary for u in self.upgrades} | {
            h for k in self.klds for h in k.hosts}
        if used - hosts:
            raise ValueError(f"hosts not listed under hosts: {', '.join(sorted(used - hosts))}")
        for name in [m for b in self.benches for m in b.models] + [t.artifact for e in self.evals for t in e.runs] \
                + [m for k in self.klds for m in (k.reference, *k.models)]:
            if self.artifacts and name not in self.artifacts:
                raise ValueError(f"artifact {name!r} is not listed under artifacts")
        for kind, names in (("bench", [b.name for b in self.benches]), ("eval", [e.name for e in self.evals]),
                            ("drafting", [d.name for d in self.drafting]),
                            ("load", [load.name for load in self.loads]), ("kld", [k.name for k in self.klds]),
                            ("upgrade", [u.name for u in self.upgrades])):
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"{kind} names must be unique: {', '.join(duplicates)}")
        return self

    def label(self, artifact: str) -> str:
        info = self.artifacts.get(artifact)
        return info.label if info else artifact

    def margin(self, comparison: CampaignComparison) -> float | None:
        """The comparison's equivalence margin in points (its own, else the campaign's)."""
        return comparison.equivalence_margin if comparison.equivalence_margin is not None \
            else self.equivalence_margin

    def target_label(self, target_id: str) -> str:
        base, _, replicate = target_id.partition("#")
        artifact, _, host = base.partition("@")
        hosts_of = {t.host for e in self.evals for t in e.runs if t.artifact == artifact}
        return self.label(artifact) + (f" ({host})" if len(hosts_of) > 1 else "") + \
            (f" replicate {replicate}" if replicate else "")


@dataclass(frozen=True)
class LoadedCampaign:
    campaign: Campaign
    path: Path

    def text_path(self, kld: CampaignKld) -> Path:
        """A KLD step's text: relative paths are the campaign file's."""
        return kld.text if kld.text.is_absolute() else (self.path.parent / kld.text).resolve()

    def task_ref(self, evaluation: CampaignEval) -> str:
        """A task file relative to the campaign file when it is there, else the ref as given (a shipped name)."""
        beside = (self.path.parent / evaluation.task).resolve()
        return str(beside) if beside.is_file() else evaluation.task


def load_campaign(path: Path) -> LoadedCampaign:
    data = read_mapping(path, "campaign")
    try:
        loaded = LoadedCampaign(Campaign.model_validate(data), path)
    except ValidationError as exc:
        raise ConfigError(error_line(exc, f"campaign {path}", whole="campaign")) from None
    # An excluded set that no task has would leave the suite whole, silently.
    check_task_sets(loaded.campaign.sensitivity.exclude, [loaded.task_ref(e) for e in loaded.campaign.evals],
                    f"campaign {path}: sensitivity.exclude")
    return loaded


# ----------------------------------------------------------------------------------------------- locate


def _artifact_names(run: StoredRun) -> set[str]:
    return {a.name for a in run.record.artifacts if a.name}


def bench_matches(run: StoredRun, bench: CampaignBench, host: str) -> bool:
    record = run.record
    if record.kind != "bench" or run.host != host or record.status != "done":
        return False
    matrix = record.matrix or {}  # a list flag a record predates (b, ub) ran at llama-bench's default: []
    return _artifact_names(run) == set(bench.models) and all(
        matrix.get(k, []) == v for k, v in bench.matrix.flags().items())


def drafting_matches(run: StoredRun, race: CampaignDrafting) -> bool:
    record = run.record
    if record.kind != "spec" or run.host != race.host or record.status != "done":
        return False
    names = {str(s.name) for s in record.servers}
    extra = record.extra
    return (extra.get("baseline") == race.baseline and set(race.drafters) <= names
            and extra.get("repeats") == race.repeats and extra.get("max_tokens") == race.max_tokens
            and extra.get("temperatures") == race.temperatures)


def load_matches(run: StoredRun, load: CampaignLoad) -> bool:
    record = run.record
    if record.kind != "load" or run.host != load.host or record.status != "done":
        return False
    server, extra = record.server, record.extra
    return (server is not None and server.name == load.server and extra.get("slot_ctx") == load.slot_ctx
            and extra.get("levels") == load.concurrency and extra.get("requests") == load.requests
            and extra.get("max_tokens") == load.max_tokens and extra.get("max_requests") == load.max_requests
            and extra.get("precision") == load.precision and extra.get("warmup") == load.warmup)


def kld_matches(run: StoredRun, kld: CampaignKld, host: str, corpus_sha256: str) -> bool:
    """A finished KLD run of the step's reference and models over its text, with its llama-perplexity settings."""
    record = run.record
    if record.kind != "kld" or run.host != host or record.status != "done":
        return False
    extra = record.extra.get("kld") or {}
    return (extra.get("reference") == kld.reference and list(extra.get("models") or []) == kld.models
            and (extra.get("corpus") or {}).get("sha256") == corpus_sha256
            and all(extra.get(k) == getattr(kld, k) for k in ("ctx", "chunks", "batch")))


def run_servers(run: StoredRun) -> set[tuple[str, str]]:
    """(host, server) of every server that answered an eval run (several for a fan-out)."""
    return {(str(s.host or run.host), str(s.name)) for s in run.record.servers}


def eval_matches(run: StoredRun, task_name: str, target: EvalTarget) -> bool:
    record = run.record
    if record.kind != "eval" or run.host != target.host or record.task is None or record.task.name != task_name:
        return False
    if target.fanout or len(record.servers) > 1:
        wanted = {(s.host, s.server) for s in target.members}
        return run_servers(run) == wanted and target.artifact in _artifact_names(run)
    return target.artifact in _artifact_names(run) or (
        record.server is not None and record.server.name == target.server)


@dataclass
class Located:
    """The newest pulled run for each bench (per host) and eval target; None where nothing is pulled."""

    benches: dict[tuple[str, str], StoredRun | None] = field(default_factory=dict)  # (bench, host)
    evals: dict[tuple[str, str], StoredRun | None] = field(default_factory=dict)  # (eval, target id)
    drafting: dict[str, StoredRun | None] = field(default_factory=dict)  # drafting name -> spec run
    loads: dict[str, StoredRun | None] = field(default_factory=dict)  # load name -> load run
    upgrades: dict[str, StoredRun | None] = field(default_factory=dict)  # upgrade name -> its record
    klds: dict[tuple[str, str], StoredRun | None] = field(default_factory=dict)  # (kld step, host)
    unfinished: dict[tuple[str, str], StoredRun] = field(default_factory=dict)  # eval runs to resume
    task_names: dict[str, str] = field(default_factory=dict)  # eval name -> task name

    def runs(self) -> list[StoredRun]:
        return [r for r in [*self.benches.values(), *self.evals.values(), *self.drafting.values(),
                            *self.loads.values(), *self.klds.values(), *self.upgrades.values()] if r is not None]


def upgrade_tag(campaign: Campaign, step: CampaignUpgrade) -> str:
    """What an upgrade step's record carries (``extra.campaign``) to be found again."""
    return f"{campaign.name}/{step.name}"


def task_name(loaded: LoadedCampaign, evaluation: CampaignEval) -> str:
    return load_task(loaded.task_ref(evaluation), fetch=False).name


def locate(loaded: LoadedCampaign, store: ResultsStore) -> Located:
    campaign = loaded.campaign
    # Only the campaign's hosts' runs can answer its steps (every match checks the host).
    runs = [run for host in dict.fromkeys(campaign.hosts) for run in store.runs(host)]
    found = Located()

    def newest(matches: Callable[[StoredRun], bool]) -> StoredRun | None:
        return max((r for r in runs if matches(r)), key=lambda r: r.record.started, default=None)

    for bench in campaign.benches:
        for host in bench.hosts:
            found.benches[(bench.name, host)] = newest(lambda r, b=bench, h=host: bench_matches(r, b, h))
    for load in campaign.loads:
        found.loads[load.name] = newest(functools.partial(load_matches, load=load))
    for race in campaign.drafting:
        found.drafting[race.name] = newest(functools.partial(drafting_matches, race=race))
    for kld in campaign.klds:
        corpus = corpus_identity(loaded.text_path(kld))["sha256"]
        for host in kld.hosts:
            found.klds[(kld.name, host)] = newest(functools.partial(kld_matches, kld=kld, host=host,
                                                                    corpus_sha256=corpus))
    for step in campaign.upgrades:
        tag = upgrade_tag(campaign, step)
        found.upgrades[step.name] = newest(lambda r, t=tag: r.record.kind == "upgrade" and r.record.status == "done"
                                           and r.record.extra.get("campaign") == t)
    for evaluation in campaign.evals:
        name = task_name(loaded, evaluation)
        found.task_names[evaluation.name] = name
        # Replicates of one target share its runs: the newest finished run answers the first, the next
        # newest the second, and so on; a stopped run is resumed for the first one still without a run.
        groups: dict[str, list[EvalTarget]] = {}
        for target in evaluation.runs:
            groups.setdefault(target.base_id, []).append(target)
        for targets in groups.values():
            matching = [r for r in runs if eval_matches(r, name, targets[0])]
            done = sorted((r for r in matching if r.record.status == "done"), key=lambda r: r.record.started,
                          reverse=True)
            stopped = sorted((r for r in matching if r.record.status in ("stopped", "failed", "lost")),
                             key=lambda r: r.record.started, reverse=True)
            for index, target in enumerate(sorted(targets, key=lambda t: t.replicate)):
                key = (evaluation.name, target.id)
                found.evals[key] = done[index] if index < len(done) else None
                if index == len(done) and stopped:
                    found.unfinished[key] = stopped[0]
    return found


# ----------------------------------------------------------------------------------------------- run


@dataclass(frozen=True)
class StepOutcome:
    step: str  # "bench speed on desktop", "eval suite smollm2-135m-q4_1@desktop"
    status: Literal["pulled", "ran", "resumed", "failed", "refused", "skipped"]  # skipped: its host is drained
    run: str | None = None  # host/run id
    error: str | None = None


OnStep = Callable[[str], None]


@dataclass(frozen=True)
class _Context:
    loaded: LoadedCampaign
    inventory: Inventory
    store: ResultsStore
    found: Located
    on_step: OnStep


@dataclass(frozen=True)
class _Step:
    """One thing the campaign asks for: the pulled run that answers it, else how to run it (``host/run id``)."""

    name: str
    found: StoredRun | None
    run: Callable[[], str]
    resumes: bool = False  # running it continues a stopped run
    #: The error by which running it declines rather than fails (outcome "refused", the record in its ``run``).
    refusal: type[RigctlError] | None = None


def _bench_steps(ctx: _Context) -> Iterator[_Step]:
    for bench in ctx.loaded.campaign.benches:
        for host in bench.hosts:
            yield _Step(f"bench {bench.name} on {host}", ctx.found.benches[(bench.name, host)],
                        functools.partial(_run_bench, ctx, bench, host))


def _load_steps(ctx: _Context) -> Iterator[_Step]:
    from rigctl.bench.load import run_load

    for load in ctx.loaded.campaign.loads:
        def run(load: CampaignLoad = load) -> str:
            ctx.on_step(f"load {load.name} on {load.host}: {load.server} at concurrency "
                        f"{','.join(map(str, load.concurrency))}")
            result = run_load(ctx.inventory.host(load.host), load.server, concurrency=load.concurrency,
                              requests=load.requests, max_requests=load.max_requests, precision=load.precision,
                              warmup=load.warmup, max_tokens=load.max_tokens, slot_ctx=load.slot_ctx,
                              level_timeout_s=load.level_timeout_s, store=ctx.store,
                              on_step=lambda m: ctx.on_step(f"load {load.name}: {m}"))
            return result.ref

        yield _Step(f"load {load.name} on {load.host}", ctx.found.loads[load.name], run)


def _eval_steps(ctx: _Context) -> Iterator[_Step]:
    for evaluation in ctx.loaded.campaign.evals:
        for target in evaluation.runs:
            key = (evaluation.name, target.id)
            unfinished = ctx.found.unfinished.get(key)
            yield _Step(f"eval {evaluation.name} {target.id}", ctx.found.evals[key],
                        functools.partial(_run_eval, ctx, evaluation, target, unfinished), resumes=bool(unfinished))


def _drafting_steps(ctx: _Context) -> Iterator[_Step]:
    from rigctl.bench.drafting import run_race

    for race in ctx.loaded.campaign.drafting:
        def run(race: CampaignDrafting = race) -> str:
            ctx.on_step(f"drafting {race.name} on {race.host}: {race.baseline} against "
                        f"{', '.join(race.drafters) or 'its drafting instances'}")
            result = run_race(ctx.inventory.host(race.host), race.baseline, race.drafters or None,
                              repeats=race.repeats, max_tokens=race.max_tokens, temperatures=race.temperatures,
                              store=ctx.store)
            return result.ref

        yield _Step(f"drafting {race.name} on {race.host}", ctx.found.drafting[race.name], run)


def _upgrade_steps(ctx: _Context) -> Iterator[_Step]:
    from rigctl.upgrade.upgrade import UpgradeRefused, upgrade

    campaign = ctx.loaded.campaign
    for step in campaign.upgrades:
        def run(step: CampaignUpgrade = step) -> str:
            gates = (ctx.loaded.path.parent / step.gates) if step.gates else None
            result = upgrade(ctx.inventory, step.to, canary=step.canary, gates_file=gates, cmake_options=step.cmake,
                             store=ctx.store, say=lambda m: ctx.on_step(f"upgrade {step.name}: {m}"),
                             tag=upgrade_tag(campaign, step))
            return result.run

        yield _Step(f"upgrade {step.name} to {step.to} (canary {step.canary})", ctx.found.upgrades[step.name], run,
                    refusal=UpgradeRefused)


def _kld_steps(ctx: _Context) -> Iterator[_Step]:
    for kld in ctx.loaded.campaign.klds:
        for host in kld.hosts:
            yield _Step(f"kld {kld.name} on {host}", ctx.found.klds[(kld.name, host)],
                        functools.partial(_run_kld, ctx, kld, host))


#: What a campaign runs, kind by kind, in this order: each kind's steps (a new kind is one more entry).
STEP_KINDS: dict[str, Callable[[_Context], Iterator[_Step]]] = {
    "bench": _bench_steps, "load": _load_steps, "eval": _eval_steps, "upgrade": _upgrade_steps,
    "drafting": _drafting_steps, "kld": _kld_steps}


def _run_job(ctx: _Context, step: str, host_name: str, spec_for: Callable[[Host], jobs.JobSpec]) -> str:
    """A step that is a job on a host (a bench, a KLD): started, or followed where a campaign run stopped
    earlier left it running, to its end; then the host pulled."""
    from rigctl import jobs

    host = ctx.inventory.host(host_name)
    try:
        info = jobs.start(host, spec_for(host))
        ctx.on_step(f"{step}: started job {info.id}")
        job_id = info.id
    except JobBusyError as exc:
        ctx.on_step(f"{step}: following running job {exc.running}")
        job_id = exc.running
    final = jobs.wait(host, job_id, on_progress=lambda i: ctx.on_step(i.describe()))
    if final.state != "done":
        raise RigctlError(f"{final.kind} job {job_id} on {host_name} ended {final.state}" +
                          (f": {final.error}" if final.error else ""))
    for line in jobs.pull(host, ctx.store).refused:
        ctx.on_step(line)
    return f"{host_name}/{job_id}"


def _run_bench(ctx: _Context, bench: CampaignBench, host_name: str) -> str:
    from rigctl.bench.matrix import bench_job_spec

    return _run_job(ctx, f"bench {bench.name} on {host_name}", host_name,
                    lambda host: bench_job_spec(host, bench.spec(host_name)))


def _run_kld(ctx: _Context, kld: CampaignKld, host_name: str) -> str:
    from rigctl.evals.kld import kld_job_spec

    return _run_job(ctx, f"kld {kld.name} on {host_name}", host_name,
                    lambda host: kld_job_spec(host, kld.spec(host_name, ctx.loaded.text_path(kld))))


def _run_eval(ctx: _Context, evaluation: CampaignEval, target: EvalTarget, unfinished: StoredRun | None) -> str:
    """The eval's servers started where they are down (and stopped after), then the stopped run resumed or a
    new one started, as ``rigctl eval run`` does (:func:`rigctl.evals.runner.start`)."""
    from rigctl.evals import runner
    from rigctl.evals.target import inventory_targets
    from rigctl.fleet import servers

    members = target.members
    with ExitStack() as up:
        for host_name in target.hosts:
            names = [m.server for m in members if m.host == host_name]
            up.enter_context(servers.running(ctx.inventory.host(host_name), names, on_step=ctx.on_step))
        endpoints = [t.endpoint for t in inventory_targets([(ctx.inventory.host(m.host), m.server) for m in members],
                                                           facts=False)]
        if unfinished is not None:
            run, task, options = runner.resume_run(ctx.store, f"{unfinished.host}/{unfinished.id}", endpoints)
        else:
            task = load_task(ctx.loaded.task_ref(evaluation), limit=evaluation.limit)
            targets = inventory_targets([(ctx.inventory.host(m.host), m.server) for m in members])
            # Sized to ride through a restart of its slowest server, as `eval run` does.
            options = runner.Options(concurrency=evaluation.concurrency, seed=ctx.loaded.campaign.seed,
                                     retry=runner.retry_for(targets))
            run = runner.start(task, targets, ctx.store, options=options, limit=evaluation.limit,
                               artifact=target.artifact, extra={"campaign": ctx.loaded.campaign.name})
        ctx.on_step(f"eval {evaluation.name} {target.id}: run {run.record.id} ({len(task.questions)} questions)")
        runner.run(task, endpoints, run, options)
    return run.ref


def run_campaign(loaded: LoadedCampaign, inventory: Inventory, store: ResultsStore, *,
                 on_step: OnStep = lambda _: None) -> list[StepOutcome]:
    """Pull every host, then run each bench, load, eval, upgrade, race and KLD it lacks: per step, the outcome.
    A failed step is reported and the others go on (their results are kept); running again picks up only what
    is missing, and resumes eval runs that stopped part-way. One SSH connection per host for the whole run."""
    from rigctl import jobs
    from rigctl.connections import connections

    check_upgrade_gates(loaded, inventory)
    with connections():
        for name in loaded.campaign.hosts:
            try:
                for line in jobs.pull(inventory.host(name), store).refused:
                    on_step(line)
            except RigctlError as exc:
                on_step(f"{name}: pull failed: {exc}")
        serving = cast(Inventory, InService(inventory, "a campaign"))
        ctx = _Context(loaded, serving, store, locate(loaded, store), on_step)
        outcomes: list[StepOutcome] = []
        for steps in STEP_KINDS.values():
            for step in steps(ctx):
                if step.found is not None:
                    outcomes.append(StepOutcome(step.name, "pulled", f"{step.found.host}/{step.found.id}"))
                    continue
                try:
                    outcomes.append(StepOutcome(step.name, "resumed" if step.resumes else "ran", step.run()))
                except DrainedError as exc:
                    outcomes.append(StepOutcome(step.name, "skipped", error=str(exc)))
                except RigctlError as exc:
                    if step.refusal is not None and isinstance(exc, step.refusal):
                        outcomes.append(StepOutcome(step.name, "refused", getattr(exc, "run", None), error=str(exc)))
                    else:
                        outcomes.append(StepOutcome(step.name, "failed", error=str(exc)))
        return outcomes


def check_upgrade_gates(loaded: LoadedCampaign, inventory: Inventory) -> None:
    """Every upgrade step's gates checked as `build upgrade` checks them, before anything is pulled or run: a bad
    gates file of a late step must not let the earlier steps build first. ConfigError naming file, step, key."""
    from rigctl.upgrade import gates as g
    for step in loaded.campaign.upgrades:
        canary = inventory.host(step.canary)
        file = (loaded.path.parent / step.gates) if step.gates else None
        try:
            gates = g.load_gates(canary.vars.get(g.GATES_VAR), f"host {canary.name}", file)
            g.check_gates(gates, canary, f"--gates {file}" if file else f"host {canary.name}: {g.GATES_VAR}")
        except ConfigError as exc:
            raise ConfigError(f"{loaded.path}: upgrades {step.name}: {exc}") from None


def describe(outcomes: list[StepOutcome]) -> list[str]:
    return [f"{o.step}: {o.status}" + (f" {o.run}" if o.run else "") + (f": {o.error}" if o.error else "")
            for o in outcomes]
