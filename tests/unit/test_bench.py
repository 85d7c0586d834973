"""rigctl bench without rigs: parsers and summaries on real llama-bench JSON, specs, drafter and server-speed maths."""

from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from rigctl.bench.matrix import (
    BenchSample,
    bench_test_name,
    load_run_samples,
    parse_llama_bench_json,
    parse_spec,
    rep_over_first,
    samples_from_cell,
    summarize,
    to_csv,
    to_markdown,
    to_png,
)
from rigctl.errors import ConfigError
from rigctl.hostside.bench_task import gguf_shape, llama_bench_argv, plan_cells, throttle_verdict
from rigctl.hostside.nvidia_smi import held_reasons, parse_reading
from rigctl.results.record import RunRecord
from rigctl.results.store import ResultsStore

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# Real output of `llama-bench -m smollm2-135m-q4_0.gguf -p 32 -n 16 -r 2 -fa 0,1 -ngl 99 -t 2 -o json` on a lab rig.
RAW = (FIXTURES / "llama_bench_smollm2_q4_0.json").read_text()


def _other_model(entries: list[dict], factor: float) -> list[dict]:
    """The same tests as another model whose every repetition is ``factor`` times as fast."""
    out = copy.deepcopy(entries)
    for e in out:
        e["model_filename"] = "/var/lib/rigctl/models/smollm2-135m-q4_1.gguf"
        e["samples_ts"] = [v * factor for v in e["samples_ts"]]
    return out


# ----------------------------------------------------------------------------------------------- parsers


def test_parse_real_llama_bench_json() -> None:
    entries = parse_llama_bench_json(RAW)
    assert [(e["n_prompt"], e["n_gen"], e["flash_attn"]) for e in entries] == [(32, 0, 0), (0, 16, 0), (32, 0, 1),
                                                                               (0, 16, 1)]
    samples = samples_from_cell(entries, host="desktop", run_id="bench-1", build="", model="q4_0", cell=1)
    assert [s.test for s in samples] == ["pp32", "tg16", "pp32", "tg16"]
    assert [s.flash_attn for s in samples] == [0, 0, 1, 1]
    assert samples[0].build == "b11434"  # llama-bench's own build_commit when the record has none
    assert samples[0].config == "ngl99 t2 f16/f16"
    assert samples[0].samples_ts == tuple(entries[0]["samples_ts"])


