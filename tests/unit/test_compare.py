"""compare on hand-made runs: refusal of different tasks, paired gaps, sensitivity switches, habits, bench ratios."""

from __future__ import annotations

import json

import numpy as np
import pytest
from handmade_runs import bench_record, bench_run, eval_run

from rigctl.analysis.compare import compare_runs
from rigctl.analysis.format import points
from rigctl.analysis.habits import answer_habits
from rigctl.analysis.speed import compare_bench_runs
from rigctl.errors import ConfigError
from rigctl.results.store import ResultsStore


def _rows(correct: dict[str, list[int]], *, cutoff: set[int] = frozenset(), toolless: set[int] = frozenset(),
          missed: set[int] = frozenset(), preds: list[str] | None = None) -> list[dict]:
    """Rows for sets ``choice`` (pred/gold), ``math`` (cut-offs) and ``tools`` (tool-less replies)."""
    rows = []
    for set_name, scores in correct.items():
        for i, score in enumerate(scores):
            row = {"id": f"q{i}", "set": set_name, "score": score, "cutoff": False}
            if set_name == "math":
                row["cutoff"] = i in cutoff
            if set_name == "tools":
                row["toolless"] = i in toolless
                row["missed_call"] = i in missed
            if set_name == "choice":
                row["gold"] = "yes" if i % 2 else "no"
                row["pred"] = preds[i] if preds else row["gold"] if score else ("no" if i % 2 else "yes")
            rows.append(row)
    return rows


@pytest.fixture
def store(tmp_path):
    # A: weaker. 40 questions per set. B is right wherever A is, plus more.
    a = _rows({"choice": [1] * 20 + [0] * 20, "math": [1] * 10 + [0] * 30, "tools": [1] * 15 + [0] * 25},
              cutoff=set(range(10, 30)), toolless=set(range(15, 35)), missed={15, 16},
              preds=["yes"] * 40)
    b = _rows({"choice": [1] * 36 + [0] * 4, "math": [1] * 20 + [0] * 20, "tools": [1] * 25 + [0] * 15},
              cutoff=set(range(20, 24)), toolless=set(range(25, 28)))
    eval_run(tmp_path, "desktop", "eval-a", "qwen-q4_0", a)
    eval_run(tmp_path, "desktop", "eval-b", "gemma-qat", b)
    return ResultsStore(tmp_path)


def test_paired_gap_per_set_and_overall(store):
    result = compare_runs([store.find("eval-a"), store.find("eval-b")], seed=1)
    pair = result.pairs[0]
    gaps = {g.set: g for g in pair.recorded.sets}
    assert gaps["choice"].score_a == 0.5 and gaps["choice"].score_b == 0.9
    assert gaps["choice"].gap.estimate == pytest.approx(0.4)
    assert gaps["math"].gap.estimate == pytest.approx(0.25)
    assert gaps["tools"].gap.estimate == pytest.approx(0.25)
    overall = pair.recorded.overall
    assert overall.n == 120 and overall.gap.estimate == pytest.approx(0.9 / 3)
    assert overall.gap.low > 0.2 and overall.gap.high < 0.4 and overall.gap.method == "counts"
    assert points(overall.gap).startswith("+30.0 (")
    assert pair.only_a == pair.only_b == 0 and pair.forced is None
    assert len(pair.variants) == 1  # no switches: as recorded only
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    overall_dict = data["pairs"][0]["variants"][0]["overall"]
    assert overall_dict["n"] == 120 and overall_dict["gap"]["estimate"] == pytest.approx(0.3)
    assert data["runs"][0]["path"].endswith("desktop/eval-a")


def test_switches_move_the_gap_the_expected_way(store):
    runs = [store.find("desktop/eval-a"), store.find("desktop/eval-b")]
    pair = compare_runs(runs, cutoff_as_right=True, toolless_as_right=True, exclude=["choice"]).pairs[0]
    by_label = {v.label: v for v in pair.variants}
    assert list(by_label) == ["as recorded", "cut-off as right", "tool-less as right", "without choice",
                              "cut-off as right + tool-less as right + without choice"]
    recorded = by_label["as recorded"].overall.gap.estimate
    # A has 20 wrong cut-off replies (B: 4) and 20 wrong tool-less replies (B: 3): crediting them favours A.
    cut = by_label["cut-off as right"]
    assert cut.overall.gap.estimate < recorded
    assert {g.set: g.score_a for g in cut.sets}["math"] == pytest.approx(30 / 40)
    assert {g.set: g.score_b for g in cut.sets}["math"] == pytest.approx(24 / 40)
    tools = by_label["tool-less as right"]
    assert tools.overall.gap.estimate < recorded
    assert {g.set: g.gap.estimate for g in tools.sets}["tools"] == pytest.approx((28 - 35) / 40)
    # Dropping the set where B leads most shrinks the gap and the question count.
    without = by_label["without choice"]
    assert without.overall.n == 80 and "choice" not in {g.set for g in without.sets}
    assert without.overall.gap.estimate == pytest.approx(0.25)
    assert without.overall.gap.estimate < recorded
    everything = by_label["cut-off as right + tool-less as right + without choice"]
    assert everything.overall.gap.estimate < min(cut.overall.gap.estimate, without.overall.gap.estimate)


