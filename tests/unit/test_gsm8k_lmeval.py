"""rigctl's lm-eval GSM8K scores against lm-eval's own code, on a table of reply variants, for lm-eval's ``gsm8k``
task and for its chat variant ``gsm8k_cot_llama`` (its own table: the same rows plus replies in its format, pinned
in ``data/gsm8k_cot_llama_lmeval_verdicts.json``).

The table crosses answer formats (``#### n``, ``####n``, prose, bullets, ``\\boxed``, a made-up next
question, stop tokens) with renderings of the gold number (``$18.00``, ``18.0``, ``1,8``, ``- 18``, unicode
digits, ...) for four gold answers. ``data/gsm8k_lmeval_verdicts.json`` pins lm-eval 0.4.13's verdicts on
every row, produced by lm-eval's own filters and metric (``python tests/unit/test_gsm8k_lmeval.py`` writes
it again, with lm-eval importable). Where lm-eval is importable the verdicts are recomputed from its
installed code and its ``gsm8k.yaml``; rigctl's scorer is checked against the pins either way. lm-eval is no
dev dependency (its own dependencies bring pandas and pyarrow); to run the recomputation, install it
without them into a scratch directory and put that on ``PYTHONPATH``:
``pip install --target /tmp/lmeval --no-deps lm-eval==0.4.13`` plus ``pip install --target /tmp/lmeval-deps
sacrebleu`` (``lm_eval.api.metrics`` imports it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from rigctl.hostside import scorers

PINS = {"gsm8k": Path(__file__).parent / "data" / "gsm8k_lmeval_verdicts.json",
        "gsm8k_cot_llama": Path(__file__).parent / "data" / "gsm8k_cot_llama_lmeval_verdicts.json"}
TASK_FILES = {"gsm8k": "gsm8k.yaml", "gsm8k_cot_llama": "gsm8k-cot-llama.yaml"}

ANSWERS = {
    "18": "Janet eats 3 and bakes 4: 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\nShe sells them at $2: 9 * 2 = $<<9*2=18>>18 "
          "every day.\n#### 18",
    "1000": "He pays 4 * 250 = <<4*250=1000>>1000 dollars.\n#### 1000",
    "-7": "It starts at 5 and drops by 12: 5 - 12 = <<5-12=-7>>-7.\n#### -7",
    "3.5": "7 / 2 = <<7/2=3.5>>3.5 hours.\n#### 3.5",
}
RENDERINGS = {
    "18": ["18", "18.", "18.0", "18.00", "$18", "$18.00", "$ 18", "1,8", "18,", "- 18", "-18", "+18", "18%",
           "18th", "\uff11\uff18", "\u0661\u0668", "018", "18.5"],
    "1000": ["1000", "1,000", "1.000", "$1,000.00", "1 000", "1000.0", "10,00", "$1000"],
    "-7": ["-7", "- 7", "\u22127", "-7.0", "$-7", "-$7", "7", "negative 7"],
    "3.5": ["3.5", "3.50", "3,5", "$3.5", "3.5.", "7/2", "03.5", "3.05"],
}
TEMPLATES = [
    "#### {n}", "####{n}", "#### {n}.", "####  {n}", "The answer is {n}.", "So she makes {n} dollars a day.",
    "Step 1: 16 - 3 - 4 = 9\nStep 2: 9 * 2 = {n}\n#### {n}", "Total: {n}\n\nQuestion: What about 5 more?\nAnswer: 5",
    "**Answer:** {n}", "\\boxed{{{n}}}", "{n}", "- {n}", "Answer - {n}", "#### {n}\nCheck: 9 * 2 = 18, 3 left",
    "The answer is {n}</s>Then 99", "It is {n} <|im_end|> 7", "#### 12\nNo wait, #### {n}",
]


#: Replies in gsm8k_cot_llama's format (its strict-match reads the last "The final answer is N"), and its stops.
COT_TEMPLATES = [
    "The final answer is {n}", "So 9 * 2 = {n}. The final answer is {n}.", "The final answer is 12. No: the final "
    "answer is {n}", "The final answer is 12. The final answer is {n}", "The final answer is {n}. The final answer "
    "is 12", "The final answer is {n}\nQ: And 5 more?", "The Final Answer is {n}", "the final answer is "
    "{n}", "The final answer is {n}<|eot_id|>The final answer is 7", "The final answer is {n} <|im_end|> 7",
]


def variants(task: str = "gsm8k") -> list[tuple[str, str]]:
    """(reply, answer field) for every template and rendering of each gold; the full cross for gold 18, every
    third template for the others."""
    rows = []
    for gold, answer in ANSWERS.items():
        every = TEMPLATES + (COT_TEMPLATES if task == "gsm8k_cot_llama" else [])
        templates = every if gold == "18" else every[::3]
        rows += [(template.format(n=rendering), answer) for rendering in RENDERINGS[gold] for template in templates]
    rows += [("", ANSWERS["18"]), ("No idea.", ANSWERS["18"]), ("18 18 18", ANSWERS["18"])]
    return rows


def lmeval_verdicts(reply: str, answer: str, task: str = "gsm8k") -> dict[str, Any]:
    """lm-eval's ``task`` on one reply, run by lm-eval's own code: the reply cut at the stop sequences its chat
    body sends (the first four of ``until``, where the server stops), each filter of the task's filter_list and
    the exact_match metric against its ``doc_to_target``, all as its installed task file configures them."""
    import yaml
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter
    from lm_eval.filters.selection import TakeFirstFilter
    from lm_eval.models.utils import postprocess_generated_text
    from lm_eval.utils import apply_template

    config = yaml.safe_load(Path(_lmeval_tasks(), "gsm8k", TASK_FILES[task]).read_text(encoding="utf-8"))
    generated = postprocess_generated_text(reply, stop=config["generation_kwargs"]["until"][:4], think_end_token=None)
    target = apply_template(config["doc_to_target"], {"answer": answer})
    metric = next(m for m in config["metric_list"] if m["metric"] == "exact_match")
    kwargs = {k: metric[k] for k in ("ignore_case", "ignore_punctuation", "regexes_to_ignore")}
    out: dict[str, Any] = {}
    for pipeline in config["filter_list"]:
        steps = {step["function"]: step for step in pipeline["filter"]}
        assert list(steps) == ["regex", "take_first"], pipeline
        regex = RegexFilter(regex_pattern=steps["regex"]["regex_pattern"],
                            group_select=steps["regex"].get("group_select", 0))
        filtered = list(TakeFirstFilter().apply(regex.apply([[generated]], [{}]), [{}]))[0]
        match = exact_match_hf_evaluate(predictions=[filtered], references=[target], **kwargs)["exact_match"]
        out[pipeline["name"]] = {"filtered": filtered, "match": int(match)}
    return out


def _lmeval_tasks() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks"


def rigctl_verdicts(reply: str, answer: str, task: str = "gsm8k") -> dict[str, Any]:
    row = scorers.score_gsm8k(reply, scorers.gsm8k_gold(answer), answer, "stop", task)
    return {"strict-match": {"filtered": row["lmeval_strict"], "match": row["lmeval_strict_match"]},
            "flexible-extract": {"filtered": row["lmeval_flexible"], "match": row["lmeval_flexible_extract"]}}


def _pins(task: str) -> dict[str, Any]:
    return json.loads(PINS[task].read_text(encoding="utf-8"))


@pytest.mark.parametrize("task", list(PINS))
def test_the_table_is_large_and_pinned_row_for_row(task):
    pins, table = _pins(task), variants(task)
    assert pins["lm_eval"] == scorers.LMEVAL_VERSION and pins["task"] == task  # the release the run records name
    assert len(table) >= 200
    assert [(row["reply"], row["answer"]) for row in pins["rows"]] == table
    # The table holds both verdicts, right and wrong, under each filter: it can tell a scorer apart.
    for name in ("strict-match", "flexible-extract"):
        assert {row[name]["match"] for row in pins["rows"]} == {0, 1}


@pytest.mark.parametrize("task", list(PINS))
def test_rigctl_agrees_with_lm_evals_pinned_verdicts_on_every_row(task):
    disagreements = [(row["reply"], row["answer"][-8:], name, row[name], ours[name])
                     for row in _pins(task)["rows"]
                     for ours in [rigctl_verdicts(row["reply"], row["answer"], task)]
                     for name in ("strict-match", "flexible-extract") if ours[name] != row[name]]
    assert not disagreements, disagreements[:10]


@pytest.mark.parametrize("task", list(PINS))
def test_the_pins_are_what_the_installed_lm_eval_says(task):
    pytest.importorskip("lm_eval.filters.extraction", reason="lm-eval not importable (see the module docstring)")
    pytest.importorskip("sacrebleu", reason="lm_eval.api.metrics needs sacrebleu")
    pins = _pins(task)
    mismatches = [(row["reply"], name, row[name], fresh[name]) for row in pins["rows"]
                  for fresh in [lmeval_verdicts(row["reply"], row["answer"], task)]
                  for name in ("strict-match", "flexible-extract") if fresh[name] != row[name]]
    assert not mismatches, mismatches[:10]


def test_rigctl_normalised_score_is_more_lenient_where_it_says():
    """rigctl's own score reads formats lm-eval's regexes do not, and no longer reads a dash as a minus."""
    answer = ANSWERS["18"]
    for reply in ("#### $18", "####18", "#### 18.00", "\uff11\uff18", "Answer - 18", "- 18", "1,8"):
        assert scorers.score_gsm8k(reply, "18", answer, "stop")["score"] == 1, reply
    assert scorers.score_gsm8k("#### $18", "18", answer, "stop")["lmeval_strict_match"] == 0


def _pin() -> None:
    import importlib.metadata

    for task, path in PINS.items():
        rows = [{"reply": reply, "answer": answer, **lmeval_verdicts(reply, answer, task)}
                for reply, answer in variants(task)]
        path.write_text(json.dumps({"lm_eval": importlib.metadata.version("lm_eval"), "task": task, "rows": rows},
                                   ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"{path}: {len(rows)} rows", file=sys.stderr)


if __name__ == "__main__":
    _pin()