@pytest.mark.parametrize(("text", "message"), [
    ("not json", "not JSON"),
    ('{"a": 1}', "expected a JSON array"),
    ('[{"n_prompt": 1, "n_gen": 0, "samples_ts": []}]', "result 0 lacks model_filename"),
])
def test_parse_rejects_what_is_not_llama_bench_output(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_llama_bench_json(text, "cell-001.json")
    assert str(info.value).startswith("cell-001.json: ")


def test_names_follow_llama_bench() -> None:
    assert bench_test_name(512, 0) == "pp512"
    assert bench_test_name(0, 128) == "tg128"
    assert bench_test_name(512, 128) == "pp512+tg128"
    assert bench_test_name(0, 128, 4096) == "tg128 @ d4096"


def test_llama_bench_argv_and_cell_order() -> None:
    matrix = parse_spec({"hosts": ["h"], "models": ["a"], "matrix": {"p": [512, 2048], "n": [128], "r": 5,
                                                                     "fa": [0, 1], "t": [6], "ctk": ["q8_0"]}},
                        "spec").matrix.flags()
    assert llama_bench_argv("/bin/llama-bench", "/m/a.gguf", matrix) == [
        "/bin/llama-bench", "-m", "/m/a.gguf", "-p", "512,2048", "-n", "128", "-r", "5", "-fa", "0,1",
        "-ngl", "99", "-t", "6", "-ctk", "q8_0", "-o", "json"]
    a, b = {"name": "a"}, {"name": "b"}
    assert [(r, m["name"]) for r, m in plan_cells([a, b], 2, "alternate")] == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert [(r, m["name"]) for r, m in plan_cells([a, b], 2, "grouped")] == [(1, "a"), (2, "a"), (1, "b"), (2, "b")]
    with pytest.raises(ValueError, match="alternate or grouped"):
        plan_cells([a], 1, "random")


@pytest.mark.parametrize(("data", "message"), [
    ({"hosts": ["h"], "models": ["a"], "order": "random"}, "spec: order: "),
    ({"hosts": ["h"], "models": ["a"], "matrix": {"fa": [2]}}, "spec: matrix.fa.0: "),
    ({"hosts": ["h"], "models": []}, "spec: models: "),
    ({"hosts": ["h"], "models": ["a"], "matrix": {"ctk": ["q3"]}}, "spec: matrix.ctk.0: "),
    ({"hosts": ["h"], "models": ["a"], "colour": "red"}, "spec: colour: "),
])
def test_bad_specs_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec(data, "spec")


def test_yaml_spec_with_flag_overrides(tmp_path: Path) -> None:
    from rigctl.bench.matrix import load_spec

    path = tmp_path / "study.yml"
    path.write_text("hosts: [desktop]\nmodels: [a, b]\n"
                    "matrix: {p: [512, 2048], n: [128], r: 5, ngl: [99], fa: [1], t: [6]}\n"
                    "rounds: 5\ncooldown: {threshold_c: 40, timeout_s: 900}\n")
    spec = load_spec(path, {"matrix": {"fa": [0, 1]}, "cooldown": {"poll_s": 1.0}})
    assert spec.matrix.p == [512, 2048] and spec.matrix.fa == [0, 1] and spec.rounds == 5
    assert (spec.cooldown.threshold_c, spec.cooldown.timeout_s, spec.cooldown.poll_s) == (40, 900, 1.0)
    path.write_text("hosts: [desktop]\nmodels: [a]\nmatrix: {p: fast}\n")
    with pytest.raises(ConfigError, match=f"{path}: matrix.p: "):
        load_spec(path)


def test_parse_reading() -> None:
    # nvidia-smi --query-gpu=index,clocks.sm,clocks.mem,clocks.max.sm,power.draw,power.limit,
    #   clocks_event_reasons.active,temperature.gpu --format=csv,noheader,nounits (one line per GPU)
    reading = parse_reading("1, 1845, 7000, 2100, 61.32, 250.00, 0x0000000000000000, 41\n")
    assert reading == {"gpu": 1, "sm_mhz": 1845, "mem_mhz": 7000, "max_sm_mhz": 2100, "power_w": 61.32,
                       "power_limit_w": 250.0, "reasons": 0, "temp_c": 41}
    # Laptop GPUs often report no power draw; a driver error reads as not reported.
    laptop = parse_reading("0, 1500, 6000, 1785, [N/A], [Not Supported], 0x0000000000000040, ERR!")
    assert (laptop["power_w"], laptop["power_limit_w"], laptop["temp_c"]) == (None, None, None)
    with pytest.raises(ValueError, match="expected 8"):
        parse_reading("41\n")


def _reading(sm: int, reasons: int = 0, max_sm: int = 2000, gpu: int = 0, during: bool = True,
             power: float = 200.0) -> dict:
    return {"gpu": gpu, "sm_mhz": sm, "mem_mhz": 7000, "max_sm_mhz": max_sm, "power_w": power,
            "power_limit_w": 250.0, "reasons": reasons, "temp_c": 50, "during": during}


def test_throttle_verdict() -> None:
    steady = throttle_verdict([_reading(1900), _reading(1850)], 0.8)
    assert not steady["throttled"] and steady["min_sm_fraction"] == pytest.approx(0.925)
    # A card idling at the end of a cell (GPU-idle reason on) is not throttled for its low clock.
    assert not throttle_verdict([_reading(1900), _reading(210, reasons=0x1)], 0.8)["throttled"]
    slow = throttle_verdict([_reading(1900), _reading(1500)], 0.8)
    assert slow["throttled"] and slow["why"] == ["SM clock at 75% of its max (below 80%)"]
    hot = throttle_verdict([_reading(1900), _reading(1900, reasons=0x40)], 0.8)
    assert hot["throttled"] and hot["why"] == ["reason hw_thermal_slowdown"]
    assert hot["reasons"] == ["hw_thermal_slowdown"]
    # Sync boost and application clocks are not heat or power.
    assert not throttle_verdict([_reading(1900, reasons=0x12)], 0.8)["throttled"]
    assert throttle_verdict([], 0.8) == {"throttled": False, "why": [], "min_sm_fraction": None, "reasons": [],
                                         "samples": 0}


def test_throttle_verdict_only_from_readings_while_llama_bench_runs() -> None:
    # The reading taken as the cell starts, before llama-bench loads the model, is kept in the clocks file
    # but says nothing of the cell: a reason or a low clock there is no verdict.
    before = _reading(300, reasons=0x20, during=False)
    verdict = throttle_verdict([before, _reading(1900), _reading(1880)], 0.8)
    assert not verdict["throttled"] and verdict["samples"] == 3 and verdict["reasons"] == ["sw_thermal_slowdown"]
    # The same reason while it runs is.
    assert throttle_verdict([before, _reading(1900, reasons=0x20)], 0.8)["why"] == ["reason sw_thermal_slowdown"]


def test_idle_reasons_are_not_throttling() -> None:
    # A recorded idle RTX 2080 SUPER (595.71.05, tests/fixtures/real/nvidia-smi-query): reasons 0x4 (SW power
    # cap) at 39.32 W of 250 W and no gpu_idle bit. A cap at idle power is the driver's idle policy.
    idle_cap = _reading(765, reasons=0x4, max_sm=2145, power=39.32)
    assert held_reasons(idle_cap) == 0
    assert not any(why.startswith("reason") for why in throttle_verdict([idle_cap], 0.8)["why"])
    # With the gpu_idle bit nothing counts; a cap at load power does.
    assert held_reasons(_reading(300, reasons=0x5)) == 0
    assert held_reasons(_reading(1700, reasons=0x4, power=245.0)) == 0x4
    assert throttle_verdict([_reading(1900, reasons=0x4, power=245.0)], 0.8)["why"] == ["reason sw_power_cap"]


def test_throttle_verdict_keeps_each_gpu_apart() -> None:
    # Two GPUs' lines of one -lms loop: GPU 1 throttles, GPU 0 does not; the verdict names GPU 1.
    readings = [_reading(1900, gpu=0), _reading(1000, gpu=1, max_sm=1500), _reading(1900, gpu=0),
                _reading(1450, gpu=1, max_sm=1500, reasons=0x20)]
    verdict = throttle_verdict(readings, 0.8)
    assert verdict["why"] == ["reason sw_thermal_slowdown on GPU 1", "SM clock at 67% of its max (below 80%) on GPU 1"]


def test_gguf_shape_reads_a_real_gguf_header(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(30)
    writer.add_embedding_length(576)
    writer.add_head_count(9)
    writer.add_head_count_kv(3)
    writer.add_context_length(8192)
    writer.add_token_list([f"t{i}" for i in range(5000)])  # a vocabulary is skipped, not kept
    writer.add_tensor("w", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_shape(str(path)) == {"architecture": "llama", "block_count": 30, "embedding_length": 576,
                                     "attention.head_count": 9, "attention.head_count_kv": 3,
                                     "context_length": 8192}
    (tmp_path / "not.gguf").write_bytes(b"GGML" + b"\0" * 20)
    assert gguf_shape(str(tmp_path / "not.gguf")) is None


# ----------------------------------------------------------------------------------------------- summary


def _samples(build: str = "b11434", host: str = "desktop") -> list[BenchSample]:
    q4_0 = parse_llama_bench_json(RAW)
    out = []
    for cell, (model, entries) in enumerate([("q4_0", q4_0), ("q4_1", _other_model(q4_0, 2.0))], 1):
        out += samples_from_cell(entries, host=host, run_id="bench-1", build=build, model=model, cell=cell)
    return out


def test_summary_statistics_come_from_the_repetitions() -> None:
    entries = parse_llama_bench_json(RAW)
    rows = summarize(_samples())
    assert len(rows) == 8  # 2 tests x 2 fa x 2 models
    pp_fa0 = next(r for r in rows if r.test == "pp32" and r.flash_attn == 0 and r.model == "q4_0")
    values = entries[0]["samples_ts"]
    assert pp_fa0.mean == pytest.approx(np.mean(values))
    assert pp_fa0.stddev == pytest.approx(np.std(values, ddof=1))
    assert pp_fa0.rep_first == pytest.approx(values[1] / values[0])
    assert pp_fa0.ratio == {"q4_1": pytest.approx(0.5)}  # q4_0 / q4_1, the other model twice as fast
    assert pp_fa0.fa1_fa0 is None
    pp_fa1 = next(r for r in rows if r.test == "pp32" and r.flash_attn == 1 and r.model == "q4_1")
    assert pp_fa1.fa1_fa0 == pytest.approx(np.mean(entries[2]["samples_ts"]) / np.mean(entries[0]["samples_ts"]))
    assert pp_fa1.ratio == {"q4_0": pytest.approx(2.0)}


def test_rep_over_first_is_steady_over_cold_per_cell() -> None:
    assert rep_over_first([[100.0, 99.0, 97.0]]) == pytest.approx(0.98)
    # Each cell starts cold after its cool-down: its first repetition is cold, the rest steady.
    assert rep_over_first([[100.0, 90.0], [110.0, 100.0]]) == pytest.approx(95.0 / 105.0)
    assert math.isnan(rep_over_first([[100.0]]))


def test_builds_and_hosts_are_kept_apart_unless_merged() -> None:
    samples = _samples("aaaa") + _samples("bbbb") + _samples("aaaa", host="laptop")
    rows = summarize(samples)
    assert {r.partition for r in rows} == {"desktop @ aaaa", "desktop @ bbbb", "laptop @ aaaa"}
    assert all(r.n == 2 for r in rows)
    merged = summarize(samples, merge=True)
    assert {r.partition for r in merged} == {"all"}
    assert all(r.n == 6 for r in merged)


def test_markdown_csv_and_png(tmp_path: Path) -> None:
    rows = summarize(_samples())
    markdown = to_markdown(rows)
    assert "| test | config | fa | q4_0 t/s | q4_1 t/s | q4_0/q4_1 | q4_0 fa1/fa0 | q4_1 fa1/fa0 |" in markdown
    pp_fa0 = next(r for r in rows if r.test == "pp32" and r.flash_attn == 0 and r.model == "q4_0")
    assert f"| pp32 | ngl99 t2 f16/f16 | 0 | {pp_fa0.mean:.2f} ± {pp_fa0.stddev:.2f} |" in markdown
    lines = to_csv(rows).splitlines()
    assert lines[0].startswith("partition,test,config,flash_attn,model,n,cells,mean_ts")
    assert len(lines) == 1 + len(rows)
    assert "q4_1=0.5" in lines[1]
    png = to_png(rows, tmp_path / "chart.png")
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width > 500 and height > 200


def test_load_run_samples_reads_the_raw_files(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path)
    run_dir = store.run_dir("desktop", "bench-20261130T000000Z-abcd")
    (run_dir / "llama-bench").mkdir(parents=True)
    q4_0 = json.loads(RAW)
    cells = []
    for index, (name, entries) in enumerate([("q4_0", q4_0), ("q4_1", _other_model(q4_0, 1.5))], 1):
        raw = f"llama-bench/cell-{index:03d}-{name}.json"
        (run_dir / raw).write_text(json.dumps(entries))
        cells.append({"index": index, "artifact": name, "rc": 0, "raw": raw, "temp_start_c": 39, "temp_end_c": 61})
    (run_dir / "cells.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cells))
    record = RunRecord(id=run_dir.name, kind="bench", host="desktop", started="x", llama_cpp={"commit": "abc123"})
    record.seal(run_dir)
    samples = load_run_samples(store.find(run_dir.name))
    assert len(samples) == 8
    assert {s.build for s in samples} == {"abc123"}
    assert {(s.temp_start_c, s.temp_end_c) for s in samples} == {(39, 61)}
    rows = summarize(samples)
    assert next(r for r in rows if r.model == "q4_1").ratio["q4_0"] == pytest.approx(1.5)




# ----------------------------------------------------------------------------------------------- drafter race


def _reply(text: str, predicted_n: int, predicted_ms: float, draft_n: int = 0, accepted: int = 0) -> dict:
    timings = {"predicted_n": predicted_n, "predicted_ms": predicted_ms, "prompt_n": 10, "prompt_ms": 5.0}
    if draft_n:
        timings |= {"draft_n": draft_n, "draft_n_accepted": accepted}
    return {"choices": [{"message": {"content": text}, "finish_reason": "length"}], "timings": timings}


def test_race_summary_speedup_acceptance_and_identity() -> None:
    from rigctl.bench.drafting import geometric_mean, parse_request, summarize_race

    requests = [
        parse_request("base", "code", 0.0, 1, _reply("def f(): pass", 100, 1000.0), 1.2),
        parse_request("draft", "code", 0.0, 1, _reply("def f(): pass", 100, 500.0, 60, 54), 0.7),
        parse_request("base", "story", 0.0, 1, _reply("Once upon", 100, 1000.0), 1.1),
        parse_request("draft", "story", 0.0, 1, _reply("Once upon a", 100, 800.0, 40, 20), 0.9),
        parse_request("base", "story", 0.8, 1, _reply("A", 50, 1000.0), 1.0),
        parse_request("draft", "story", 0.8, 1, _reply("B", 50, 900.0, 30, 15), 1.0),
    ]
    assert requests[1].tokens_per_s == pytest.approx(200.0)
    assert (requests[1].draft_n, requests[1].draft_n_accepted) == (60, 54)
    rows = summarize_race(requests, "base")
    get = {(r.contender, r.temperature, r.prompt): r for r in rows}
    assert get[("draft", 0.0, "code")].speedup == pytest.approx(2.0)
    assert get[("draft", 0.0, "story")].speedup == pytest.approx(1.25)
    assert get[("draft", 0.0, "overall")].speedup == pytest.approx(math.sqrt(2.0 * 1.25))
    assert get[("draft", 0.0, "overall")].acceptance == pytest.approx(74 / 100)
    assert get[("draft", 0.0, "code")].identical == (1, 1)
    assert get[("draft", 0.0, "story")].identical == (0, 1)  # one byte differs: not identical
    assert get[("draft", 0.8, "overall")].identical is None  # sampled replies are not compared
    assert get[("base", 0.0, "overall")].speedup is None and get[("base", 0.0, "code")].acceptance is None
    assert geometric_mean([2.0, 0.5]) == pytest.approx(1.0)


def test_race_contenders_from_the_lab_inventory() -> None:
    from rigctl.bench.drafting import contenders, load_prompts
    from rigctl.inventory import Inventory

    host = Inventory.load(Path(__file__).resolve().parents[2] / "inventory" / "lab").host("desktop")
    base, draft = contenders(host, "smollm2-q4_0")
    assert not base.drafting and draft.name == "smollm2-q4_0-draft"
    assert draft.spec == {"type": "draft-simple", "draft_n_max": 3, "draft_model": "smollm2-135m-q4_1"}
    with pytest.raises(ConfigError, match="baseline 'smollm2-q4_0-draft' drafts"):
        contenders(host, "smollm2-q4_0-draft")
    with pytest.raises(ConfigError, match="no llama_server instance 'nope'"):
        contenders(host, "smollm2-q4_0", ["nope"])
    prompts = load_prompts()
    assert list(prompts) == ["code", "chat", "story", "explain", "facts", "summary"]
    assert all(m[0]["role"] == "user" and len(m[0]["content"]) > 40 for m in prompts.values())
    with pytest.raises(ConfigError, match="no prompt kind poetry"):
        load_prompts(kinds=["poetry"])


# ----------------------------------------------------------------------------------------------- server speed


def test_server_bench_helpers() -> None:
    from rigctl.bench.server import MemoryPoint, filler_prompt, kv_bytes_per_token

    # 2 MiB more for 1024 more tokens: 2048 bytes per token.
    points = [MemoryPoint(1024, 300), MemoryPoint(2048, 302), MemoryPoint(4096, 306)]
    assert kv_bytes_per_token(points) == pytest.approx(2048.0)
    assert kv_bytes_per_token(points[:1]) is None
    words = lambda text: len(text.split())  # noqa: E731 (a tokenizer stand-in: one token a word)
    assert words(filler_prompt(100, words)) == 100
