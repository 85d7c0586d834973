"""`rigctl bench spec`: the drafter race, through the running llama-server instances of one host.

Six prompt kinds (``rigctl/bench/data/spec_prompts.yaml``: code, chat, story, explain, facts,
summary) are sent one request at a time to the baseline instance (no drafting) and to each
drafting instance of the same artifact, interleaved (prompt by prompt, contender by contender) so
that a slow minute hits every contender alike, ``repeats`` times, greedy and at temperature 0.8.
Per request it records the server's own timings (decode tokens/s = ``predicted_n`` /
``predicted_ms``) and drafting counts (``draft_n``, ``draft_n_accepted``); around the race it
reads each server's ``llamacpp:spec_decode_*`` counters. Per prompt and overall: tokens/s, the
speedup over the baseline (overall: the geometric mean of the per-prompt speedups), acceptance
(accepted / drafted) and, for greedy requests, whether the text is byte-identical to the
baseline's reply to the same prompt. The drafters serve the baseline's settings but ``spec`` (context, threads,
offload...): anything else would be in the speedup too, so a race of other contenders is refused.

Instances that are not running (drafting instances are often kept disabled) are started for the
race and stopped after, unless ``start=False`` (:func:`rigctl.fleet.servers.running`). The run is written to
the controller's results store as a ``spec`` run: ``requests.jsonl`` (one line per request: contender,
prompt, temperature, repeat, tokens, tokens_per_s, draft_n, draft_n_accepted, text, finish_reason), ``metrics.json``
(``llamacpp:spec_decode_*`` deltas per contender) and ``run.json``, made before the race starts
(:func:`rigctl.results.run.open_run`): a race that fails (a contender that will not start) is sealed
``failed`` with the reason.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from rigctl.errors import ConfigError
from rigctl.fleet.servers import running
from rigctl.forward import server_endpoint
from rigctl.inputs import parse_mapping, read_text
from rigctl.inventory import Host, Server
from rigctl.llama_http import ServerClient, Timeouts
from rigctl.results.run import RunResult, open_run
from rigctl.results.stamp import inventory_server, inventory_stamp, with_props
from rigctl.results.store import ResultsStore
from rigctl.ssh import session

log = logging.getLogger(__name__)

PROMPT_KINDS = ("code", "chat", "story", "explain", "facts", "summary")
REQUESTS_FILE = "requests.jsonl"
METRICS_FILE = "metrics.json"
SPEC_METRIC_PREFIX = "llamacpp:spec_decode_"
DEFAULT_TEMPERATURES = (0.0, 0.8)
DEFAULT_TIMEOUTS = Timeouts()


@dataclass(frozen=True)
class Contender:
    name: str  # llama_server instance
    artifact: str
    profile: str
    settings: Mapping[str, Any]  # the profile as this host serves it (extends chain and host overrides)
    port: int

    @classmethod
    def of(cls, server: Server) -> Contender:
        return cls(server.name, server.artifact, server.profile.name, dict(server.profile.settings), server.port)

    @property
    def spec(self) -> Mapping[str, Any] | None:
        """The profile's spec block (None: no drafting)."""
        return self.settings.get("spec") or None

    @property
    def drafting(self) -> bool:
        return self.spec is not None

    def describe(self) -> str:
        if not self.spec:
            return f"{self.name} (no drafting)"
        drafter = f" -md {self.spec['draft_model']}" if self.spec.get("draft_model") else ""
        return f"{self.name} ({self.spec['type']} n-max {self.spec.get('draft_n_max')}{drafter})"


@dataclass(frozen=True)
class RaceRequest:
    contender: str
    prompt: str
    temperature: float
    repeat: int
    tokens: int
    tokens_per_s: float
    wall_s: float
    draft_n: int
    draft_n_accepted: int
    text: str
    finish_reason: str


@dataclass(frozen=True)
class RaceRow:
    """One contender at one temperature, for one prompt kind or ``overall``."""

    contender: str
    temperature: float
    prompt: str
    requests: int
    tokens_per_s: float
    speedup: float | None  # None for the baseline itself
    acceptance: float | None  # accepted / drafted; None when nothing was drafted
    identical: tuple[int, int] | None  # greedy only: (byte-identical replies, compared replies)


@dataclass
class RaceResult(RunResult):
    baseline: str
    contenders: list[Contender]
    requests: list[RaceRequest]
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # contender -> spec_decode deltas
    rows: list[RaceRow] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- inputs


def load_prompts(path: Path | None = None, kinds: Sequence[str] | None = None) -> dict[str, list[dict[str, str]]]:
    """The race's prompts by kind (the shipped six unless ``path``), optionally only ``kinds``."""
    if path is None:
        text = resources.files("rigctl.bench").joinpath("data/spec_prompts.yaml").read_text()
        origin = "spec_prompts.yaml"
    else:
        text = read_text(path, "prompts")
        origin = str(path)
    expected = "expected a mapping of prompt kind to a list of chat messages"
    data = parse_mapping(text, f"prompts {origin}", expected=expected, empty=True)
    if not all(isinstance(v, list) and v for v in data.values()):
        raise ConfigError(f"{origin}: expected a mapping of prompt kind to a list of chat messages")
    if kinds:
        unknown = [k for k in kinds if k not in data]
        if unknown:
            raise ConfigError(f"{origin}: no prompt kind {', '.join(unknown)} (kinds: {', '.join(data)})")
        data = {k: data[k] for k in kinds}
    return {str(k): list(v) for k, v in data.items()}