def test_refuses_runs_of_different_tasks_unless_forced(tmp_path):
    rows = _rows({"math": [1, 0, 1]})
    eval_run(tmp_path, "desktop", "eval-x", "m", rows, task="gsm8k")
    eval_run(tmp_path, "laptop", "eval-y", "m", rows, task="gsm8k", file_sha256="b" * 64)
    eval_run(tmp_path, "laptop", "eval-z", "m", rows, task="gsm8k", dataset_sha256="e" * 64)
    store = ResultsStore(tmp_path)
    x, y, z = store.find("eval-x"), store.find("eval-y"), store.find("eval-z")
    with pytest.raises(ConfigError, match=r"refusing to compare: different task files: desktop/eval-x ran gsm8k"):
        compare_runs([x, y])
    with pytest.raises(ConfigError, match=r"different datasets for task gsm8k: desktop/eval-x has sha256 dddd"):
        compare_runs([x, z])
    forced = compare_runs([x, y], force=True).pairs[0]
    assert forced.forced and "different task files" in forced.forced
    assert forced.recorded.overall.gap.estimate == 0.0


def test_refuses_bench_runs_and_single_or_repeated_runs(tmp_path, store):
    bench_run(tmp_path, "desktop", "bench-1", [("m", [bench_record((512, 0), [10.0, 11.0])])])
    with pytest.raises(ConfigError, match="bench-1 is a bench run, not an eval run"):
        compare_runs([store.find("eval-a"), store.find("bench-1")])
    with pytest.raises(ConfigError, match="at least two runs"):
        compare_runs([store.find("eval-a")])
    with pytest.raises(ConfigError, match="given twice: desktop/eval-a"):
        compare_runs([store.find("eval-a"), store.find("eval-a")])


def test_unpaired_questions_are_counted_and_left_out(tmp_path):
    eval_run(tmp_path, "h", "eval-1", "m", _rows({"math": [1, 1, 0, 0]}))
    eval_run(tmp_path, "h", "eval-2", "m", _rows({"math": [1, 1]}))
    store = ResultsStore(tmp_path)
    pair = compare_runs([store.find("eval-1"), store.find("eval-2")]).pairs[0]
    assert (pair.only_a, pair.only_b, pair.recorded.overall.n) == (2, 0, 2)


def test_matrix_of_three_runs_is_antisymmetric(store, tmp_path):
    eval_run(tmp_path, "laptop", "eval-c", "qwen-bf16",
             _rows({"choice": [1] * 30 + [0] * 10, "math": [1] * 15 + [0] * 25, "tools": [1] * 20 + [0] * 20}))
    result = compare_runs([store.find("eval-a"), store.find("eval-b"), store.find("eval-c")])
    assert len(result.pairs) == 3
    grid = result.matrix()
    assert grid[0][0] is None
    for i in range(3):
        for j in range(3):
            if i != j:
                assert grid[i][j].gap.estimate == pytest.approx(-grid[j][i].gap.estimate)
                assert grid[i][j].gap.low == pytest.approx(-grid[j][i].gap.high)
    assert grid[0][1].gap.estimate == pytest.approx(0.3)  # B - A
    assert grid[1][2].gap.estimate == pytest.approx((65 - 81) / 120)  # C - B


def test_habits_count_labels_cutoffs_and_missed_calls(store):
    habits = {h.set: h for h in answer_habits(store.find("eval-a")).sets}
    choice = habits["choice"]
    assert choice.predicted == {"yes": 40} and choice.gold == {"no": 20, "yes": 20}
    assert choice.top_label == ("yes", 40)
    assert habits["math"].cutoff == 20 and habits["math"].cutoff_share == 0.5
    tools = habits["tools"]
    assert (tools.tool_rows, tools.toolless, tools.missed_calls) == (40, 20, 2)
    assert tools.toolless_share == 0.5
    assert np.isnan(habits["math"].toolless_share)


