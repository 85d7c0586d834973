"""check's pure parts: first difference with context, KL over the server's top-k, prompt files, and the
message when the reference Python lacks transformers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from rigctl.analysis.runtime_check import (
    BUILTIN_PROMPTS,
    HfReference,
    LogitsCheck,
    LogitsResult,
    ServerCheck,
    TemplateCheck,
    TemplateResult,
    context,
    first_difference,
    kl_over_top,
    load_prompts,
)
from rigctl.errors import ConfigError


def test_first_difference_and_context():
    assert first_difference("abc", "abc") is None
    assert first_difference("abcd", "abXd") == 2
    assert first_difference("abc", "abcdef") == 3  # one is a prefix of the other
    text = "<|im_start|>system\nYou are SmolLM"
    pos = text.index("Smol")
    shown = context(text, pos, width=9)
    assert shown == "…\\nYou are ⟦S⟧molLM"


def test_kl_over_top_k():
    same = {1: 0.5, 2: 0.3, 3: 0.1}
    assert kl_over_top(same, {k: math.log(v) for k, v in same.items()}) == pytest.approx(0.0, abs=1e-12)
    # Renormalised to the server's tokens: a reference with the same ratios but less mass is identical.
    assert kl_over_top(same, {k: math.log(v / 2) for k, v in same.items()}) == pytest.approx(0.0, abs=1e-12)
    shifted = {1: math.log(0.3), 2: math.log(0.5), 3: math.log(0.1)}
    p = [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9]
    q = [0.3 / 0.9, 0.5 / 0.9, 0.1 / 0.9]
    assert kl_over_top(same, shifted) == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q, strict=True)))
    assert math.isnan(kl_over_top({}, shifted))


def test_each_check_counts_its_results_and_names_the_endpoint_and_checkout():
    template = TemplateCheck(endpoint="http://rig:8080", checkout="/hf/qwen", results=(
        TemplateResult("math", "a", "a", None), TemplateResult("tools", "ab", "ac", 1)))
    assert (template.identical, [r.name for r in template.differing]) == (1, ["tools"])

    def logits(name: str, server_top1: int, kl: float) -> LogitsResult:
        return LogitsResult(name, 5, server_top1, 7, 0.9, 0.8, 0.99, kl)

    check = LogitsCheck(endpoint="http://rig:8080", checkout="/hf/qwen", model_path="/m/q.gguf", build="b1-abc",
                        top_k=20, results=(logits("a", 7, 0.01), logits("b", 3, 0.03), logits("c", 7, math.nan)))
    assert (check.agreement, check.max_kl) == (2, 0.03) and check.mean_kl == pytest.approx(0.02)
    for done in (template, check):
        assert isinstance(done, ServerCheck) and (done.endpoint, done.checkout) == ("http://rig:8080", "/hf/qwen")


def test_prompt_files(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"name": "x", "messages": [{"role": "user", "content": "hi"}]}\n\n{"messages": []}\n')
    prompts = load_prompts(path)
    assert [p.name for p in prompts] == ["x", "prompts-3"] and prompts[0].tools is None
    path.write_text('{"name": "x"}\n')
    with pytest.raises(ConfigError, match=r"prompts.jsonl:1: not a conversation \(KeyError"):
        load_prompts(path)
    assert {c.name.split("-")[0] for c in BUILTIN_PROMPTS} == {"math", "tools"}


def test_a_python_without_transformers_gets_a_clear_message(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    reference = HfReference(tmp_path, python=Path(sys.executable))
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("this Python has transformers")
    with pytest.raises(ConfigError, match=r"transformers is not installed for .*pip install 'rigctl\[verify\]'\) "
                                          r"or pass --python"):
        reference.render(BUILTIN_PROMPTS[:1])


def test_not_a_checkout_and_no_interpreter(tmp_path):
    with pytest.raises(ConfigError, match="not a Hugging Face checkout"):
        HfReference(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="--python /nonexistent/python: no such interpreter"):
        HfReference(tmp_path, python=Path("/nonexistent/python")).render(BUILTIN_PROMPTS[:1])
