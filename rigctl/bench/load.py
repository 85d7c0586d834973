"""`rigctl bench load HOST SERVER --concurrency 1,2,4,8`: a load curve through a llama-server probe.

The instance is stopped and a probe server with its own arguments file but ``--parallel N`` (N the
highest concurrency level, so every client has a slot), ``-c N x slot_ctx`` and a spare port runs
as a transient unit (the way ``rigctl bench server`` starts its probes); the instance is started
again after. Per level ``c``, ``c`` clients send streamed chat requests back to back (the shipped
prompts of ``rigctl/bench/data/spec_prompts.yaml`` in turn, greedy, ``max_tokens`` each with
end-of-sequence ignored, prompt cache off):

- first ``warmup`` requests per client (default one), kept apart and out of every figure: a level's
  first requests meet cold slots and a batch size the server has not run yet;
- then at least ``requests`` (default four per client, at least 8) and more, up to ``max_requests``,
  until the 95 % intervals of the level's throughput and mean TPOT are each within ``precision``
  (default ±10 %) of their estimate, or ``level_timeout_s`` has passed: bounded in count and time, and
  whether the stated interval was reached is recorded (``precise``).

Per level (:func:`summarize_level`): aggregate output tokens/s (every reply's tokens over the
level's wall time), requests/s, time to first token and time per output token (the stream's gap
from the first token to the last, over the tokens after the first) at p50/p95/p99, errors, and the
intervals: throughput as Little's law has it for a closed loop (concurrency x tokens / request
seconds, resampled by request) and mean TPOT. Beside each level the machine's other load
(:class:`MachineLoad`): the host's load averages before and after the level and its CPUs' busy
share over it (``/proc/loadavg``, ``/proc/stat``; the probe's own work included), and the
controller's load average, so a curve bent by other work on the machine shows it.

:func:`interference` reads a curve for what physics does not allow: TPOT falling as concurrency rises,
or output t/s growing faster than the clients, each beyond the intervals; such a curve is flagged.

A ``load`` run in the results store::

    run.json        the run record (server: instance, probe arguments, build; extra: the levels asked)
    requests.jsonl  one line per measured request: level, index, prompt, ok, error, ttft_s, wall_s,
                    tokens, tpot_s, decode_per_s (the server's own timing), started_s (into the level),
                    decode_tokens (the token count that rate is over, as the build counts it)

A failure the server reports inside a 200 stream is that request's error (``ok`` false), never an empty
success. The record's ``extra.definitions`` states TTFT, TPOT and decode as :mod:`rigctl.llama_http.api`
defines them.
    warmup.jsonl    the warm-up requests, the same shape, in no figure
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

from rigctl.charts import new_figure, save_png
from rigctl.errors import ConfigError, RigctlError
from rigctl.llama_http.api import FIGURE_DEFINITIONS, tpot_s
from rigctl.results.run import RunResult, open_run
from rigctl.results.store import ResultsStore, StoredRun, read_rows
from rigctl.stats import (
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    Interval,
    bootstrap_mean,
    bootstrap_rate,
    bootstrap_rate_ratio,
    bootstrap_ratio,
)

log = logging.getLogger(__name__)

REQUESTS_FILE = "requests.jsonl"
WARMUP_FILE = "warmup.jsonl"
LEVELS_FILE = "levels.jsonl"
PERCENTILES = (50, 95, 99)
MAX_CONCURRENCY = 64
MAX_REQUESTS = 1000
PROBE_PURPOSE = "load"
DEFAULT_PRECISION = 0.10
#: Resamples of the check "is the interval narrow enough yet", made while a level runs; the recorded
#: intervals use the default count.
_CHECK_RESAMPLES = 1000
#: How far beyond the intervals a curve must bend before it is flagged: TPOT falling by more than this
#: share, throughput growing by more than this share over the clients' ratio.
INTERFERENCE_MARGIN = 0.10
_MACHINE_COMMAND = "cat /proc/loadavg && grep '^cpu' /proc/stat"


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
    decode_tokens: str | None = None  # the token count the server's decode rate is over (Timings.decode_tokens)


@dataclass(frozen=True)
class MachineLoad:
    """The machine's load around one level. ``loadavg_*``: the host's 1, 5 and 15 minute load averages
    before and after; ``busy``: the share of the host's CPU time busy over the level (the probe's own
    work included); ``cpus``: the host's CPUs as ``/proc/stat`` lists them; ``controller_loadavg``: the
    controller's before the level. None where a figure could not be read."""

    loadavg_before: list[float] | None = None
    loadavg_after: list[float] | None = None
    busy: float | None = None
    cpus: int | None = None
    controller_loadavg: list[float] | None = None