def test_bench_ratio_of_two_models_in_one_alternating_run(tmp_path):
    rng = np.random.default_rng(0)
    cells = []
    for _ in range(2):  # two alternations: A cell, B cell
        cells.append(("qwen", [bench_record((512, 0), list(5000 + rng.normal(0, 20, 5))),
                               bench_record((0, 128), list(130 + rng.normal(0, 1, 5)))]))
        cells.append(("gemma", [bench_record((512, 0), list(4000 + rng.normal(0, 20, 5))),
                                bench_record((0, 128), list(120 + rng.normal(0, 1, 5)))]))
    bench_run(tmp_path, "desktop", "bench-ab", cells)
    result = compare_bench_runs([ResultsStore(tmp_path).find("bench-ab")])
    assert (result.a, result.b) == ("gemma", "qwen")
    ratios = {r.test: r for r in result.ratios}
    assert set(ratios) == {"pp512", "tg128"}
    pp = ratios["pp512"]
    qwen = [x for _, recs in cells[0::2] for x in recs[0]["samples_ts"]]
    gemma = [x for _, recs in cells[1::2] for x in recs[0]["samples_ts"]]
    assert pp.ratio.estimate == pytest.approx(np.mean(qwen) / np.mean(gemma))
    assert pp.ratio.low < pp.ratio.estimate < pp.ratio.high and pp.ratio.excludes(1.0)
    assert 1.2 < pp.ratio.estimate < 1.3
    assert pp.files == tuple(f"desktop/bench-ab/llama-bench/cell-{i:03d}-{m}.json"
                             for i, m in [(1, "qwen"), (2, "gemma"), (3, "qwen"), (4, "gemma")])
    assert all((tmp_path / f).is_file() for f in pp.files)


def test_bench_ratio_of_two_builds_keeps_settings_apart(tmp_path):
    bench_run(tmp_path, "desktop", "bench-old", [("q", [bench_record((512, 0), [100.0, 102.0, 98.0], commit="aaa"),
                                                        bench_record((512, 0), [90.0, 91.0], commit="aaa", fa=0)])],
              commit="aaa")
    bench_run(tmp_path, "desktop", "bench-new", [("q", [bench_record((512, 0), [110.0, 112.0, 108.0], commit="bbb")])],
              commit="bbb")
    store = ResultsStore(tmp_path)
    runs = [store.find("bench-old"), store.find("bench-new")]
    by_run = compare_bench_runs(runs)
    (only,) = by_run.ratios  # fa=0 exists on one side only
    assert only.ratio.estimate == pytest.approx(1.1) and only.flash_attn == 1
    by_build = compare_bench_runs(runs, by="build")
    assert (by_build.a, by_build.b) == ("aaa", "bbb") and by_build.ratios[0].ratio.estimate == pytest.approx(1.1)
    with pytest.raises(ConfigError, match="exactly two models, found 1"):
        compare_bench_runs(runs, by="model")


def test_answers_without_required_keys_name_the_file(tmp_path):
    run_dir = eval_run(tmp_path, "h", "eval-bad", "m", [{"id": "q0", "set": "s"}])
    eval_run(tmp_path, "h", "eval-ok", "m", _rows({"s": [1]}))
    store = ResultsStore(tmp_path)
    with pytest.raises(ConfigError, match=f"{run_dir}/answers.jsonl: answer 1 lacks score"):
        compare_runs([store.find("eval-bad"), store.find("eval-ok")])
    assert json.loads((run_dir / "answers.jsonl").read_text())["id"] == "q0"


# ----------------------------------------------------------------------------------------------- exact tests, flips


def test_pairs_carry_mcnemar_flips_and_the_detectable_gap(store):
    pair = compare_runs([store.find("eval-a"), store.find("eval-b")], margin=2).pairs[0]
    overall = pair.recorded.overall
    # B is right wherever A is, plus 36 more: b = 0, c = 36, McNemar p = 2 / 2**36.
    assert (overall.test.method, overall.test.b, overall.test.c) == ("mcnemar-exact", 0, 36)
    assert overall.test.p == pytest.approx(2 / 2 ** 36)
    assert overall.verdict() == "different" and not overall.equivalence.equivalent
    assert 0.05 < overall.detectable < 0.2
    assert [f.direction for f in pair.flips] == ["wrong→right"] * 36
    by_set = {g.set: g for g in pair.recorded.sets}
    assert sum(f.set == "choice" for f in pair.flips) == by_set["choice"].test.c == 16
    mirrored = compare_runs([store.find("eval-b"), store.find("eval-a")]).pairs[0]
    assert (mirrored.recorded.overall.test.b, mirrored.recorded.overall.test.c) == (36, 0)
    assert all(f.direction == "right→wrong" for f in mirrored.flips)