def contenders(host: Host, baseline: str, drafters: Sequence[str] | None = None) -> list[Contender]:
    """The baseline instance first, then the drafting instances (all of the baseline's artifact
    whose profile drafts, unless named)."""
    instances = {s.name: s for s in host.servers}

    def contender(name: str) -> Contender:
        return Contender.of(instances.get(name) or host.server(name))  # host.server: the error naming them

    base = contender(baseline)
    if base.drafting:
        raise ConfigError(f"host {host.name}: baseline {baseline!r} drafts (profile {base.profile}); "
                          "the baseline must not")
    if drafters:
        others = [contender(name) for name in drafters]
    else:
        others = [c for c in map(contender, sorted(instances)) if c.drafting and c.artifact == base.artifact]
    for other in others:
        if not other.drafting:
            raise ConfigError(f"host {host.name}: instance {other.name!r} does not draft (profile {other.profile})")
        if other.artifact != base.artifact:
            raise ConfigError(f"host {host.name}: drafter {other.name!r} serves {other.artifact}, "
                              f"the baseline {base.artifact}")
        # A race measures drafting alone: a drafter at another context (or thread count...) than its baseline
        # would put that difference into the speedup.
        differ = sorted(k for k in {*base.settings, *other.settings} - {"spec"}
                        if base.settings.get(k) != other.settings.get(k))
        if differ:
            key = differ[0]
            raise ConfigError(f"host {host.name}: drafter {other.name!r} (profile {other.profile}) serves with "
                              f"{key} {other.settings.get(key)!r}, the baseline {baseline!r} (profile "
                              f"{base.profile}) with {base.settings.get(key)!r}: a race's contenders may differ "
                              "only in spec")
    if not others:
        raise ConfigError(f"host {host.name}: no drafting instance of {base.artifact} to race against {baseline}")
    return [base, *others]


# ----------------------------------------------------------------------------------------------- analysis


def parse_request(contender: str, prompt: str, temperature: float, repeat: int, raw: Mapping[str, Any],
                  wall_s: float) -> RaceRequest:
    """One chat completion's JSON as a :class:`RaceRequest` (pure)."""
    timings = raw.get("timings") or {}
    choice = (raw.get("choices") or [{}])[0]
    tokens = int(timings.get("predicted_n", 0))
    predicted_ms = float(timings.get("predicted_ms", 0.0))
    return RaceRequest(
        contender=contender, prompt=prompt, temperature=temperature, repeat=repeat, tokens=tokens,
        tokens_per_s=1000.0 * tokens / predicted_ms if predicted_ms > 0 else 0.0, wall_s=wall_s,
        draft_n=int(timings.get("draft_n", 0)), draft_n_accepted=int(timings.get("draft_n_accepted", 0)),
        text=str((choice.get("message") or {}).get("content") or ""), finish_reason=str(choice.get("finish_reason")),
    )


def metric_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``llamacpp:spec_decode_*`` counters' growth between two scrapes (pure)."""
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after) if k.startswith(SPEC_METRIC_PREFIX)}


def geometric_mean(values: Iterable[float]) -> float:
    values = [v for v in values if v > 0]
    return float(np.exp(np.mean(np.log(values)))) if values else math.nan


def summarize_race(requests: Sequence[RaceRequest], baseline: str) -> list[RaceRow]:
    """Per contender and temperature: one row per prompt kind, then ``overall`` (pure)."""
    base_text = {(r.prompt, r.repeat): r.text for r in requests if r.contender == baseline and r.temperature == 0}
    order = list(dict.fromkeys(r.contender for r in requests))
    rows: list[RaceRow] = []
    for temperature in sorted({r.temperature for r in requests}):
        base_runs: dict[str, list[float]] = {}
        for r in requests:
            if r.contender == baseline and r.temperature == temperature:
                base_runs.setdefault(r.prompt, []).append(r.tokens_per_s)
        base_speed = {p: float(np.mean(v)) for p, v in base_runs.items()}
        for contender in order:
            mine = [r for r in requests if r.contender == contender and r.temperature == temperature]
            per_prompt = []
            for prompt in dict.fromkeys(r.prompt for r in mine):
                group = [r for r in mine if r.prompt == prompt]
                per_prompt.append(_row(contender, temperature, prompt, group, base_speed.get(prompt), baseline,
                                       base_text))
            rows += per_prompt
            overall = _row(contender, temperature, "overall", mine, None, baseline, base_text)
            speedups = [r.speedup for r in per_prompt if r.speedup is not None]
            rows.append(replace(overall, speedup=geometric_mean(speedups) if contender != baseline else None))
    return rows