@dataclass(frozen=True)
class ProcSample:
    """One reading of a host's ``/proc/loadavg`` and ``/proc/stat`` CPU lines."""

    loadavg: list[float]
    busy_jiffies: int
    total_jiffies: int
    cpus: int


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
    # Runs recorded before warm-ups, intervals and the machine's load read these as absent.
    warmup: int = 0
    throughput: dict[str, Any] | None = None  # Interval.to_dict of concurrency x tokens / request seconds
    tpot_mean_s: dict[str, Any] | None = None  # Interval.to_dict of mean TPOT
    precision: float | None = None  # the relative half-width asked of both intervals
    precise: bool | None = None  # both intervals reached it
    machine: dict[str, Any] | None = None  # MachineLoad


@dataclass
class LoadResult(RunResult):
    instance: str
    levels: list[LevelSummary] = field(default_factory=list)
    requests: list[LoadRequest] = field(default_factory=list)


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


def level_intervals(concurrency: int, requests: Sequence[LoadRequest], *, resamples: int = DEFAULT_RESAMPLES,
                    seed: int = DEFAULT_SEED) -> tuple[Interval, Interval]:
    """The level's throughput (Little's law for a closed loop: concurrency x tokens / request seconds,
    resampled by request) and mean TPOT, each with its 95 % interval (pure)."""
    ok = [r for r in requests if r.ok]
    rate = bootstrap_rate([r.tokens for r in ok], [r.wall_s for r in ok], resamples=resamples, seed=seed)
    throughput = Interval(rate.estimate * concurrency, rate.low * concurrency, rate.high * concurrency, rate.n,
                          rate.resamples, rate.level, rate.method)
    tpot = bootstrap_mean([r.tpot_s for r in ok if r.tpot_s is not None], resamples=resamples, seed=seed)
    return throughput, tpot


def half_width(interval: Interval) -> float:
    """The interval's half-width over its estimate; infinite for an empty or zero estimate."""
    if interval.empty or not interval.estimate:
        return math.inf
    return (interval.high - interval.low) / 2 / abs(interval.estimate)


def is_precise(concurrency: int, requests: Sequence[LoadRequest], precision: float, *,
               resamples: int = DEFAULT_RESAMPLES) -> bool:
    """Both of the level's intervals within ``precision`` of their estimates (at least two replies each)."""
    if sum(1 for r in requests if r.ok and r.tpot_s is not None) < 2:
        return False
    return all(half_width(i) <= precision for i in level_intervals(concurrency, requests, resamples=resamples))


def summarize_level(concurrency: int, requests: Sequence[LoadRequest], wall_s: float, *, warmup: int = 0,
                    precision: float = DEFAULT_PRECISION, machine: MachineLoad | None = None) -> LevelSummary:
    """One level's aggregate figures (pure): ``requests`` are the measured ones, warm-ups excluded."""
    ok = [r for r in requests if r.ok]
    tokens = sum(r.tokens for r in ok)
    throughput, tpot = level_intervals(concurrency, requests)
    return LevelSummary(
        concurrency=concurrency, requests=len(requests), errors=len(requests) - len(ok), wall_s=wall_s,
        output_tps=tokens / wall_s if wall_s > 0 else math.nan,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else math.nan,
        ttft_s=percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_s=percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        warmup=warmup, throughput=throughput.to_dict(), tpot_mean_s=tpot.to_dict(), precision=precision,
        precise=len(ok) >= 2 and half_width(throughput) <= precision and half_width(tpot) <= precision,
        machine=asdict(machine) if machine else None)