def test_flips_keep_both_replies(tmp_path):
    from rigctl.analysis.compare import flip_counts

    a = [{"id": "q1", "set": "math", "score": 1, "reply": "#### 72"},
         {"id": "q2", "set": "math", "score": 0, "reply": "I think 5"},
         {"id": "q3", "set": "tools", "score": 1, "reply": "", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]},
         {"id": "q4", "set": "choice", "score": 0, "pred": "no", "gold": "yes"}]
    b = [{"id": "q1", "set": "math", "score": 0, "reply": "#### 71"},
         {"id": "q2", "set": "math", "score": 0, "reply": "still 5"},
         {"id": "q3", "set": "tools", "score": 0, "reply": "f(x=1)", "tool_calls": []},
         {"id": "q4", "set": "choice", "score": 1, "pred": "yes", "gold": "yes"}]
    eval_run(tmp_path, "desktop", "eval-a", "m1", a)
    eval_run(tmp_path, "laptop", "eval-b", "m1", b)
    store = ResultsStore(tmp_path)
    pair = compare_runs([store.find("desktop/eval-a"), store.find("laptop/eval-b")]).pairs[0]
    flips = {f.id: f for f in pair.flips}
    assert set(flips) == {"q1", "q3", "q4"}
    assert (flips["q1"].reply_a, flips["q1"].reply_b, flips["q1"].direction) == ("#### 72", "#### 71", "right→wrong")
    assert json.loads(flips["q3"].reply_a) == [{"name": "f", "arguments": {"x": 1}}] and flips["q3"].reply_b == "f(x=1)"
    assert (flips["q4"].reply_a, flips["q4"].reply_b, flips["q4"].direction) == ("label no", "label yes", "wrong→right")
    counts = {c.set: (c.right_to_wrong, c.wrong_to_right) for c in flip_counts(pair.flips)}
    assert counts == {"choice": (0, 1), "math": (1, 0), "tools": (1, 0), "overall": (2, 1)}


def test_graded_scores_get_the_sign_flip_test(tmp_path):
    rng = np.random.default_rng(3)
    base = rng.random(60)
    a = [{"id": f"q{i}", "set": "s", "score": float(x)} for i, x in enumerate(base)]
    b = [{"id": f"q{i}", "set": "s", "score": float(min(1.0, x + 0.1))} for i, x in enumerate(base)]
    eval_run(tmp_path, "desktop", "eval-a", "m", a)
    eval_run(tmp_path, "desktop", "eval-b", "m", b)
    store = ResultsStore(tmp_path)
    overall = compare_runs([store.find("eval-a"), store.find("eval-b")], margin=20).pairs[0].recorded.overall
    assert overall.test.method == "sign-flip" and overall.test.b is None and overall.test.p < 0.001
    assert overall.equivalence.equivalent  # every gap is at most 0.1, well inside ±20 points
    assert overall.verdict() == "equivalent"


def test_holm_across_the_pairs_of_a_matrix(store, tmp_path):
    c_rows = json.loads(json.dumps(_rows({"choice": [1] * 21 + [0] * 19, "math": [1] * 10 + [0] * 30,
                                          "tools": [1] * 15 + [0] * 25})))
    eval_run(tmp_path, "desktop", "eval-c", "m3", c_rows)
    result = compare_runs([store.find("eval-a"), store.find("eval-b"), store.find("eval-c")])
    raw = [p.recorded.overall.test.p for p in result.pairs]
    assert len(result.holm) == 3 and all(h >= r for h, r in zip(result.holm, raw, strict=True))
    smallest = int(np.argmin(raw))
    assert result.holm[smallest] == pytest.approx(min(1.0, 3 * raw[smallest]))


def test_bad_equivalence_margin_is_refused(store):
    with pytest.raises(ConfigError, match="equivalence margin 0"):
        compare_runs([store.find("eval-a"), store.find("eval-b")], margin=0)


