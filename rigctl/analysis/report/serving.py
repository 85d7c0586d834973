"""The report's serving sections: the drafter races (speedup, acceptance, byte-identical output), load curves,
and the servers as deployed (their argv read from the hosts)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rigctl.analysis.campaign import LoadedCampaign, Located
from rigctl.analysis.report.markdown import Links, md_table, ms_text, pulled_steps
from rigctl.analysis.speed import sample_file
from rigctl.bench.matrix import counted, load_run_samples
from rigctl.errors import ConfigError
from rigctl.results.store import StoredRun, read_run_jsonl

if TYPE_CHECKING:
    from rigctl.bench.drafting import RaceRequest


def race_requests(run: StoredRun) -> list[RaceRequest]:
    """A drafting race's requests (:class:`rigctl.bench.drafting.RaceRequest` each)."""
    from rigctl.bench.drafting import REQUESTS_FILE, RaceRequest

    path = run.path / REQUESTS_FILE
    try:
        return [RaceRequest(**row) for row in read_run_jsonl(run, REQUESTS_FILE)]
    except TypeError as exc:
        raise ConfigError(f"{path}: not a drafting race's requests: {exc}") from None


def read_load_run(run: StoredRun) -> None:
    from rigctl.bench.load import load_levels, load_requests

    load_levels(run)
    load_requests(run)


def drafting_section(loaded: LoadedCampaign, found: Located, links: Links) -> list[str]:
    """Per race: each contender's decode t/s, speedup over the baseline (geometric mean of the per-prompt
    speedups), draft acceptance and greedy replies byte-identical to the baseline's, per temperature."""
    campaign = loaded.campaign
    if not campaign.drafting:
        return []
    from rigctl.bench.drafting import REQUESTS_FILE, summarize_race  # its HTTP client: only for a campaign's races

    lines = ["## Drafting", ""]
    for race, run in pulled_steps(lines, campaign.drafting, found.drafting, lambda r: f"{r.name} on {r.host}"):
        path = run.path / REQUESTS_FILE
        requests = race_requests(run)
        file = [path]
        rows = []
        for row in summarize_race(requests, race.baseline):
            if row.prompt != "overall":
                continue
            identical = f"{row.identical[0]} of {row.identical[1]}" if row.identical else "-"
            rows.append([row.contender, f"{row.temperature:g}", links.number(f"{row.tokens_per_s:.2f}", file),
                         links.number(f"{row.speedup:.3f}", file) if row.speedup is not None else "-",
                         links.number(f"{row.acceptance:.3f}", file) if row.acceptance is not None else "-",
                         links.number(identical, file) if row.identical else "-"])
        lines += md_table(["contender", "temperature", "t/s", "speedup", "acceptance", "greedy identical"], rows,
                        align="ll")
        lines.append("")
    return lines


def load_section(loaded: LoadedCampaign, found: Located, links: Links, out_dir: Path,
                  charts: list[Path]) -> list[str]:
    """Per load curve: each level's warm-up (excluded), output t/s with the 95 % interval of its closed-loop
    throughput, requests/s, TTFT and TPOT percentiles, mean TPOT's interval, errors and the machine's other
    load; the interference check's flags; the curve."""
    from rigctl.bench.load import REQUESTS_FILE, interference, interval_text, load_levels, machine_text, to_png

    campaign = loaded.campaign
    if not campaign.loads:
        return []
    lines = ["## Load", "", "Streamed requests, a probe slot per client; TTFT and time per output token in ms. Each "
             "level's warm-up requests (one per client unless set) ran first and are in no figure; a level ran until "
             "the 95 % intervals of its throughput (concurrency x tokens / request seconds) and mean TPOT were "
             "within the stated precision of their estimates or its request cap was reached (not within: "
             "`wide`). Machine: the host's 1-minute load average before -> after the level, its CPUs' busy share over "
             "it (the probe included) and the controller's load average.", ""]
    for load, run in pulled_steps(lines, campaign.loads, found.loads, lambda s: f"{s.name}: {s.server} on {s.host}"):
        levels = load_levels(run)
        file = [run.path / REQUESTS_FILE]
        rows = [[str(s.concurrency), str(s.warmup), links.number(str(s.requests), file),
                 links.number(str(s.errors), file), links.number(f"{s.output_tps:.2f}", file),
                 links.number(interval_text(s.throughput, s.precise), file),
                 links.number(f"{s.requests_per_s:.2f}", file),
                 *(links.number(ms_text(s.ttft_s.get(f"p{q}")), file) for q in (50, 95, 99)),
                 *(links.number(ms_text(s.tpot_s.get(f"p{q}")), file) for q in (50, 95, 99)),
                 links.number(interval_text(s.tpot_mean_s, s.precise, scale=1000), file),
                 machine_text(s.machine)] for s in levels]
        lines += md_table(["concurrency", "warm-up", "requests", "errors", "output t/s", "throughput 95 %",
                           "requests/s", "TTFT p50", "TTFT p95", "TTFT p99", "TPOT p50", "TPOT p95", "TPOT p99",
                           "mean TPOT 95 %", "machine"], rows)
        precision = {s.precision for s in levels if s.precision is not None}
        lines.append("")
        if precision:
            lines.append(f"Precision asked: ±{max(precision):.0%} of each estimate at 95 %.")
        else:
            lines.append("Recorded before warm-ups and intervals: no precision, warm-up or machine load to show.")
        flags = interference(levels)
        lines += ["", *(f"- **interference**: {flag}" for flag in flags)] if flags else \
            ["", "Interference check: none flagged (TPOT does not fall and throughput grows no faster than the "
                 "clients, beyond the intervals)." if precision else "Interference check: no intervals to check."]
        chart = out_dir / f"load-{load.name}.png"
        to_png([(f"{run.host}/{run.id}", levels)], chart, f"{load.name}: {load.server} on {load.host}")
        charts.append(chart)
        lines += ["", f"![{load.name}]({chart.name})", ""]
    return lines


