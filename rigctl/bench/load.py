"""`rigctl bench load HOST SERVER --concurrency 1,2,4,8`: a load curve through a llama-server probe.

The instance is stopped and a probe server with its own arguments file but ``--parallel N`` (N the
highest concurrency level, so every client has a slot), ``-c N x slot_ctx`` and a spare port runs
as a transient unit (the way ``rigctl bench server`` starts its probes); the instance is started
again after. One unrecorded request warms the probe up. Then, per level ``c``, ``c`` clients send
streamed chat requests back to back (the shipped prompts of ``rigctl/bench/data/spec_prompts.yaml``
in turn, greedy, ``max_tokens`` each with end-of-sequence ignored, prompt cache off) until the
level has sent ``requests`` of them or ``level_timeout_s`` has passed: bounded in count and time.

Per level (:func:`summarize_level`): aggregate output tokens/s (every reply's tokens over the
level's wall time), requests/s, time to first token and time per output token (the stream's gap
from the first token to the last, over the tokens after the first) at p50/p95/p99, and errors.

A ``load`` run in the results store::

    run.json        the run record (server: instance, probe arguments, build; extra: the levels asked)
    requests.jsonl  one line per request: level, index, prompt, ok, error, ttft_s, wall_s, tokens,
                    tpot_s, decode_per_s (the server's own timing), started_s (into the level)
    levels.jsonl    one line per level: the :class:`LevelSummary`

:func:`compare_load` sets two runs side by side level by level: B / A of output t/s, mean TTFT and
mean TPOT, each with a bootstrap interval over the requests.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rigctl.errors import ConfigError, RigctlError
from rigctl.results.store import ResultsStore, StoredRun, read_rows
from rigctl.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, Interval, bootstrap_rate_ratio, bootstrap_ratio

log = logging.getLogger(__name__)

REQUESTS_FILE = "requests.jsonl"
LEVELS_FILE = "levels.jsonl"
PERCENTILES = (50, 95, 99)
MAX_CONCURRENCY = 64
MAX_REQUESTS = 1000
PROBE_PURPOSE = "load"


@dataclass(frozen=True)
class LoadRequest:
    level: int
    index: int
    prompt: str
    ok: bool
    error: str | None
    ttft_s: float | None
    wall_s: float
    tokens: int
    tpot_s: float | None
    decode_per_s: float | None
    started_s: float


@dataclass(frozen=True)
class LevelSummary:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    output_tps: float
    requests_per_s: float
    ttft_s: dict[str, float | None]  # "p50", "p95", "p99"
    tpot_s: dict[str, float | None]


@dataclass
class LoadResult:
    host: str
    instance: str
    levels: list[LevelSummary] = field(default_factory=list)
    requests: list[LoadRequest] = field(default_factory=list)
    run_dir: Path | None = None


def parse_levels(values: Sequence[int]) -> list[int]:
    """Concurrency levels, checked: whole numbers 1..64, each once, in the order given."""
    if not values:
        raise ConfigError("--concurrency: give at least one level, e.g. 1,2,4,8")
    for value in values:
        if not 1 <= value <= MAX_CONCURRENCY:
            raise ConfigError(f"--concurrency: {value} is outside 1..{MAX_CONCURRENCY}")
    if len(set(values)) != len(values):
        raise ConfigError(f"--concurrency: a level is given twice in {','.join(map(str, values))}")
    return list(values)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}


def summarize_level(concurrency: int, requests: Sequence[LoadRequest], wall_s: float) -> LevelSummary:
    """One level's aggregate figures (pure)."""
    ok = [r for r in requests if r.ok]
    tokens = sum(r.tokens for r in ok)
    return LevelSummary(
        concurrency=concurrency, requests=len(requests), errors=len(requests) - len(ok), wall_s=wall_s,
        output_tps=tokens / wall_s if wall_s > 0 else math.nan,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else math.nan,
        ttft_s=percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_s=percentiles([r.tpot_s for r in ok if r.tpot_s is not None]))


def shipped_prompts() -> list[tuple[str, list[dict[str, str]]]]:
    from rigctl.bench.drafting import load_prompts

    return list(load_prompts().items())