def test_compare_cli_flips_margin_and_plan(store):
    from benchlab import rigctl

    done = rigctl("compare", "desktop/eval-a", "desktop/eval-b", "--flips", "--equivalence-margin", "2", "--plan",
                  results=store.root)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "0 / 36" in out and "p (exact)" in out and "±2 points" in out and "different" in out
    assert "flips, desktop/eval-a → desktop/eval-b" in out and "wrong→right" in out
    assert "smallest gap detectable at 80 % power" in out and "36 (30%)" in out
    bad = rigctl("compare", "desktop/eval-a", "desktop/eval-b", "--equivalence-margin", "-1", results=store.root)
    assert bad.returncode != 0 and "error:" in bad.stderr and "equivalence margin" in bad.stderr


def test_flipped_replies_are_shown_as_text(tmp_path):
    """A reply is what a model said: markup in it is not read, and a terminal escape is shown, not sent."""
    from benchlab import rigctl

    a = [{"id": "q1", "set": "math", "score": 1, "reply": "[/] closes nothing [bold]"},
         {"id": "q2", "set": "math", "score": 0, "reply": "clear \x1b[2J\x1b]0;owned\x07 done"}]
    b = [{"id": "q1", "set": "math", "score": 0, "reply": ":skull: 41"},
         {"id": "q2", "set": "math", "score": 1, "reply": "42"}]
    eval_run(tmp_path, "desktop", "eval-a", "m1", a)
    eval_run(tmp_path, "desktop", "eval-b", "m1", b)
    done = rigctl("compare", "desktop/eval-a", "desktop/eval-b", "--flips", results=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[/] closes nothing [bold]" in done.stdout and ":skull: 41" in done.stdout
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "clear \\x1b[2J\\x1b]0;owned\\x07 done" in done.stdout


def test_gsm8k_pairs_carry_lm_evals_scores_by_name(tmp_path):
    from rigctl.hostside.scorers import score_gsm8k

    answer = "4 * 250 = <<4*250=1000>>1000\n#### 1000"
    # A writes "#### 1,000" (every score reads it); B writes "$1000" in prose (lm-eval's strict-match does not).
    a = [{"id": f"q{i}", "set": "gsm8k", **score_gsm8k("#### 1,000", "1000", answer, "stop")} for i in range(30)]
    b = [{"id": f"q{i}", "set": "gsm8k", **score_gsm8k("It costs $1000.", "1000", answer, "stop")}
         for i in range(30)]
    eval_run(tmp_path, "desktop", "eval-a", "q4", a)
    eval_run(tmp_path, "desktop", "eval-b", "q8", b)
    store = ResultsStore(tmp_path)
    pair = compare_runs([store.find("eval-a"), store.find("eval-b")], seed=1).pairs[0]
    gaps = {variant.label: variant.overall.gap.estimate for variant in pair.variants}
    assert gaps == {"as recorded": 0.0, "lm-eval strict-match": -1.0, "lm-eval flexible-extract": 0.0}
    # Rows written before lm-eval's scores were added get no such variants.
    for row in a:
        del row["lmeval_strict_match"]
    eval_run(tmp_path, "desktop", "eval-c", "q4", a)
    old = compare_runs([store.find("eval-c"), store.find("eval-b")], seed=1).pairs[0]
    assert [v.label for v in old.variants] == ["as recorded", "lm-eval flexible-extract"]


def _right_wrong(n: int, wrong: set[int]) -> list[dict]:
    return [{"id": f"q{i}", "set": "math", "score": int(i not in wrong), "cutoff": False} for i in range(n)]


def test_a_replicate_sets_the_noise_of_running_twice_beside_the_gap(tmp_path):
    # A and its replicate disagree on 6 of 200 questions, 3 each way; B is wrong on 37 more than A.
    eval_run(tmp_path, "desktop", "eval-a", "q4_1", _right_wrong(200, set(range(50)) | {60, 61, 62}))
    eval_run(tmp_path, "desktop", "eval-a2", "q4_1", _right_wrong(200, set(range(3, 50)) | {60, 61, 62, 70, 71, 72}))
    eval_run(tmp_path, "desktop", "eval-b", "q4_0", _right_wrong(200, set(range(90)) | {60, 61, 62}))
    eval_run(tmp_path, "desktop", "eval-c", "q4_0", _right_wrong(200, set(range(51)) | {60, 61, 62}))
    store = ResultsStore(tmp_path)
    a, a2 = store.find("eval-a"), store.find("eval-a2")
    far = compare_runs([a, store.find("eval-b")], seed=1, replicate=a2).pairs[0]
    noise = far.replicate
    assert noise.run.id == "eval-a2" and noise.n == 200
    assert noise.disagreement.estimate == pytest.approx(6 / 200)
    assert noise.disagreement.low < 6 / 200 < noise.disagreement.high
    assert noise.gap.estimate == pytest.approx(0.0) and noise.gap.low < 0 < noise.gap.high
    assert far.disagreement.estimate == pytest.approx(37 / 200)
    assert far.recorded.overall.gap.estimate == pytest.approx(-37 / 200) and not far.within_noise
    # One question apart: no larger than two runs of A differ.
    near = compare_runs([a, store.find("eval-c")], seed=1, replicate=a2).pairs[0]
    assert near.within_noise and near.recorded.overall.gap.estimate == pytest.approx(-0.005)
    assert compare_runs([a, store.find("eval-c")], seed=1).pairs[0].replicate is None
    with pytest.raises(ConfigError, match="a replicate goes with two runs"):
        compare_runs([a, store.find("eval-b"), store.find("eval-c")], replicate=a2)


def test_a_replicate_of_another_task_is_refused(tmp_path):
    eval_run(tmp_path, "desktop", "eval-a", "q4_1", _right_wrong(20, set()))
    eval_run(tmp_path, "desktop", "eval-b", "q4_0", _right_wrong(20, {1}))
    eval_run(tmp_path, "desktop", "eval-x", "q4_1", _right_wrong(20, set()), file_sha256="9" * 64)
    store = ResultsStore(tmp_path)
    with pytest.raises(ConfigError, match="refusing the replicate: different task files"):
        compare_runs([store.find("eval-a"), store.find("eval-b")], replicate=store.find("eval-x"))


def test_compare_cli_names_the_replicate_and_its_verdict(tmp_path):
    import subprocess

    from benchlab import RIGCTL

    eval_run(tmp_path, "desktop", "eval-a", "q4_1", _right_wrong(200, set(range(50))))
    eval_run(tmp_path, "desktop", "eval-a2", "q4_1", _right_wrong(200, set(range(2, 52))))
    eval_run(tmp_path, "desktop", "eval-b", "q4_0", _right_wrong(200, set(range(51))))
    done = subprocess.run([*RIGCTL, "compare", "eval-a", "eval-b", "--replicate", "eval-a2", "--results",
                           str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # the console wraps long lines
    said = text[text.index("replicate desktop/eval-a2:"):]
    assert said.startswith("replicate desktop/eval-a2: disagrees with A on 0.020 (") and "of 200 questions" in said
    assert "the A/B gap is within replicate noise" in said


def test_compare_cli_names_each_gsm8k_score(tmp_path):
    import subprocess

    from benchlab import RIGCTL

    from rigctl.hostside.scorers import score_gsm8k

    answer = "4 * 250 = <<4*250=1000>>1000\n#### 1000"
    for run, reply in (("eval-a", "#### 1000"), ("eval-b", "It costs $1000.")):
        eval_run(tmp_path, "desktop", run, "q4", [{"id": f"q{i}", "set": "gsm8k",
                                                   **score_gsm8k(reply, "1000", answer, "stop")} for i in range(10)])
    done = subprocess.run([*RIGCTL, "compare", "eval-a", "eval-b", "--results", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "score rigctl normalised" in text and "and by lm-eval's scores" in text
    assert "lm-eval strict-match" in text and "lm-eval flexible-extract" in text


@pytest.mark.parametrize("bad", ["Infinity", "-Infinity", "NaN", "true"])
def test_a_score_that_is_not_a_finite_number_is_refused_naming_the_answer(tmp_path, bad: str):
    rows = _rows({"math": [1, 0, 1]})
    eval_run(tmp_path, "desktop", "eval-a", "qwen-q4_0", rows)
    run_dir = eval_run(tmp_path, "desktop", "eval-b", "gemma-qat", rows)
    answers = run_dir / "answers.jsonl"
    lines = answers.read_text().splitlines()
    lines[1] = lines[1].replace('"score": 0', f'"score": {bad}')
    answers.write_text("\n".join(lines) + "\n")
    store = ResultsStore(tmp_path)
    with pytest.raises(ConfigError, match=r"answers.jsonl: answer 2: score .* is not a finite number"):
        compare_runs([store.find("desktop/eval-a"), store.find("desktop/eval-b")])