def _server_flags(argv: Sequence[str]) -> dict[str, str]:
    """The llama-bench settings a server's arguments set (``-ngl -t -ctk -ctv -fa``), llama-server's
    defaults where they are absent."""
    names = {"-ngl": "ngl", "--n-gpu-layers": "ngl", "--gpu-layers": "ngl", "-t": "t", "--threads": "t",
             "-ctk": "ctk", "--cache-type-k": "ctk", "-ctv": "ctv", "--cache-type-v": "ctv", "-fa": "fa",
             "--flash-attn": "fa"}
    out = {"ngl": "auto", "t": "auto", "ctk": "f16", "ctv": "f16", "fa": "auto"}
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag in names:
            out[names[flag]] = value
    return out


def deployed_section(loaded: LoadedCampaign, found: Located, links: Links) -> list[str]:
    """Deployed decode (llama-server, streamed, one request at a time: the load curve's first level) over
    llama-bench's tg for the same artifact on the same host, with whether their settings agree."""
    from rigctl.bench.load import REQUESTS_FILE, load_requests
    from rigctl.bench.matrix import flash_attn_flag

    rows = []
    for load in loaded.campaign.loads:
        run = found.loads.get(load.name)
        if run is None or 1 not in load.concurrency:
            continue
        artifact = run.record.artifacts[0].name if run.record.artifacts else "None"
        decode = [r.decode_per_s for r in load_requests(run) if r.level == 1 and r.ok and r.decode_per_s]
        flags = _server_flags(run.record.server.argv if run.record.server else [])
        for (bench_name, host), bench_run in found.benches.items():
            if bench_run is None or host != load.host:
                continue
            tg = [s for s in load_run_samples(bench_run) if s.model == artifact and s.n_gen and not s.n_prompt
                  and s.depth == 0]
            for (test, config, fa) in dict.fromkeys((s.test, s.config, s.flash_attn) for s in tg):
                group = counted([s for s in tg if (s.test, s.config, s.flash_attn) == (test, config, fa)])
                values = [v for s in group for v in s.samples_ts]
                if not values or not decode:
                    continue
                sample = group[0]
                bench_flags = {"ngl": str(sample.ngl), "t": config.split()[1].removeprefix("t"),
                               "ctk": sample.type_k, "ctv": sample.type_v, "fa": str(fa)}
                differ = [f"{k} {flags[k]} vs {v}" for k, v in bench_flags.items()
                          if (flash_attn_flag(flags[k]) if k == "fa" else flags[k]) != (fa if k == "fa" else v)]
                files = [run.path / REQUESTS_FILE, *(links.result(sample_file(s)) for s in group)]
                ratio = float(np.mean(decode)) / float(np.mean(values))
                rows.append([loaded.campaign.label(artifact), host, f"{load.name} / {bench_name} {test}",
                             links.number(f"{np.mean(decode):.2f}", files[:1]),
                             links.number(f"{np.mean(values):.2f}", files[1:]), links.number(f"{ratio:.3f}", files),
                             "same" if not differ else "differ: " + ", ".join(differ)])
    if not rows:
        return []
    return ["## Deployed decode against llama-bench", "",
            "llama-server's own decode t/s, streamed, one request at a time, over llama-bench's tg of the same "
            "artifact on the same host.", "",
            *md_table(["model", "host", "runs", "server t/s", "llama-bench t/s", "server / llama-bench", "settings"],
                    rows, align="lll"), ""]