def _one_request(client: Any, level: int, index: int, prompt: tuple[str, list[dict[str, str]]], max_tokens: int,
                 level_start: float) -> LoadRequest:
    from rigctl.errors import ServerError

    kind, messages = prompt
    began = time.monotonic()
    try:
        reply = client.chat_stream(messages, max_tokens=max_tokens,
                                   extra={"cache_prompt": False, "ignore_eos": True})
    except ServerError as exc:
        return LoadRequest(level, index, kind, False, str(exc), None, time.monotonic() - began, 0, None, None,
                           began - level_start)
    wall = reply.wall_s if reply.wall_s is not None else time.monotonic() - began
    tokens = reply.timings.predicted_n if reply.timings else 0
    tpot = (wall - reply.ttft_s) / (tokens - 1) if reply.ttft_s is not None and tokens > 1 else None
    decode = reply.timings.predicted_per_second if reply.timings else None
    return LoadRequest(level, index, kind, True, None, reply.ttft_s, wall, tokens, tpot, decode, began - level_start)


def drive_level(endpoint: Any, concurrency: int, requests: int, max_tokens: int, timeout_s: float,
                prompts: Sequence[tuple[str, list[dict[str, str]]]]) -> tuple[list[LoadRequest], float]:
    """``concurrency`` clients sending back to back until ``requests`` are sent or ``timeout_s`` passed;
    the requests (in the order they were taken) and the level's wall time."""
    from rigctl.llama_http import ServerClient, Timeouts

    lock = threading.Lock()
    taken = [0]
    done: list[LoadRequest] = []
    start = time.monotonic()
    deadline = start + timeout_s

    def client_loop() -> None:
        with ServerClient(endpoint, timeouts=Timeouts(read=max(30.0, timeout_s))) as client:
            while True:
                with lock:
                    if taken[0] >= requests or time.monotonic() >= deadline:
                        return
                    index = taken[0]
                    taken[0] += 1
                result = _one_request(client, concurrency, index, prompts[index % len(prompts)], max_tokens, start)
                with lock:
                    done.append(result)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="rigctl-load") as pool:
        for future in [pool.submit(client_loop) for _ in range(concurrency)]:
            future.result()
    return sorted(done, key=lambda r: r.index), time.monotonic() - start


def run_load(
    host: Any,
    instance: str,
    *,
    concurrency: Sequence[int] = (1, 2, 4, 8),
    requests: int | None = None,
    max_tokens: int = 32,
    slot_ctx: int = 1024,
    level_timeout_s: float = 120.0,
    probe_port: int | None = None,
    store: ResultsStore | None = None,
    on_step: Callable[[str], None] | None = None,
) -> LoadResult:
    """The load curve of ``instance`` on ``host`` through a probe with a slot per client; saved to ``store``.
    ``requests``: per level (default four per client, at least 8)."""
    from rigctl.fleet.servers import probe_server, probe_unit, stopped
    from rigctl.llama_http import ServerClient
    from rigctl.results.run import open_run
    from rigctl.results.stamp import inventory_server, inventory_stamp, with_props
    from rigctl.ssh import session

    levels = parse_levels(list(concurrency))
    if requests is not None and not 1 <= requests <= MAX_REQUESTS:
        raise ConfigError(f"--requests: {requests} is outside 1..{MAX_REQUESTS}")
    if not 1 <= max_tokens <= 4096:
        raise ConfigError(f"--max-tokens: {max_tokens} is outside 1..4096")
    if slot_ctx < 64:
        raise ConfigError(f"--slot-ctx: {slot_ctx} is too small (at least 64 tokens)")
    if level_timeout_s <= 0:
        raise ConfigError("--level-timeout: must be positive")
    served = host.server(instance)
    say = on_step or (lambda message: None)
    slots = max(levels)
    prompts = shipped_prompts()
    result = LoadResult(host=host.name, instance=instance)
    port = probe_port or served.port + 200
    settings = {"parallel": slots, "ctx_size": slots * slot_ctx}
    # The probe serves the requests: its argv as it runs is the record's, not the instance's file.
    stamp = inventory_stamp(host, [inventory_server(host, instance, unit=probe_unit(served, PROBE_PURPOSE),
                                                    port=port)],
                            artifacts=[served.artifact], concurrency=slots)
    extra = {"slots": slots, "slot_ctx": slot_ctx, "levels": levels, "requests": requests, "max_tokens": max_tokens,
             "level_timeout_s": level_timeout_s, "prompts": [kind for kind, _ in prompts]}
    with open_run("load", stamp, store or ResultsStore(), extra=extra) as run, session(host) as ssh, \
            stopped(ssh, served), probe_server(ssh, served, settings, port, PROBE_PURPOSE) as probe:
        result.run_dir = run.path
        with ServerClient(probe.endpoint) as client:
            props = client.props()
        run.complete_stamp(ssh)
        with_props(run.record.servers[0], props, probe.endpoint)
        run.save()
        say(f"probe {probe.unit} on port {port}: {slots} slots of {slot_ctx} tokens")
        drive_level(probe.endpoint, 1, 1, max_tokens, level_timeout_s, prompts)  # warm-up, not recorded
        try:
            for level in levels:
                count = requests or max(8, 4 * level)
                done, wall = drive_level(probe.endpoint, level, count, max_tokens, level_timeout_s, prompts)
                summary = summarize_level(level, done, wall)
                result.requests += done
                result.levels.append(summary)
                say(f"concurrency {level}: {summary.requests} requests in {wall:.2f} s, {summary.output_tps:.2f} "
                    f"output t/s, TTFT p50 {_ms(summary.ttft_s['p50'])}, TPOT p50 {_ms(summary.tpot_s['p50'])}, "
                    f"{summary.errors} errors")
        finally:  # the levels measured before a failure stay with the failed run
            run.write_jsonl(REQUESTS_FILE, map(asdict, result.requests))
            run.write_jsonl(LEVELS_FILE, map(asdict, result.levels))
    return result


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


