"""Lab: check template/logits against transformers on SmolLM2, and the lab campaign end to end
(bench + evals on a rig, compare, habits, report) with the report's numbers recomputed from the raw files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from make_hf_checkout import cache_dir, make_checkout, tools_python
from report_check import check_report, tables

from rigctl.forward import server_endpoint
from rigctl.inventory import Inventory
from rigctl.results.store import ResultsStore

pytestmark = [pytest.mark.lab, pytest.mark.hf_checkout]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference():
    """SmolLM2's HF checkout (tokenizer and weights saved from the GGUF) and the tools venv's Python."""
    from rigctl.analysis.runtime_check import HfReference

    cache = cache_dir()
    return HfReference(make_checkout(cache), python=tools_python(cache))


@pytest.fixture
def client(lab_served: Inventory):
    from rigctl.llama_http import ServerClient

    desktop = lab_served.host("desktop")
    with ServerClient(server_endpoint(desktop, desktop.server("smollm2"))) as server:
        yield server


def test_check_template_identical_and_a_different_template_caught(client, reference):
    from rigctl.analysis.runtime_check import BUILTIN_PROMPTS, check_template

    result = check_template(client, reference, BUILTIN_PROMPTS)
    assert len(result.results) == len(BUILTIN_PROMPTS) and any(c.tools for c in BUILTIN_PROMPTS)
    assert result.identical == len(BUILTIN_PROMPTS), [(d.name, d.position) for d in result.differing]
    assert all(r.server.startswith("<|im_start|>") for r in result.results)

    template = (reference.checkout / "chat_template.jinja").read_text()
    altered = template.replace("named SmolLM,", "named SmolLM2,")
    assert altered != template
    caught = check_template(client, reference, BUILTIN_PROMPTS[:3], chat_template=altered)
    # math-system brings its own system prompt, so the altered default never shows there.
    assert caught.identical == 1 and [d.name for d in caught.differing] == ["math-apples", "math-train"]
    for diff in caught.differing:
        marker = "named SmolLM"
        assert diff.position == diff.server.index(marker) + len(marker)
        assert diff.server[diff.position] == "," and diff.reference[diff.position] == "2"


def test_check_logits_agree_with_the_float32_reference(client, reference):
    from rigctl.analysis.runtime_check import BUILTIN_PROMPTS, check_logits

    result = check_logits(client, reference, BUILTIN_PROMPTS[:3], top_k=20)
    assert result.model_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") or "smollm2" in result.model_path.lower()
    assert result.agreement >= 2, result.results
    # Q4_1 against bf16 weights in float32: close, but not the same distribution.
    assert 0.0 < result.mean_kl < 0.05, result.results
    assert all(0.3 < r.server_mass <= 1.0001 for r in result.results)


def test_lab_campaign_end_to_end(lab_served: Inventory, tmp_path: Path):
    from rigctl.analysis.campaign import load_campaign, run_campaign
    from rigctl.analysis.compare import compare_runs
    from rigctl.analysis.habits import answer_habits
    from rigctl.analysis.report import build_report

    loaded = load_campaign(REPO / "campaigns" / "lab.yml")
    store = ResultsStore(tmp_path / "results")
    steps: list[str] = []
    outcomes = run_campaign(loaded, lab_served, store, on_step=steps.append)
    assert [o.status for o in outcomes] == ["ran"] * 11, [(o.step, o.status, o.error) for o in outcomes]
    # The load curve gave its instance back healthy: the evals found it serving and left it so.
    from rigctl.ssh import SshClient, SshTarget

    with SshClient(SshTarget.from_host(lab_served.host("desktop"))) as ssh:
        assert ssh.run("systemctl is-active llama-server@smollm2.service", timeout=30).stdout.strip() == "active"

    # Compare and habits on the pulled runs: Q4_0 against Q4_1 per eval, question by question.
    runs = {(r.record.task.name if r.record.task else r.record.kind) + "/"
            + ",".join(a.name for a in r.record.artifacts): r for r in sorted(store.runs(), key=lambda r: r.id)}
    for task in ("lab-suite", "lab-gsm8k", "lab-bfcl"):
        a, b = runs[f"{task}/smollm2-135m-q4_1"], runs[f"{task}/smollm2-135m-q4_0"]
        pair = compare_runs([a, b], cutoff_as_right=True).pairs[0]
        assert pair.forced is None and pair.only_a == pair.only_b == 0
        assert pair.recorded.overall.n == {"lab-suite": 9, "lab-gsm8k": 3, "lab-bfcl": 3}[task]
        assert pair.recorded.overall.gap.low <= pair.recorded.overall.gap.estimate <= pair.recorded.overall.gap.high
    gsm8k = {s.set: s for s in answer_habits(runs["lab-gsm8k/smollm2-135m-q4_1"]).sets}["lab-gsm8k"]
    assert gsm8k.n == 3 and gsm8k.cutoff >= 1  # SmolLM2 answers in prose: replies hit the 16-token limit
    bfcl = answer_habits(runs["lab-bfcl/smollm2-135m-q4_1"]).sets[0]
    assert bfcl.tool_rows == 3 and bfcl.toolless == 3  # it makes no tool calls
    suite = {s.set: s for s in answer_habits(runs["lab-suite/smollm2-135m-q4_0"]).sets}
    assert sum(suite["boolq"].predicted.values()) == 3 and sum(suite["boolq"].gold.values()) == 3

    report = build_report(loaded, store, tmp_path / "report")
    checked = check_report(report.path)
    assert checked["speed"] == 8 and checked["ratio"] == 4  # pp16 and tg4 at depths 0 and 32, two models
    # Three runs per eval (Q4_1, Q4_0, Q4_1's replicate); suite: 3 sets + overall; gsm8k: rigctl's and lm-eval's
    # two overall scores; bfcl: overall.
    assert checked["quality"] == 3 * (3 + 1) + 3 * 3 + 3
    assert checked["gap"] == 3 and checked["habits"] == 3 * (3 + 1 + 2)
    # b / c with McNemar's p and Holm over the 3 comparisons; flips of 3 + 1 + 1 sets and 3 overall rows, 2 ways.
    assert checked["tests"] == 3 and checked["holm"] == 3 and checked["flips"] == 2 * (5 + 3)
    # The replicate's disagreement and gap stand beside each A/B difference.
    (quantisation,) = [rows for section, _, rows in tables(report.markdown) if section == "Quantisation cost"]
    assert len(quantisation) == 3
    for row in quantisation:
        assert row["replicate disagrees"].startswith("[") and row["A/B disagree"].startswith("[")
        assert row["replicate gap, points"].startswith("[")
    sections = {section for section, _, _ in tables(report.markdown)}
    assert {"Speed", "Quality", "Quantisation cost", "Load", "Sensitivity", "Answer habits", "Runs"} <= sections
    assert "Not pulled yet" not in report.markdown and len(report.charts) == 7  # speed, depth, 3 quality, load, forest
    assert "Smallest gap detectable at 80 % power" in report.markdown
    # The depth sweep, side by side; the CPU rig has no bandwidth figure rather than a made-up one.
    (depth,) = [rows for _, _, rows in tables(report.markdown) if rows and "d32" in rows[0]]
    assert {r["test"] for r in depth} == {"pp16", "tg4"} and all(r["d0"] != "-" and r["d32"] != "-" for r in depth)
    assert "Bandwidth bound: no bandwidth figure (" in report.markdown
    # The load curve: both levels, every request answered, each number from the run's requests.jsonl.
    load = runs["load/smollm2-135m-q4_1"]
    (curve,) = [rows for section, _, rows in tables(report.markdown) if section == "Load"]
    assert [r["concurrency"] for r in curve] == ["1", "2"] and all(r["errors"].startswith("[0]") for r in curve)
    requests = [json.loads(line) for line in (load.path / "requests.jsonl").read_text().splitlines()]
    assert all(r["ok"] and r["tokens"] == 8 and r["ttft_s"] > 0 for r in requests)
    # Each level: its warm-up (a request per client) apart, then 8 to 48 measured requests, the intervals
    # and the machine's load beside it; the interference check's verdict under the table.
    warmups = [json.loads(line) for line in (load.path / "warmup.jsonl").read_text().splitlines()]
    assert [r["level"] for r in warmups] == [1, 2, 2] and [r["warm-up"] for r in curve] == ["1", "2"]
    for level in (1, 2):
        measured = [r for r in requests if r["level"] == level]
        assert 8 <= len(measured) <= 48 + level
    assert all(r["throughput 95 %"] != "-" and r["mean TPOT 95 %"] != "-" and r["machine"].startswith("load ")
               for r in curve)
    assert "Precision asked: ±15% of each estimate at 95 %." in report.markdown
    assert "Interference check: none flagged" in report.markdown or "- **interference**: " in report.markdown
    # The probe that served the curve, as it ran (its /proc cmdline): a slot per client.
    assert load.record.server.flag("--parallel", "-np") == "2" and load.record.server.argv_from.startswith("/proc/")
    assert load.record.server.unit == "rigctl-loadprobe-smollm2"
    assert "Deployed decode against llama-bench" in sections

    # Resumable: a second run finds everything pulled and runs nothing.
    again = run_campaign(loaded, lab_served, store)
    assert [o.status for o in again] == ["pulled"] * 11
