"""rigctl bench load: level figures, run-against-run comparison and the report's load and deployed-decode
sections, on hand-made runs; the lab curve is in test_bench.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from handmade_runs import bench_record, bench_run, load_run

from rigctl.bench.load import LoadRequest, compare_load, parse_levels, summarize_level
from rigctl.errors import ConfigError
from rigctl.results.store import ResultsStore


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
    levels = {c: [_request(0.05, 0.4, decode=30.0 + i, started=(i // c) * 0.4) for i in range(4)] for c in (1, 2)}
    load_run(root, "desktop", "load-1", levels, server="smollm2", artifact="smollm2-135m-q4_1",
             args=["--model", "/m.gguf", "-ngl", "0", "-t", "2", "--parallel", "2"])
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
    (deployed,) = by_section["Deployed decode against llama-bench"]
    assert deployed["server / llama-bench"].startswith(f"[{np.mean([30, 31, 32, 33]) / 39.0:.3f}]")
    # The server ran on 2 threads with flash attention left to llama-server: said, not hidden.
    assert deployed["settings"] == "differ: t 2 vs 6, fa auto vs 1"
    assert any(c.name == "load-curve.png" for c in report.charts)