# ----------------------------------------------------------------------------------------------- stored runs


def load_requests(run: StoredRun) -> list[LoadRequest]:
    return read_rows(run, "load", REQUESTS_FILE, LoadRequest)


def load_levels(run: StoredRun) -> list[LevelSummary]:
    return read_rows(run, "load", LEVELS_FILE, LevelSummary)


@dataclass(frozen=True)
class LevelComparison:
    concurrency: int
    a: LevelSummary
    b: LevelSummary
    output_tps: Interval  # B / A, as concurrency x tokens / request time
    ttft: Interval  # mean TTFT, B / A
    tpot: Interval  # mean TPOT, B / A


def compare_load(run_a: StoredRun, run_b: StoredRun, *, resamples: int = DEFAULT_RESAMPLES,
                 seed: int = DEFAULT_SEED) -> list[LevelComparison]:
    """Level by level (the levels both runs have): B / A with bootstrap intervals over the requests. Output
    t/s compares as concurrency x tokens / request time (Little's law for a closed loop: what the level's
    throughput is while every client is busy), so it can be resampled by request."""
    levels_a = {s.concurrency: s for s in load_levels(run_a)}
    levels_b = {s.concurrency: s for s in load_levels(run_b)}
    req_a, req_b = load_requests(run_a), load_requests(run_b)
    common = [c for c in levels_a if c in levels_b]
    if not common:
        raise ConfigError(f"{run_a.host}/{run_a.id} and {run_b.host}/{run_b.id} share no concurrency level")
    out = []
    for c in common:
        a = [r for r in req_a if r.level == c and r.ok]
        b = [r for r in req_b if r.level == c and r.ok]
        out.append(LevelComparison(
            c, levels_a[c], levels_b[c],
            output_tps=bootstrap_rate_ratio(([r.tokens for r in a], [r.wall_s for r in a]),
                                            ([r.tokens for r in b], [r.wall_s for r in b]), resamples=resamples,
                                            seed=seed),
            ttft=bootstrap_ratio([r.ttft_s for r in a if r.ttft_s is not None],
                                 [r.ttft_s for r in b if r.ttft_s is not None], resamples=resamples, seed=seed),
            tpot=bootstrap_ratio([r.tpot_s for r in a if r.tpot_s is not None],
                                 [r.tpot_s for r in b if r.tpot_s is not None], resamples=resamples, seed=seed),
        ))
    return out


def to_markdown(levels: Sequence[LevelSummary], title: str) -> str:
    out = [f"### {title}", "", "| concurrency | requests | errors | output t/s | requests/s | TTFT p50/p95/p99 ms "
           "| TPOT p50/p95/p99 ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for s in levels:
        out.append(f"| {s.concurrency} | {s.requests} | {s.errors} | {s.output_tps:.2f} | {s.requests_per_s:.2f} | "
                   f"{_triple(s.ttft_s)} | {_triple(s.tpot_s)} |")
    return "\n".join(out) + "\n"


def _triple(values: dict[str, float | None]) -> str:
    return " / ".join("-" if values.get(f"p{p}") is None else f"{values[f'p{p}'] * 1000:.0f}" for p in PERCENTILES)


def to_png(curves: Sequence[tuple[str, Sequence[LevelSummary]]], path: Path, title: str) -> Path:
    """Output t/s and TPOT p50 against concurrency, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not curves:
        raise RigctlError("nothing to plot: no load levels")
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for label, levels in curves:
        xs = [s.concurrency for s in levels]
        left.plot(xs, [s.output_tps for s in levels], marker="o", label=label)
        right.plot(xs, [(s.tpot_s.get("p50") or math.nan) * 1000 for s in levels], marker="o", label=label)
    for ax, what in ((left, "output tokens/s"), (right, "TPOT p50, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