def interference(levels: Sequence[LevelSummary], *, margin: float = INTERFERENCE_MARGIN) -> list[str]:
    """What a curve shows that more clients cannot cause, level against the next lower one (pure): mean
    TPOT falling by more than ``margin`` with the intervals apart, or output throughput growing more than
    ``margin`` beyond the clients' ratio with the intervals apart. Each is a sentence; none: a sound curve."""
    flags = []
    ordered = sorted((s for s in levels if s.throughput and s.tpot_mean_s), key=lambda s: s.concurrency)
    for low, high in zip(ordered, ordered[1:], strict=False):
        pair = f"concurrency {low.concurrency} -> {high.concurrency}"
        tpot_low, tpot_high = (s.tpot_mean_s or {} for s in (low, high))
        if _known(tpot_low, tpot_high) and tpot_high["estimate"] < (1 - margin) * tpot_low["estimate"] \
                and tpot_high["high"] < tpot_low["low"]:
            flags.append(f"{pair}: mean TPOT fell from {tpot_low['estimate'] * 1000:.1f} to "
                         f"{tpot_high['estimate'] * 1000:.1f} ms (more clients cannot make each token faster)")
        tps_low, tps_high = (s.throughput or {} for s in (low, high))
        clients = high.concurrency / low.concurrency
        if _known(tps_low, tps_high) and tps_low["estimate"] > 0 \
                and tps_high["estimate"] > (1 + margin) * clients * tps_low["estimate"] \
                and tps_high["low"] > clients * tps_low["high"]:
            flags.append(f"{pair}: throughput rose {tps_high['estimate'] / tps_low['estimate']:.2f}x for "
                         f"{clients:g}x the clients (superlinear)")
    return flags


def _known(*intervals: dict[str, Any]) -> bool:
    return all(i.get(k) is not None for i in intervals for k in ("estimate", "low", "high"))


def parse_proc_sample(text: str, origin: str) -> ProcSample:
    """``/proc/loadavg`` then the ``cpu`` lines of ``/proc/stat`` as a host sent them (pure): a
    RigctlError naming ``origin`` when they do not read as such."""
    lines = text.splitlines()
    try:
        loadavg = [float(x) for x in lines[0].split()[:3]]
        total = [int(x) for x in lines[1].split()[1:]]
        if lines[1].split()[0] != "cpu" or len(total) < 4 or len(loadavg) != 3:
            raise ValueError("not the aggregate cpu line")
    except (IndexError, ValueError) as exc:
        raise RigctlError(f"{origin}: /proc/loadavg and /proc/stat do not read as such ({exc})") from None
    idle = total[3] + (total[4] if len(total) > 4 else 0)  # idle and iowait
    cpus = sum(1 for line in lines[2:] if line.startswith("cpu") and line[3:4].isdigit())
    return ProcSample(loadavg=loadavg, busy_jiffies=sum(total) - idle, total_jiffies=sum(total), cpus=cpus)


def machine_load(before: ProcSample | None, after: ProcSample | None,
                 controller: list[float] | None) -> MachineLoad:
    """The level's :class:`MachineLoad` from two readings (pure)."""
    busy = None
    if before and after and after.total_jiffies > before.total_jiffies:
        busy = (after.busy_jiffies - before.busy_jiffies) / (after.total_jiffies - before.total_jiffies)
    return MachineLoad(loadavg_before=before.loadavg if before else None,
                       loadavg_after=after.loadavg if after else None, busy=busy,
                       cpus=(after or before).cpus if (after or before) else None, controller_loadavg=controller)


def read_proc_sample(ssh: Any) -> ProcSample | None:
    """The host's load now; None (logged) where it cannot be read: a curve without it is still a curve."""
    try:
        return parse_proc_sample(ssh.run(_MACHINE_COMMAND, timeout=15).stdout, f"{ssh.host}: machine load")
    except RigctlError as exc:
        log.warning("%s", exc)
        return None


def controller_loadavg() -> list[float] | None:
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


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
    tpot = tpot_s(reply.ttft_s, wall, tokens)
    decode = reply.timings.predicted_per_second if reply.timings else None
    return LoadRequest(level, index, kind, True, None, reply.ttft_s, wall, tokens, tpot, decode, began - level_start,
                       reply.timings.decode_tokens if reply.timings else None)


