"""Campaign files and the report on hand-made runs: validation, locating runs, every number recomputed."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import yaml
from handmade_runs import bench_record, bench_run, eval_run, spec_run
from report_check import check_report, tables
from test_compare import _rows

from rigctl.analysis.campaign import load_campaign, locate
from rigctl.analysis.report import build_report
from rigctl.bench.matrix import Matrix
from rigctl.errors import ConfigError
from rigctl.results.store import ResultsStore

CAMPAIGN = {
    "name": "mini",
    "title": "Mini study",
    "hosts": ["desktop", "laptop"],
    "artifacts": {"qwen-q4_0": {"label": "Qwen Q4_0"}, "gemma-qat": {"label": "Gemma QAT"},
                  "qwen-bf16": {"label": "Qwen bf16"}},
    "benches": [{"name": "speed", "hosts": ["desktop"], "models": ["qwen-q4_0", "gemma-qat"], "rounds": 2}],
    "evals": [{"name": "suite", "task": "suite.yaml", "runs": [
        {"host": "desktop", "server": "qwen", "artifact": "qwen-q4_0"},
        {"host": "desktop", "server": "gemma", "artifact": "gemma-qat"},
        {"host": "laptop", "server": "qwen-bf16", "artifact": "qwen-bf16"}]}],
    "comparisons": [{"name": "Gemma QAT vs Qwen Q4_0", "a": "qwen-q4_0@desktop", "b": "gemma-qat@desktop"},
                    {"name": "Rounding Qwen", "section": "quantisation", "a": "qwen-bf16@laptop",
                     "b": "qwen-q4_0@desktop"}],
    "sensitivity": {"cutoff_as_right": True, "toolless_as_right": True, "exclude": ["choice"]},
    "drafting": [{"name": "mtp", "host": "desktop", "baseline": "qwen", "drafters": ["qwen-mtp"], "repeats": 2,
                  "temperatures": [0.0]}],
    "not_measured": ["thinking on"],
    "equivalence_margin": 2,
}


# The hand-made runs' sets, as the campaign's one task file declares them (sensitivity.exclude names one).
SUITE = {"name": "suite", "scorer": "choice", "sets": [
    {"name": name, "dataset": {"path": f"{name}.jsonl"}, "prompt": "{q}", "gold": "g", "labels": {"a": "a", "b": "b"}}
    for name in ("choice", "math", "tools")]}


def _write_campaign(tmp_path, data=None):
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(SUITE))
    path = tmp_path / "mini.yml"
    path.write_text(yaml.safe_dump(data or CAMPAIGN))
    return path


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    rng = np.random.default_rng(4)
    cells = []
    for _ in range(2):
        cells.append(("qwen-q4_0", [bench_record((512, 0), list(5200 + rng.normal(0, 30, 5))),
                                    bench_record((0, 128), list(133 + rng.normal(0, 1, 5)))]))
        cells.append(("gemma-qat", [bench_record((512, 0), list(4200 + rng.normal(0, 30, 5))),
                                    bench_record((0, 128), list(118 + rng.normal(0, 1, 5)))]))
    bench_run(root, "desktop", "bench-1", cells)
    a = _rows({"choice": [1] * 20 + [0] * 20, "math": [1] * 10 + [0] * 30, "tools": [1] * 15 + [0] * 25},
              cutoff=set(range(10, 30)), toolless=set(range(15, 35)), missed={15}, preds=["yes"] * 40)
    b = _rows({"choice": [1] * 36 + [0] * 4, "math": [1] * 20 + [0] * 20, "tools": [1] * 25 + [0] * 15},
              cutoff={20, 21})
    eval_run(root, "desktop", "eval-q", "qwen-q4_0", a, started="2026-11-29T10:00:00.000000Z")
    eval_run(root, "desktop", "eval-g", "gemma-qat", b, started="2026-11-30T10:00:00.000000Z")
    requests = []
    for repeat in (1, 2):
        for prompt, base_speed, gain in (("code", 130.0, 1.25), ("story", 128.0, 1.09)):
            for contender, speed, drafted in (("qwen", base_speed, 0), ("qwen-mtp", base_speed * gain, 40)):
                requests.append({"contender": contender, "prompt": prompt, "temperature": 0.0, "repeat": repeat,
                                 "tokens": 256, "tokens_per_s": speed + repeat, "wall_s": 2.0, "draft_n": drafted,
                                 "draft_n_accepted": int(drafted * 0.9), "finish_reason": "length",
                                 "text": f"{prompt} reply" + ("!" if contender == "qwen-mtp" and repeat == 2 else "")})
    spec_run(root, "desktop", "spec-1", requests, baseline="qwen", contenders=["qwen", "qwen-mtp"], repeats=2,
             temperatures=(0.0,))
    return root


def test_report_numbers_recompute_from_the_raw_files(tmp_path, results):
    loaded = load_campaign(_write_campaign(tmp_path))
    report = build_report(loaded, ResultsStore(results), tmp_path / "out")
    checked = check_report(report.path)
    # 2 tests x 2 models, 2 ratios, 2 runs x (3 sets + overall), 1 comparison, habits of 2 runs x 3 sets.
    assert checked["speed"] == 4 and checked["ratio"] == 2
    assert checked["quality"] == 8 and checked["gap"] == 1
    assert checked["habits"] == 2 * 3 + 2
    # b / c and McNemar's p by hand, Holm over the one comparison, flips per set and overall.
    assert checked["tests"] == 1 and checked["holm"] == 1 and checked["flips"] == 2 * (3 + 1)
    assert checked["drafting"] == 3  # t/s of both contenders, the drafter's speedup
    (race,) = [rows for section, _, rows in tables(report.markdown) if section == "Drafting"]
    assert [r["contender"] for r in race] == ["qwen", "qwen-mtp"]
    assert race[1]["acceptance"].startswith("[0.900]") and race[1]["greedy identical"].startswith("[2 of 4]")
    assert checked["links"] > 30
    for chart in report.charts:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {c.name for c in report.charts} == {"speed-speed-desktop.png", "quality-suite.png",
                                               "comparisons-forest.png"}
    assert "![every comparison's gap" in report.markdown
    assert "Drafting" in report.headline
    text = report.markdown
    # The scope line names hosts, builds, dates, repeats, what was not measured and what is missing.
    scope = next(line for line in text.splitlines() if line.startswith("**Scope.**"))
    for part in ("desktop", "laptop", "7182ef71e", "2026-11-29 to 2026-11-30", "5 repetitions x 2 cells",
                 "Not measured: thinking on", "Not pulled yet: eval suite qwen-bf16@laptop",
                 "Smallest gap detectable at 80 % power", "Gemma QAT vs Qwen Q4_0 on suite ±"):
        assert part in scope, part
    # B is right wherever A is and on 36 more of 120: clearly different, never "equivalent within ±2".
    (head,) = [rows for section, _, rows in tables(text) if section == "Head to head"]
    assert head[0]["b / c"].startswith("[0 / 36]") and head[0]["verdict"] == "different"
    assert head[0]["p (Holm, 1 comparison)"] == "<0.001"
    # The quantisation comparison lacks its bf16 run: left out, not invented.
    assert "Rounding Qwen" not in text
    assert "](" not in report.headline and "| pp512 | ngl99 t6 f16/f16 fa1 |" in report.headline
    sections = [section for section, _, _ in tables(text)]
    assert sections.index("Speed") < sections.index("Quality") < sections.index("Head to head")


def test_sensitivity_rows_move_the_gap(tmp_path, results):
    report = build_report(load_campaign(_write_campaign(tmp_path)), ResultsStore(results), tmp_path / "out")
    (rows,) = [rows for section, _, rows in tables(report.markdown) if section == "Sensitivity"]
    by = {r["scoring"]: r for r in rows}
    assert list(by) == ["as recorded", "cut-off as right", "tool-less as right", "without choice",
                        "cut-off as right + tool-less as right + without choice"]
    for label in ("cut-off as right", "tool-less as right", "without choice"):
        assert float(by[label]["moved"]) < 0, label  # every switch favours the weaker run A here


@pytest.mark.parametrize("unfinished", ["stopped", "failed", "lost"])
def test_locate_takes_the_newest_finished_run_and_notes_unfinished_ones(tmp_path, results, unfinished):
    a = _rows({"math": [1, 0]})
    eval_run(results, "desktop", "eval-q-old", "qwen-q4_0", a, started="2026-11-01T00:00:00.000000Z")
    stopped = eval_run(results, "laptop", "eval-bf16", "qwen-bf16", a)
    record = (stopped / "run.json").read_text().replace('"status": "done"', f'"status": "{unfinished}"')
    (stopped / "run.json").write_text(record)
    found = locate(load_campaign(_write_campaign(tmp_path)), ResultsStore(results))
    assert found.evals[("suite", "qwen-q4_0@desktop")].id == "eval-q"
    assert found.evals[("suite", "qwen-bf16@laptop")] is None
    assert found.unfinished[("suite", "qwen-bf16@laptop")].id == "eval-bf16"
    assert found.benches[("speed", "desktop")].id == "bench-1"
    assert found.drafting["mtp"].id == "spec-1"


def test_bench_runs_with_another_matrix_do_not_answer_the_campaign(tmp_path):
    root = tmp_path / "results"
    bench_run(root, "desktop", "bench-x", [("qwen-q4_0", [bench_record((512, 0), [1.0])]),
                                            ("gemma-qat", [bench_record((512, 0), [1.0])])],
              matrix={"p": [64], "n": [16], "r": 3, "fa": [1], "ngl": [0], "t": [2], "ctk": [], "ctv": [], "d": []})
    found = locate(load_campaign(_write_campaign(tmp_path)), ResultsStore(root))
    assert found.benches[("speed", "desktop")] is None


@pytest.mark.parametrize(("change", "message"), [
    ({"comparisons": [{"name": "x", "a": "nope@desktop", "b": "gemma-qat@desktop"}]},
     "comparison 'x': 'nope@desktop' is no eval target"),
    ({"hosts": ["desktop"]}, "hosts not listed under hosts: laptop"),
    ({"benches": [{"name": "speed", "hosts": ["desktop"], "models": ["mystery"]}]},
     "artifact 'mystery' is not listed under artifacts"),
    ({"benches": [{"name": "speed", "hosts": ["desktop"], "models": ["qwen-q4_0"], "matrix": {"r": 0}}]},
     "benches.0.matrix.r: Input should be greater than or equal to 1"),
    ({"colour": "blue"}, "colour: unknown key"),
    ({"evals": [{"name": "suite", "task": "suite.yaml", "runs": [
        {"host": "desktop", "server": "qwen", "artifact": "qwen-q4_0"},
        {"host": "desktop", "server": "qwen", "artifact": "qwen-q4_0"}]}], "comparisons": []},
     "eval 'suite': target 'qwen-q4_0@desktop' is listed twice (a second run of it is a replicate: replicate: 2)"),
    ({"comparisons": [{"name": "x", "a": "qwen-q4_0@desktop", "b": "gemma-qat@desktop",
                       "replicate": "gemma-qat@desktop"}]},
     "comparison 'x': replicate 'gemma-qat@desktop' is not another run of 'qwen-q4_0@desktop' "
     "(give qwen-q4_0@desktop#2)"),
    # The study's set that the shipped suite lacks: excluding it would leave the suite whole, silently.
    ({"sensitivity": {"exclude": ["choice", "summeval-consistency"]}},
     "sensitivity.exclude: 'summeval-consistency': no such set in the tasks "),
])
def test_bad_campaign_files_name_the_culprit(tmp_path, change, message):
    path = _write_campaign(tmp_path, {**CAMPAIGN, **change})
    with pytest.raises(ConfigError, match=f"campaign {path}: .*{message.split(':')[0]}") as info:
        load_campaign(path)
    assert message in str(info.value)


def test_shipped_campaigns_validate():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "campaigns"
    reference = load_campaign(root / "reference.yml").campaign
    assert {b.name for b in reference.benches} >= {"speed-desktop"}
    assert len({t.id for e in reference.evals for t in e.runs}) >= 5
    assert {c.section for c in reference.comparisons} >= {"headline", "quantisation", "qat"}
    lab = load_campaign(root / "lab.yml").campaign
    assert lab.benches[0].models == ["smollm2-135m-q4_1", "smollm2-135m-q4_0"]
    # The 1650 Ti half: every artifact answers every eval on the laptop too, and the same conversion is paired
    # across the hosts.
    for evaluation in reference.evals:
        assert {t.artifact for t in evaluation.runs if t.host == "laptop-1650ti"} == set(reference.artifacts)
    assert ("qwen3.5-2b-q4_0@desktop-3050", "qwen3.5-2b-q4_0@laptop-1650ti") in {
        (c.a, c.b) for c in reference.comparisons}
    assert {(d.host, d.baseline, *d.drafters) for d in reference.drafting} == {
        (host, baseline, drafter) for host in ("desktop-3050", "laptop-1650ti")
        for baseline, drafter in (("qwen-race", "qwen-mtp"), ("gemma-race", "gemma-draft"))}
    # The shipped suite's sets only; the study's third, summeval-consistency, waits for the 13-set suite.
    assert reference.sensitivity.exclude == ["civil_comments", "multinli"]


def test_the_reference_races_run_at_the_studys_context_against_a_baseline_at_the_same():
    """Each race of the reference campaign, as the reference inventory serves it: the baseline and its drafters
    at -c 8192 (the study's MTP race), differing only in spec; the -c 131072 servers are no race's baseline."""
    from pathlib import Path

    from rigctl.bench.drafting import contenders
    from rigctl.inventory import Inventory

    root = Path(__file__).resolve().parents[2]
    inventory = Inventory.load(root / "inventory" / "rigs")
    for race in load_campaign(root / "campaigns" / "reference.yml").campaign.drafting:
        base, *drafters = contenders(inventory.host(race.host), race.baseline, race.drafters)
        assert [d.name for d in drafters] == race.drafters
        for contender in (base, *drafters):
            assert contender.settings["ctx_size"] == 8192, (race.name, contender.name)
        assert all({**d.settings, "spec": None} == {**base.settings, "spec": None} for d in drafters)
    # The old pairing, the 131072 server against the 8192 drafter, is refused, naming the key.
    with pytest.raises(ConfigError, match=r"host desktop-3050: drafter 'qwen-mtp' \(profile rig-mtp\) serves with "
                                          r"ctx_size 8192, the baseline 'qwen' \(profile rig\) with 131072: a "
                                          r"race's contenders may differ only in spec"):
        contenders(inventory.host("desktop-3050"), "qwen", ["qwen-mtp"])


# SmolLM2-135M's shape as the bench task reads it from the GGUF: 30 layers, 3 KV heads of 64.
SHAPE = {"architecture": "llama", "block_count": 30, "embedding_length": 576, "attention.head_count": 9,
         "attention.head_count_kv": 3}


def _manifest(weights: int) -> dict:
    return {"manifest": {"types": {"q4_0": {"tensors": 200, "bytes": weights - 10_000_000},
                                   "f32": {"tensors": 60, "bytes": 10_000_000}}}, "gguf": SHAPE}


def test_tg_above_the_bandwidth_bound_is_flagged_not_printed(tmp_path):
    from rigctl.bench.bandwidth import decode_bound

    root = tmp_path / "results"
    cells = []
    for depth in (0, 4096):
        # qwen at 133 t/s reading 2 GB a token through 224 GB/s: above the ~112 t/s bound, impossible.
        cells.append(("qwen-q4_0", [bench_record((0, 128), [133.0 - depth / 1000, 131.0, 130.0], depth=depth)]))
        cells.append(("gemma-qat", [bench_record((0, 128), [118.0 - depth / 1000, 116.0, 115.0], depth=depth)]))
    # A third gemma cell ran throttled: slower, and left out of its mean.
    cells.append(("gemma-qat", [bench_record((0, 128), [60.0, 58.0, 57.0])]))
    matrix = {**Matrix().flags(), "n": [128], "p": [0], "d": [0, 4096]}
    bench_run(root, "desktop", "bench-bw", cells, matrix=matrix, gpu={"name": "RTX 3050", "bandwidth_gbs": 224},
              artifacts={"qwen-q4_0": _manifest(2_000_000_000), "gemma-qat": _manifest(1_500_000_000)},
              throttled={5: ["reason hw_thermal_slowdown"]})
    campaign = {**CAMPAIGN, "benches": [{"name": "speed", "hosts": ["desktop"], "models": ["qwen-q4_0", "gemma-qat"],
                                         "matrix": {"n": [128], "p": [0], "d": [0, 4096]}}],
                "evals": CAMPAIGN["evals"][:1], "comparisons": [], "drafting": []}
    report = build_report(load_campaign(_write_campaign(tmp_path, campaign)), ResultsStore(root), tmp_path / "out")
    checked = check_report(report.path)
    assert checked["impossible"] == 2 and checked["speed"] == 2  # qwen's two figures; gemma's recomputed
    text = report.markdown
    (main, depth, bound) = [rows for section, heading, rows in tables(text) if heading == "speed on desktop"]
    qwen = [r for r in main if r["test"] == "tg128"][0]
    assert qwen["Qwen Q4_0 t/s"].startswith("[impossible") and "133" not in qwen["Qwen Q4_0 t/s"]
    gemma = [r for r in main if r["test"] == "tg128"][0]["Gemma QAT t/s"]
    assert gemma.endswith("(1 throttled cell left out)") and gemma.startswith("[116.33 ± 1.53]")
    assert "- desktop/bench-bw cell 5 (gemma-qat): reason hw_thermal_slowdown" in text
    by = {(r["test"], r["model"]): r for r in bound}
    assert by[("tg128", "Qwen Q4_0")]["t/s"] == "-"
    assert "IMPOSSIBLE: 1" in by[("tg128", "Qwen Q4_0")]["share of the bound"]
    # Recomputed by hand: 1.5 GB of weights + 30 x 3 x (64 + 64) x 2 bytes of KV per token x 64 tokens.
    kv = 30 * 3 * 128 * 2
    expected = (116 + 1 / 3) / (224e9 / (1.5e9 + kv * 64))
    assert f"{expected:.1%}" in by[("tg128", "Gemma QAT")]["share of the bound"]
    assert decode_bound(116.0, bandwidth_gbs=224, artifact=_manifest(1_500_000_000),
                        entry={"n_gen": 128, "n_depth": 4096, "n_gpu_layers": 99}).kv_bytes_per_token == kv
    # The depth table: both depths side by side, and the first model's lead at each.
    assert [r["model"] for r in depth] == ["Qwen Q4_0", "Gemma QAT", "Qwen Q4_0 / Gemma QAT"]
    assert depth[1]["d4096"].startswith("[114.97]")  # (113.904 + 116 + 115) / 3
    assert {c.name for c in report.charts} >= {"depth-speed-desktop.png", "speed-speed-desktop.png"}


def test_cpu_runs_and_rigs_without_a_bandwidth_give_no_figure(tmp_path):
    root = tmp_path / "results"
    cells = [("qwen-q4_0", [bench_record((0, 128), [20.0, 19.0], ngl=0)]),
             ("gemma-qat", [bench_record((0, 128), [18.0, 17.0], ngl=0)])]
    bench_run(root, "desktop", "bench-cpu", cells, matrix={**Matrix().flags(), "n": [128], "p": [0], "ngl": [0]},
              artifacts={"qwen-q4_0": _manifest(2_000_000_000), "gemma-qat": _manifest(1_500_000_000)})
    campaign = {**CAMPAIGN, "benches": [{"name": "speed", "hosts": ["desktop"], "models": ["qwen-q4_0", "gemma-qat"],
                                         "matrix": {"n": [128], "p": [0], "ngl": [0]}}],
                "evals": CAMPAIGN["evals"][:1], "comparisons": [], "drafting": []}
    report = build_report(load_campaign(_write_campaign(tmp_path, campaign)), ResultsStore(root), tmp_path / "out")
    assert ("Bandwidth bound: no bandwidth figure (the inventory gives this GPU no gpu_host_gpu.bandwidth_gbs)."
            in report.markdown)
    assert check_report(report.path)["speed"] == 2


def test_hostile_records_in_the_store_leave_the_report_as_it_was(tmp_path, results, caplog):
    loaded = load_campaign(_write_campaign(tmp_path))
    clean = build_report(loaded, ResultsStore(results), tmp_path / "clean").markdown
    for name, text in (("deep", "[" * 200_000 + "]" * 200_000), ("digits", '{"seed": ' + "9" * 5001 + "}")):
        run_dir = results / "laptop" / f"eval-{name}"
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(text)
    with caplog.at_level(logging.WARNING):
        hostile = build_report(loaded, ResultsStore(results), tmp_path / "hostile").markdown
    assert hostile == clean
    assert "eval-deep" in caplog.text and "eval-digits" in caplog.text


@pytest.mark.parametrize("victim", ["bench", "eval", "spec"])
def test_a_run_whose_files_cannot_be_read_is_left_out_and_named(tmp_path, results, caplog, victim):
    run_dir, raw = {"bench": (results / "desktop" / "bench-1", "cells.jsonl"),
                    "eval": (results / "desktop" / "eval-g", "answers.jsonl"),
                    "spec": (results / "desktop" / "spec-1", "requests.jsonl")}[victim]
    (run_dir / raw).write_text("[" * 100_000 + "]" * 100_000 + "\n" if victim != "spec" else '{"surprise": 1}\n')
    with caplog.at_level(logging.WARNING):
        report = build_report(load_campaign(_write_campaign(tmp_path)), ResultsStore(results), tmp_path / "out")
    scope = next(line for line in report.markdown.splitlines() if line.startswith("**Scope.**"))
    assert f"Left out, their files unreadable: desktop/{run_dir.name} (" in scope
    assert f"report: leaving out desktop/{run_dir.name}" in caplog.text
    # Every section is there; the victim's own reads as not pulled.
    assert all(f"## {section}" in report.markdown for section in ("Speed", "Quality", "Drafting"))
    own = {"bench": "### speed on desktop", "eval": "Not pulled yet: eval suite gemma-qat@desktop",
           "spec": "### mtp on desktop"}[victim]
    assert own in report.markdown
    if victim != "eval":
        assert report.markdown.split(own)[1].lstrip().startswith("Nothing pulled yet.")


def test_gsm8k_quality_shows_each_score_by_name(tmp_path, results):
    """A GSM8K run's rows carry lm-eval's two scores: the quality table has a named column for each (their
    numbers recomputed from the answers), and the sensitivity table their gaps."""
    for run in ("eval-q", "eval-g"):
        path = results / "desktop" / run / "answers.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for i, row in enumerate(rows):
            row["lmeval_strict_match"] = row["score"] if i % 3 else 0
            row["lmeval_flexible_extract"] = row["score"]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = build_report(load_campaign(_write_campaign(tmp_path)), ResultsStore(results), tmp_path / "out")
    checked = check_report(report.path)
    assert checked["quality"] == 2 * (3 + 3)  # per run: three sets and the three named overall scores
    (quality,) = [rows for section, _, rows in tables(report.markdown) if section == "Quality"]
    assert {"overall (rigctl normalised)", "overall (lm-eval strict-match)",
            "overall (lm-eval flexible-extract)"} <= set(quality[0])
    (sensitivity,) = [rows for section, _, rows in tables(report.markdown) if section == "Sensitivity"]
    labels = [row["scoring"] for row in sensitivity]
    assert labels[-2:] == ["lm-eval strict-match", "lm-eval flexible-extract"]


def test_a_run_that_departs_from_its_instruments_request_is_named(tmp_path, results):
    path = results / "desktop" / "eval-q" / "run.json"
    record = json.loads(path.read_text())
    record["extra"]["deviations"] = {"from": "BFCL's own request", "settings": ["max_tokens 16 (BFCL: no limit)"],
                                     "reason": "the lab rigs share two CPU cores"}
    path.write_text(json.dumps(record))
    report = build_report(load_campaign(_write_campaign(tmp_path)), ResultsStore(results), tmp_path / "out")
    quality = report.markdown.split("## Quality", 1)[1].split("\n## ", 1)[0]
    (line,) = [line for line in quality.splitlines() if line.startswith("**Not")]
    assert line.startswith("**Not BFCL's own request**: max_tokens 16 (BFCL: no limit). "
                           "Why: the lab rigs share two CPU cores. ([run record](")
    assert "eval-g" not in line


def test_each_gsm8k_number_says_which_request_produced_it(tmp_path, results):
    lmeval = {"name": "lm-eval", "reproduces": "lm-eval 0.4.13 gsm8k", "num_fewshot": 5, "fewshot_as_multiturn": True,
              "fewshot_seed": 1234, "stop": ["Question:", "</s>", "<|im_end|>"], "max_tokens": 256}
    for run, request in (("eval-q", lmeval), ("eval-g", None)):  # eval-g: a record from before requests were stamped
        path = results / "desktop" / run / "run.json"
        record = json.loads(path.read_text())
        record["task"].update(scorer="gsm8k", request=request, instruments={"lm-eval": "0.4.13"})
        path.write_text(json.dumps(record))
    report = build_report(load_campaign(_write_campaign(tmp_path)), ResultsStore(results), tmp_path / "out")
    quality = report.markdown.split("## Quality", 1)[1].split("\n## ", 1)[0]
    ours, theirs = ([line for line in quality.splitlines() if line.startswith(f"**Request: {who}")]
                    for who in ("rigctl", "lm-eval"))
    assert len(ours) == len(theirs) == 1
    assert theirs[0].startswith("**Request: lm-eval 0.4.13 gsm8k's own** (5-shot as chat turns, stop Question:, "
                                "</s>, <|im_end|>, 256 tokens); the lm-eval columns are its scores (lm-eval 0.4.13)")
    assert "eval-q" in theirs[0] and "eval-g" not in theirs[0]
    assert "do not compare with lm-eval's published gsm8k numbers" in ours[0] and "eval-g" in ours[0]


def test_a_replicate_pair_sets_its_disagreement_beside_the_ab_difference(tmp_path, results):
    """The same artifact twice: locate gives each replicate its own run, and the head-to-head table sets
    the replicate's disagreement and gap beside the A/B difference (recomputed here from the answers)."""
    rows = [json.loads(line) for line in (results / "desktop" / "eval-q" / "answers.jsonl").read_text().splitlines()]
    for row in rows[:4]:
        row["score"] = 1 - row["score"]  # a second run of Qwen Q4_0 that differs on four questions
    eval_run(results, "desktop", "eval-q2", "qwen-q4_0", rows, started="2026-11-29T11:00:00.000000Z")
    second = {"host": "desktop", "server": "qwen", "artifact": "qwen-q4_0", "replicate": 2}
    data = {**CAMPAIGN, "evals": [{**CAMPAIGN["evals"][0], "runs": [*CAMPAIGN["evals"][0]["runs"], second]}],
            "comparisons": [{**CAMPAIGN["comparisons"][0], "replicate": "qwen-q4_0@desktop#2"}]}
    loaded = load_campaign(_write_campaign(tmp_path, data))
    found = locate(loaded, ResultsStore(results))
    assert found.evals[("suite", "qwen-q4_0@desktop")].id == "eval-q2"  # the newest answers the first
    assert found.evals[("suite", "qwen-q4_0@desktop#2")].id == "eval-q"
    report = build_report(loaded, ResultsStore(results), tmp_path / "out")
    (head,) = [rows for section, _, rows in tables(report.markdown) if section == "Head to head"]
    row = head[0]
    assert row["replicate disagrees"].startswith("[0.033 (")  # 4 of 120
    gemma = {(r["set"], r["id"]): r["score"] for r in
             (json.loads(line) for line in (results / "desktop" / "eval-g" / "answers.jsonl").read_text().splitlines())}
    apart = sum(gemma[(r["set"], r["id"])] != r["score"] for r in rows) / len(rows)
    assert row["A/B disagree"].startswith(f"[{apart:.3f} (")
    assert row["replicate gap, points"].startswith("[")
    assert "within replicate noise" not in row["verdict"]  # B is right on 36 more: far beyond
    assert "Qwen Q4_0 replicate 2" in report.markdown


def test_pulled_steps_heads_every_step_and_yields_only_those_with_a_run(tmp_path):
    from types import SimpleNamespace

    from rigctl.analysis.report.markdown import NOT_PULLED, pulled_steps
    from rigctl.results.store import StoredRun

    first, second, third = (SimpleNamespace(name=n, host="desktop") for n in ("a", "b", "c"))
    run = StoredRun("desktop", tmp_path, None)  # type: ignore[arg-type]
    lines = ["## Section", ""]
    yielded = []
    for step, found in pulled_steps(lines, [first, second, third], {"a": run, "b": None},
                                    lambda s: f"{s.name} on {s.host}"):
        yielded.append((step.name, found))
        lines.append(f"body of {step.name}")
    assert yielded == [("a", run)]
    # b is located but not pulled, c not even located: both read as not pulled, in the steps' order.
    assert lines == ["## Section", "", "### a on desktop", "", "body of a", "### b on desktop", "", NOT_PULLED, "",
                     "### c on desktop", "", NOT_PULLED, ""]


def _pyplot_figure(nrows=1, ncols=1, *, figsize, squeeze=True):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=figsize, squeeze=squeeze)


def _pyplot_save(figure, path, dpi=110):
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def test_charts_drawn_without_pyplot_are_the_bytes_pyplot_drew(tmp_path, results, monkeypatch):
    """rigctl.charts makes its figures without pyplot and has savefig draw once: the report's files (charts,
    flips, Markdown) are byte for byte those of the pyplot way, tight_layout and two draws, it replaced."""
    import rigctl.analysis.report.quality
    import rigctl.analysis.report.speed

    loaded = load_campaign(_write_campaign(tmp_path))
    drawn = build_report(loaded, ResultsStore(results), tmp_path / "drawn")
    for module in (rigctl.analysis.report.speed, rigctl.analysis.report.quality):
        monkeypatch.setattr(module, "new_figure", _pyplot_figure)
        monkeypatch.setattr(module, "save_png", _pyplot_save)
    before = build_report(loaded, ResultsStore(results), tmp_path / "before")
    assert [c.name for c in drawn.charts] == [c.name for c in before.charts] and len(drawn.charts) == 3
    files = sorted(p.name for p in (tmp_path / "drawn").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "before").iterdir()) and "report.md" in files
    for name in files:
        assert (tmp_path / "drawn" / name).read_bytes() == (tmp_path / "before" / name).read_bytes(), name