def _row(contender: str, temperature: float, prompt: str, group: Sequence[RaceRequest], base: float | None,
         baseline: str, base_text: Mapping[tuple[str, int], str]) -> RaceRow:
    speed = float(np.mean([r.tokens_per_s for r in group])) if group else math.nan
    drafted = sum(r.draft_n for r in group)
    identical = None
    if temperature == 0 and contender != baseline:
        compared = [r for r in group if (r.prompt, r.repeat) in base_text]
        identical = (sum(r.text == base_text[(r.prompt, r.repeat)] for r in compared), len(compared))
    return RaceRow(
        contender=contender, temperature=temperature, prompt=prompt, requests=len(group), tokens_per_s=speed,
        speedup=speed / base if base and contender != baseline else None,
        acceptance=sum(r.draft_n_accepted for r in group) / drafted if drafted else None, identical=identical,
    )


def to_markdown(rows: Sequence[RaceRow]) -> str:
    out = []
    for temperature in dict.fromkeys(r.temperature for r in rows):
        out += [f"### temperature {temperature:g}", "",
                "| contender | prompt | requests | tok/s | speedup | acceptance | identical to baseline |",
                "|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r.temperature == temperature):
            out.append(
                f"| {r.contender} | {r.prompt} | {r.requests} | {r.tokens_per_s:.2f} | "
                f"{'-' if r.speedup is None else f'{r.speedup:.3f}x'} | "
                f"{'-' if r.acceptance is None else f'{r.acceptance:.3f}'} | "
                f"{'-' if r.identical is None else f'{r.identical[0]}/{r.identical[1]}'} |")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- the race


def run_race(
    host: Host,
    baseline: str,
    drafters: Sequence[str] | None = None,
    *,
    kinds: Sequence[str] | None = None,
    prompts_file: Path | None = None,
    repeats: int = 3,
    temperatures: Sequence[float] = DEFAULT_TEMPERATURES,
    max_tokens: int = 256,
    seed: int = 1234,
    start: bool = True,
    store: ResultsStore | None = None,
    on_request: Callable[[RaceRequest], None] | None = None,
    timeouts: Timeouts = DEFAULT_TIMEOUTS,
) -> RaceResult:
    """Race ``baseline`` against its drafting instances on ``host``; the run is saved to ``store`` (sealed
    failed, with the reason, when a contender will not start or a request fails)."""
    if repeats < 1 or max_tokens < 1:
        raise ConfigError(f"repeats and max_tokens must be at least 1 (got {repeats}, {max_tokens})")
    field_ = contenders(host, baseline, drafters)
    prompts = load_prompts(prompts_file, kinds)
    names = [c.name for c in field_]
    # Before the run starts: a forward the host refuses is an error of its own, with nothing started.
    endpoints = {name: server_endpoint(host, host.server(name)) for name in names}
    result = RaceResult(host=host.name, baseline=baseline, contenders=field_, requests=[])
    stamp = inventory_stamp(host, [inventory_server(host, name) for name in names], artifacts=[field_[0].artifact],
                            seed=seed, concurrency=1)
    extra = {"baseline": baseline, "prompts": prompts, "repeats": repeats, "temperatures": list(temperatures),
             "max_tokens": max_tokens}
    with open_run("spec", stamp, store or ResultsStore(), extra=extra) as run:
        result.run_dir = run.path
        with running(host, names, start=start) as started, ExitStack() as clients_open:
            run.record.extra["started_instances"] = started
            clients = {name: clients_open.enter_context(ServerClient(endpoint, timeouts=timeouts))
                       for name, endpoint in endpoints.items()}
            with session(host) as ssh:  # while every contender runs: their argv as deployed
                run.complete_stamp(ssh)
            for server, c in zip(run.record.servers, field_, strict=True):
                with_props(server, clients[c.name].props(), clients[c.name].endpoint).draft = \
                    dict(c.spec) if c.spec else None
            run.save()
            before = {name: dict(client.metrics().samples) for name, client in clients.items()}
            try:
                for temperature in temperatures:
                    for repeat in range(1, repeats + 1):
                        for kind, messages in prompts.items():
                            for c in field_:
                                reply = clients[c.name].chat(messages, max_tokens=max_tokens,
                                                             temperature=temperature, seed=seed + repeat)
                                request = parse_request(c.name, kind, temperature, repeat, reply.raw,
                                                        reply.wall_s or 0.0)
                                result.requests.append(request)
                                if on_request:
                                    on_request(request)
                result.metrics = {name: metric_deltas(before[name], client.metrics().samples)
                                  for name, client in clients.items()}
            finally:  # the requests answered before a failure stay with the failed run
                run.write_jsonl(REQUESTS_FILE, map(asdict, result.requests))
                run.write_json(METRICS_FILE, result.metrics)
        result.rows = summarize_race(result.requests, baseline)
        run.record.extra["summary"] = [asdict(r) for r in result.rows]
    return result