def drive_level(endpoint: Any, concurrency: int, requests: int, max_tokens: int, timeout_s: float,
                prompts: Sequence[tuple[str, list[dict[str, str]]]], *, enough: Callable[[list[LoadRequest]], bool]
                | None = None, max_requests: int | None = None, first_index: int = 0
                ) -> tuple[list[LoadRequest], float]:
    """``concurrency`` clients sending back to back until ``requests`` are sent or ``timeout_s`` passed; with
    ``enough``, on past ``requests`` up to ``max_requests`` until ``enough(done so far)`` holds (checked once
    a round of ``concurrency`` replies). The requests (in the order they were taken, numbered from
    ``first_index``) and the level's wall time."""
    from rigctl.llama_http import ServerClient, Timeouts

    lock = threading.Lock()
    taken = [0]
    stop = [False]
    done: list[LoadRequest] = []
    start = time.monotonic()
    deadline = start + timeout_s
    limit = max(requests, max_requests or requests) if enough else requests

    def client_loop() -> None:
        with ServerClient(endpoint, timeouts=Timeouts(read=max(30.0, timeout_s))) as client:
            while True:
                with lock:
                    if stop[0] or taken[0] >= limit or time.monotonic() >= deadline:
                        return
                    index = taken[0]
                    taken[0] += 1
                result = _one_request(client, concurrency, first_index + index, prompts[index % len(prompts)],
                                      max_tokens, start)
                with lock:
                    done.append(result)
                    if enough and len(done) >= requests and len(done) % concurrency == 0 and enough(list(done)):
                        stop[0] = True

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
    max_requests: int | None = None,
    precision: float = DEFAULT_PRECISION,
    warmup: int = 1,
    max_tokens: int = 32,
    slot_ctx: int = 1024,
    level_timeout_s: float = 120.0,
    probe_port: int | None = None,
    store: ResultsStore | None = None,
    on_step: Callable[[str], None] | None = None,
) -> LoadResult:
    """The load curve of ``instance`` on ``host`` through a probe with a slot per client; saved to ``store``.
    ``requests``: the least per level (default four per client, at least 8); more up to ``max_requests``
    (default four times that, within 1000) until both intervals are within ``precision``; ``warmup``
    requests per client before each level, in no figure."""
    from rigctl.fleet.servers import probe_server, probe_unit, stopped
    from rigctl.forward import server_endpoint
    from rigctl.llama_http import ServerClient
    from rigctl.results.stamp import inventory_server, inventory_stamp, with_props
    from rigctl.ssh import session

    levels = parse_levels(list(concurrency))
    if requests is not None and not 1 <= requests <= MAX_REQUESTS:
        raise ConfigError(f"--requests: {requests} is outside 1..{MAX_REQUESTS}")
    if max_requests is not None and not (requests or 1) <= max_requests <= MAX_REQUESTS:
        raise ConfigError(f"--max-requests: {max_requests} is outside {requests or 1}..{MAX_REQUESTS} "
                          "(at least --requests)")
    if not 0 < precision < 1:
        raise ConfigError(f"--precision: {precision} is outside (0, 1): a relative half-width, e.g. 0.1")
    if not 0 <= warmup <= 16:
        raise ConfigError(f"--warmup: {warmup} is outside 0..16 requests per client")
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
    server_endpoint(host, served, port=port)  # a forward the host refuses fails here, before the instance stops
    settings = {"parallel": slots, "ctx_size": slots * slot_ctx}
    # The probe serves the requests: its argv as it runs is the record's, not the instance's file.
    stamp = inventory_stamp(host, [inventory_server(host, instance, unit=probe_unit(served, PROBE_PURPOSE),
                                                    port=port)],
                            artifacts=[served.artifact], concurrency=slots)
    extra = {"slots": slots, "slot_ctx": slot_ctx, "levels": levels, "requests": requests,
             "max_requests": max_requests, "precision": precision, "warmup": warmup, "max_tokens": max_tokens,
             "level_timeout_s": level_timeout_s, "prompts": [kind for kind, _ in prompts],
             "definitions": FIGURE_DEFINITIONS}
    with open_run("load", stamp, store or ResultsStore(), extra=extra) as run, session(host) as ssh, \
            stopped(ssh, served), probe_server(ssh, served, settings, port, PROBE_PURPOSE) as probe:
        result.run_dir = run.path
        with ServerClient(probe.endpoint) as client:
            props = client.props()
        run.complete_stamp(ssh)
        with_props(run.record.servers[0], props, probe.endpoint)
        run.save()
        say(f"probe {probe.unit} on port {port}: {slots} slots of {slot_ctx} tokens")
        warmups: list[LoadRequest] = []
        try:
            for level in levels:
                least = requests or max(8, 4 * level)
                most = max_requests or min(MAX_REQUESTS, 4 * least)
                before, controller = read_proc_sample(ssh), controller_loadavg()
                warm, _ = drive_level(probe.endpoint, level, warmup * level, max_tokens, level_timeout_s, prompts)
                warmups += warm
                done, wall = drive_level(
                    probe.endpoint, level, least, max_tokens, level_timeout_s, prompts, max_requests=most,
                    first_index=len(warm),
                    enough=lambda sent, c=level: is_precise(c, sent, precision, resamples=_CHECK_RESAMPLES))
                machine = machine_load(before, read_proc_sample(ssh), controller)
                summary = summarize_level(level, done, wall, warmup=len(warm), precision=precision, machine=machine)
                result.requests += done
                result.levels.append(summary)
                say(f"concurrency {level}: {len(warm)} warm-up + {summary.requests} requests in {wall:.2f} s, "
                    f"{summary.output_tps:.2f} output t/s, TTFT p50 {_ms(summary.ttft_s['p50'])}, TPOT p50 "
                    f"{_ms(summary.tpot_s['p50'])}, {summary.errors} errors, "
                    f"{'within' if summary.precise else 'NOT within'} ±{precision:.0%}, host busy "
                    f"{'-' if machine.busy is None else f'{machine.busy:.0%}'}")
            for flag in interference(result.levels):
                say(f"interference: {flag}")
        finally:  # the levels measured before a failure stay with the failed run
            run.write_jsonl(REQUESTS_FILE, map(asdict, result.requests))
            run.write_jsonl(WARMUP_FILE, map(asdict, warmups))
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
    out = [f"### {title}", "", "| concurrency | warm-up | requests | errors | output t/s | c x tok/req s (95 %) "
           "| requests/s | TTFT p50/p95/p99 ms | TPOT p50/p95/p99 ms | mean TPOT ms (95 %) | machine |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in levels:
        out.append(f"| {s.concurrency} | {s.warmup} | {s.requests} | {s.errors} | {s.output_tps:.2f} | "
                   f"{interval_text(s.throughput, s.precise)} | {s.requests_per_s:.2f} | {_triple(s.ttft_s)} | "
                   f"{_triple(s.tpot_s)} | {interval_text(s.tpot_mean_s, s.precise, scale=1000)} | "
                   f"{machine_text(s.machine)} |")
    out.append("")
    out += [f"interference: {flag}" for flag in interference(levels)] or ["interference: none flagged"]
    return "\n".join(out) + "\n"


def _triple(values: dict[str, float | None]) -> str:
    return " / ".join("-" if values.get(f"p{p}") is None else f"{values[f'p{p}'] * 1000:.0f}" for p in PERCENTILES)


def interval_text(interval: dict[str, Any] | None, precise: bool | None = None, *, scale: float = 1.0) -> str:
    """``estimate (low–high)``, marked ``wide`` when it missed the precision asked; ``-`` when absent."""
    if not interval or not _known(interval):
        return "-"
    text = f"{interval['estimate'] * scale:.2f} ({interval['low'] * scale:.2f}–{interval['high'] * scale:.2f})"
    return text + (" wide" if precise is False else "")


def machine_text(machine: dict[str, Any] | None) -> str:
    """The host's load averages before -> after the level over its CPUs, its busy share, the controller's."""
    if not machine:
        return "-"
    parts = []
    before, after = machine.get("loadavg_before"), machine.get("loadavg_after")
    if before and after:
        cpus = f" of {machine['cpus']} CPUs" if machine.get("cpus") else ""
        parts.append(f"load {before[0]:.2f} -> {after[0]:.2f}{cpus}")
    if machine.get("busy") is not None:
        parts.append(f"busy {machine['busy']:.0%}")
    if machine.get("controller_loadavg"):
        parts.append(f"controller load {machine['controller_loadavg'][0]:.2f}")
    return ", ".join(parts) or "-"


def to_png(curves: Sequence[tuple[str, Sequence[LevelSummary]]], path: Path, title: str) -> Path:
    """Output t/s and TPOT p50 against concurrency, one line per run."""
    if not curves:
        raise RigctlError("nothing to plot: no load levels")
    fig, (left, right) = new_figure(1, 2, figsize=(9, 3.4))
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
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path)
    return path
