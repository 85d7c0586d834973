"""rigctl bench load: level figures, their intervals, the interference check, the machine's load as a host
reports it, run-against-run comparison and the report's load and deployed-decode sections, on hand-made runs;
the lab curve is in tests/lab/test_bench_lab.py and the lab campaign's in tests/lab/test_compare_lab.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from handmade_runs import bench_record, bench_run, load_run

from rigctl.bench.load import (
    LevelSummary,
    LoadRequest,
    compare_load,
    interference,
    is_precise,
    level_intervals,
    machine_load,
    parse_levels,
    parse_proc_sample,
    summarize_level,
)
from rigctl.errors import ConfigError, RigctlError
from rigctl.results.store import ResultsStore
from rigctl.stats import bootstrap_rate


def _request(ttft: float, wall: float, tokens: int = 16, started: float = 0.0, ok: bool = True,
             decode: float = 50.0) -> dict:
    return {"prompt": "chat", "ok": ok, "error": None if ok else "HTTP 503", "ttft_s": ttft if ok else None,
            "wall_s": wall, "tokens": tokens if ok else 0, "tpot_s": (wall - ttft) / (tokens - 1) if ok else None,
            "decode_per_s": decode if ok else None, "started_s": started}


def test_level_figures() -> None:
    done = [LoadRequest(level=2, index=i, **_request(0.1 * (i + 1), 1.0 + 0.1 * i, started=0.5 * i))
            for i in range(4)]
    done.append(LoadRequest(level=2, index=4, **_request(0, 0.2, ok=False, started=2.0)))
    level = summarize_level(2, done, 2.5)
    assert level.requests == 5 and level.errors == 1
    assert level.output_tps == pytest.approx(4 * 16 / 2.5) and level.requests_per_s == pytest.approx(4 / 2.5)
    assert level.ttft_s["p50"] == pytest.approx(np.percentile([0.1, 0.2, 0.3, 0.4], 50))
    assert level.tpot_s["p99"] == pytest.approx(np.percentile([r.tpot_s for r in done[:4]], 99))
    empty = summarize_level(1, [], 1.0)
    assert empty.ttft_s == {"p50": None, "p95": None, "p99": None} and empty.output_tps == 0
    assert empty.precise is False and empty.throughput["n"] == 0


def _level(concurrency: int, wall: float, tokens: int = 16, n: int = 40, spread: float = 0.02, seed: int = 0,
           ttft: float = 0.05) -> list[LoadRequest]:
    rng = np.random.default_rng(seed)
    walls = wall * (1 + rng.normal(0, spread, n))
    return [LoadRequest(level=concurrency, index=i,
                        **_request(ttft, float(w), tokens, started=(i // concurrency) * wall))
            for i, w in enumerate(walls)]


def test_level_intervals_are_littles_law_throughput_and_mean_tpot() -> None:
    done = _level(4, 0.5, n=40)
    throughput, tpot = level_intervals(4, done, resamples=4000)
    # Four clients each finishing a 16-token reply every 0.5 s: 128 tokens/s, inside its own interval.
    assert throughput.estimate == pytest.approx(4 * sum(r.tokens for r in done) / sum(r.wall_s for r in done))
    assert throughput.low < 128 < throughput.high and throughput.high - throughput.low < 0.05 * 128
    assert tpot.estimate == pytest.approx(np.mean([r.tpot_s for r in done]))
    summary = summarize_level(4, done, 5.0, warmup=4, precision=0.05)
    assert summary.warmup == 4 and summary.precise is True and summary.throughput["low"] == pytest.approx(
        level_intervals(4, done)[0].low)
    # The same level with a spread of 40 %: ten requests cannot pin it to ±5 %, forty pin it to ±25 %.
    noisy = _level(4, 0.5, n=40, spread=0.4, seed=1)
    assert not is_precise(4, noisy[:10], 0.05) and is_precise(4, noisy, 0.25)
    assert not is_precise(1, noisy[:1], 0.9)  # one reply is no interval


def test_bootstrap_rate_is_the_ratio_of_sums() -> None:
    rate = bootstrap_rate([10, 20, 30], [1.0, 1.0, 2.0], resamples=2000)
    assert rate.estimate == pytest.approx(15.0) and rate.low <= 15.0 <= rate.high and rate.n == 3
    assert bootstrap_rate([], []).empty
    with pytest.raises(ValueError, match="one denominator per numerator"):
        bootstrap_rate([1, 2], [1.0])


def _curve(levels: dict[int, float], tokens: int = 16) -> list[LevelSummary]:
    """Levels whose requests each take ``levels[c]`` seconds for ``tokens`` tokens."""
    return [summarize_level(c, _level(c, wall, tokens, seed=c), wall * 40 / c) for c, wall in levels.items()]


def test_a_sound_curve_is_not_flagged() -> None:
    # Requests slow down as clients share the server: TPOT rises, throughput grows sublinearly.
    assert interference(_curve({1: 0.4, 2: 0.5, 4: 0.7, 8: 1.2})) == []
    # Flat within noise is no interference either.
    assert interference(_curve({1: 0.4, 2: 0.39})) == []


def test_tpot_falling_with_more_clients_is_flagged() -> None:
    # The demo's curve before this check: TPOT 126 ms at one client, 18 ms at two.
    flags = interference(_curve({1: 2.0, 2: 0.3}))
    assert len(flags) == 2 and flags[0].startswith("concurrency 1 -> 2: mean TPOT fell from")
    assert "superlinear" in flags[1] and "for 2x the clients" in flags[1]


def test_throughput_superlinear_alone_is_flagged() -> None:
    # At two clients the first token waits 0.4 s of a 0.5 s request; at four it waits 0.05 s of 0.2 s (TPOT
    # rises from 6.7 to 10 ms): 5x the throughput for 2x the clients, with TPOT no lower.
    low = summarize_level(2, _level(2, 0.5, seed=2, ttft=0.4), 10.0)
    high = summarize_level(4, _level(4, 0.2, seed=4, ttft=0.05), 2.0)
    (flag,) = interference([high, low])
    assert flag.startswith("concurrency 2 -> 4: throughput rose") and "superlinear" in flag


def test_runs_recorded_before_intervals_are_read_and_not_flagged() -> None:
    old = {"concurrency": 1, "requests": 4, "errors": 0, "wall_s": 1.0, "output_tps": 30.0, "requests_per_s": 4.0,
           "ttft_s": {"p50": 0.1, "p95": 0.1, "p99": 0.1}, "tpot_s": {"p50": 0.03, "p95": 0.03, "p99": 0.03}}
    levels = [LevelSummary(**old), LevelSummary(**{**old, "concurrency": 2, "output_tps": 300.0})]
    assert levels[0].warmup == 0 and levels[0].machine is None and interference(levels) == []


PROC = """0.52 0.61 0.70 2/311 4242
cpu  1000 0 500 8000 500 0 0 0 0 0
cpu0 500 0 250 4000 250 0 0 0 0 0
cpu1 500 0 250 4000 250 0 0 0 0 0
"""


def test_machine_load_from_what_the_host_sent() -> None:
    before = parse_proc_sample(PROC, "desktop")
    assert before.loadavg == [0.52, 0.61, 0.70] and before.cpus == 2
    assert before.total_jiffies == 10000 and before.busy_jiffies == 1500
    after = parse_proc_sample(PROC.replace("0.52 0.61", "1.90 0.80").replace("cpu  1000 0 500 8000 500",
                                                                             "cpu  1600 0 700 8200 500"), "desktop")
    machine = machine_load(before, after, [3.0, 2.0, 1.0])
    # 800 of 1000 new jiffies busy: 80 % of the CPUs over the level.
    assert machine.busy == pytest.approx(0.8) and machine.loadavg_after[0] == 1.9 and machine.cpus == 2
    assert machine.controller_loadavg == [3.0, 2.0, 1.0]
    assert machine_load(None, after, None).busy is None and machine_load(None, None, None).cpus is None


@pytest.mark.parametrize("text", ["", "nonsense\n", "0.1 0.2 0.3 1/2 3\nintr 5 6 7 8\n",
                                  "0.1 0.2\ncpu 1 2 3 4\n", "0.1 0.2 0.3 1/1 1\ncpu 1 x 3 4\n"])
def test_what_a_host_sends_for_its_load_is_checked(text) -> None:
    with pytest.raises(RigctlError, match="^desktop: /proc/loadavg and /proc/stat do not read as such"):
        parse_proc_sample(text, "desktop")


@pytest.mark.parametrize(("levels", "message"), [([], "at least one level"), ([0, 2], "0 is outside 1..64"),
                                                  ([1, 2, 2], "a level is given twice")])
def test_bad_levels(levels, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_levels(levels)


def test_compare_two_curves_level_by_level(tmp_path) -> None:
    root = tmp_path / "results"
    rng = np.random.default_rng(3)
    # B decodes twice as fast at every level (back-to-back requests): 0.35 s against 0.2 s a request.
    for run_id, scale in (("load-a", 1.0), ("load-b", 0.5)):
        each = 0.05 + scale * 0.3
        levels = {c: [_request(0.05, each + scale * rng.normal(0, 0.01), started=(i // c) * each) for i in range(8)]
                  for c in (1, 2, 4)}
        load_run(root, "desktop", run_id, levels, server="smollm2", artifact="smollm2-135m-q4_1")
    store = ResultsStore(root)
    compared = compare_load(store.find("load-a"), store.find("load-b"), resamples=2000)
    assert [c.concurrency for c in compared] == [1, 2, 4]
    for level in compared:
        # Little's law's throughput (tokens over request time) against the levels' measured ones.
        assert level.output_tps.estimate == pytest.approx(level.b.output_tps / level.a.output_tps, rel=0.1)
        assert level.output_tps.low < 0.35 / 0.2 < level.output_tps.high  # the request times' ratio
        assert level.tpot.estimate == pytest.approx(0.5, rel=0.05) and level.tpot.high < 0.6
        assert level.ttft.estimate == pytest.approx(1.0)


def test_report_load_curve_and_deployed_decode(tmp_path) -> None:
    import yaml
    from report_check import links, tables

    from rigctl.analysis.campaign import load_campaign
    from rigctl.analysis.report import build_report

    root = tmp_path / "results"
    cells = [("smollm2-135m-q4_1", [bench_record((0, 16), [40.0, 39.0, 38.0], ngl=0)])]
    bench_run(root, "desktop", "bench-1", cells,
              matrix={"p": [0], "n": [16], "r": 3, "fa": [1], "ngl": [0], "t": [6], "ctk": [], "ctv": [], "d": []})
    # The second level's requests are as fast as the first's with twice the clients (throughput doubles,
    # TPOT flat): a sound curve. The machine was busy meanwhile.
    levels = {c: [_request(0.05, 0.4 + 0.01 * (i % 3), decode=30.0 + i, started=(i // c) * 0.4) for i in range(4)]
              for c in (1, 2)}
    machine = machine_load(parse_proc_sample(PROC, "desktop"), parse_proc_sample(PROC.replace(
        "0.52 0.61", "1.90 0.80").replace("cpu  1000 0 500 8000 500", "cpu  1600 0 700 8200 500"), "desktop"),
        [3.0, 2.0, 1.0])
    load_run(root, "desktop", "load-1", levels, server="smollm2", artifact="smollm2-135m-q4_1",
             args=["--model", "/m.gguf", "-ngl", "0", "-t", "2", "--parallel", "2"], machine=machine)
    (tmp_path / "suite.yaml").write_text("name: suite\nscorer: gsm8k\ndataset: {path: data.jsonl}\n")
    campaign = {"name": "mini", "title": "Mini", "hosts": ["desktop"],
                "benches": [{"name": "speed", "hosts": ["desktop"], "models": ["smollm2-135m-q4_1"],
                             "matrix": {"p": [0], "n": [16], "r": 3, "ngl": [0], "t": [6]}}],
                "loads": [{"name": "curve", "host": "desktop", "server": "smollm2", "concurrency": [1, 2],
                           "max_tokens": 16, "slot_ctx": 256}]}
    path = tmp_path / "mini.yml"
    path.write_text(yaml.safe_dump(campaign))
    report = build_report(load_campaign(path), ResultsStore(root), tmp_path / "out")
    by_section = {section: rows for section, _, rows in tables(report.markdown)}
    curve = by_section["Load"]
    assert [r["concurrency"] for r in curve] == ["1", "2"]
    text, files = links(curve[1]["output t/s"], report.path.parent)
    rows = [json.loads(line) for line in files[0].read_text().splitlines()]
    level2 = [r for r in rows if r["level"] == 2]
    expected = sum(r["tokens"] for r in level2) / max(r["started_s"] + r["wall_s"] for r in level2)
    assert float(text) == round(expected, 2)
    # Warm-up, intervals, the precision asked and the machine's load stand beside each level.
    assert [r["warm-up"] for r in curve] == ["1", "2"]
    interval, _ = links(curve[1]["throughput 95 %"], report.path.parent)
    estimate, low, high = (float(x) for x in interval.removesuffix(" wide").replace("(", "").replace(")", "")
                           .replace("–", " ").split())
    assert low <= estimate <= high and estimate == pytest.approx(2 * sum(r["tokens"] for r in level2)
                                                                 / sum(r["wall_s"] for r in level2), abs=0.01)
    assert curve[0]["machine"] == "load 0.52 -> 1.90 of 2 CPUs, busy 80%, controller load 3.00"
    assert "Precision asked: ±10% of each estimate at 95 %." in report.markdown
    assert "Interference check: none flagged" in report.markdown
    (deployed,) = by_section["Deployed decode against llama-bench"]
    assert deployed["server / llama-bench"].startswith(f"[{np.mean([30, 31, 32, 33]) / 39.0:.3f}]")
    # The server ran on 2 threads with flash attention left to llama-server: said, not hidden.
    assert deployed["settings"] == "differ: t 2 vs 6, fa auto vs 1"
    assert any(c.name == "load-curve.png" for c in report.charts)


def test_report_flags_a_curve_more_clients_cannot_explain(tmp_path) -> None:
    import yaml

    from rigctl.analysis.campaign import load_campaign
    from rigctl.analysis.report import build_report

    root = tmp_path / "results"
    # The demo's curve before the check: a request at two clients four times faster than at one.
    levels = {1: [_request(0.05, 1.2 + 0.01 * i, started=i * 1.2) for i in range(8)],
              2: [_request(0.05, 0.3 + 0.01 * i, started=(i // 2) * 0.3) for i in range(8)]}
    load_run(root, "desktop", "load-1", levels, server="smollm2", artifact="smollm2-135m-q4_1")
    campaign = {"name": "mini", "title": "Mini", "hosts": ["desktop"],
                "loads": [{"name": "curve", "host": "desktop", "server": "smollm2", "concurrency": [1, 2],
                           "max_tokens": 16, "slot_ctx": 256}]}
    path = tmp_path / "mini.yml"
    path.write_text(yaml.safe_dump(campaign))
    report = build_report(load_campaign(path), ResultsStore(root), tmp_path / "out")
    flagged = [line for line in report.markdown.splitlines() if line.startswith("- **interference**")]
    assert len(flagged) == 2 and "mean TPOT fell" in flagged[0] and "superlinear" in flagged[1]
    assert "none flagged" not in report.markdown
