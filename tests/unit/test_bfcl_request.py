"""rigctl's BFCL request against BFCL's own: the tools (description note, float note and format, types cast
as gorilla casts them), temperature 0.001, no token limit, and a task's deviations named.

``data/bfcl_tools.json`` pins the tools bfcl_eval makes (``add_language_specific_hint_to_function_doc`` then
``convert_to_tool`` for an OpenAI-compatible FC model) from the fixture's BFCL documents and from documents
made to reach every branch of its type cast; ``python tests/unit/test_bfcl_request.py`` writes it again with
bfcl_eval importable. Where bfcl_eval is importable, the pins are recomputed and every one of the 400
simple-python questions it ships is compared too. bfcl_eval is no dev dependency (it pins tree_sitter and
brings an API client per vendor); to run the recomputation install it into a scratch directory:
``pip install --target /tmp/bfcl --no-deps bfcl-eval`` and ``pip install --target /tmp/bfcl-deps
tree_sitter==0.21.3 tree-sitter-java==0.21.0 tree-sitter-javascript==0.21.4 tenacity filelock``, then put
both on ``PYTHONPATH``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from rigctl.errors import EvalError
from rigctl.evals.tasks import load_task, parse_task
from rigctl.hostside import bfcl, scorers

PINS = Path(__file__).parent / "data" / "bfcl_tools.json"
FIXTURE = Path(__file__).parents[1] / "fixtures" / "evals" / "hf" / "bfcl_simple.json"


def _prop(kind: str, description: str = "d.", **more: Any) -> dict[str, Any]:
    return {"type": kind, "description": description, **more}


EDGE_CASES = [
    {"name": "geo.distance", "description": "Distance between two points.", "parameters": {
        "type": "dict", "required": ["a"], "properties": {
            "a": _prop("array", items={"type": "float"}), "scale": _prop("float"), "unit": _prop("string"),
            "exact": _prop("boolean"), "count": _prop("integer"), "big": _prop("Bigint"), "odd": _prop("complex"),
            "bare": {"description": "no type"}, "pair": _prop("tuple", items={"type": "integer"}),
            "grid": _prop("array", items={"type": "array", "items": {"type": "float"}}),
            "rows": _prop("array", items={"type": "dict", "properties": {"w": _prop("float"), "k": _prop("list")}}),
            "spec": _prop("dict", properties={"rate": _prop("float"), "inner": _prop("dict", properties={
                "x": _prop("float")})}),
            "anything": _prop("any"), "opts": _prop("dict")}}},
    {"name": "noop", "description": "", "parameters": {"type": "dict", "properties": {}}},
]


def documents() -> list[dict[str, Any]]:
    """Every function document the pins cover: the fixture's, then the edge cases."""
    fixture = [json.loads(line)["function"][0] for line in FIXTURE.read_text(encoding="utf-8").splitlines() if line]
    return fixture + EDGE_CASES


def bfcl_eval_tools(function: dict[str, Any]) -> list[dict[str, Any]]:
    """What bfcl_eval sends an OpenAI-compatible FC model for one simple-python question."""
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.model_handler.utils import convert_to_tool
    from bfcl_eval.utils import add_language_specific_hint_to_function_doc

    (entry,) = add_language_specific_hint_to_function_doc([{"id": "simple_python_0",
                                                             "function": [copy.deepcopy(function)]}])
    return convert_to_tool(entry["function"], GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)


def _canonical(tools: Any) -> str:
    return json.dumps(tools, ensure_ascii=False)  # key order kept: the chat template renders it as it stands


def test_tools_are_the_pinned_bfcl_tools_key_for_key():
    pins = json.loads(PINS.read_text(encoding="utf-8"))
    assert pins["bfcl_eval"] == bfcl.BFCL_EVAL_VERSION  # the release the run records name
    assert [pin["function"] for pin in pins["rows"]] == documents()
    for pin in pins["rows"]:
        assert _canonical(bfcl.bfcl_tools([pin["function"]])) == _canonical(pin["tools"]), pin["function"]["name"]
    float_props = pins["rows"][-2]["tools"][0]["function"]["parameters"]["properties"]
    assert float_props["scale"] == {"type": "number", "description": "d. This is a float type value.",
                                    "format": "float"}


def test_the_documents_are_left_as_they_are():
    before = copy.deepcopy(EDGE_CASES)
    bfcl.bfcl_tools(EDGE_CASES)
    assert before == EDGE_CASES


def test_without_notes_nothing_is_added():
    (tool,) = bfcl.bfcl_tools(EDGE_CASES[:1], notes=False)
    function = tool["function"]
    assert function["description"] == "Distance between two points."
    assert function["parameters"]["properties"]["scale"] == {"type": "number", "description": "d."}


def test_the_pins_are_what_the_installed_bfcl_eval_makes():
    pytest.importorskip("bfcl_eval.model_handler.utils", reason="bfcl_eval not importable (see the module docstring)")
    pins = json.loads(PINS.read_text(encoding="utf-8"))
    for pin in pins["rows"]:
        assert _canonical(bfcl_eval_tools(pin["function"])) == _canonical(pin["tools"]), pin["function"]["name"]


def test_every_shipped_simple_python_question_gets_bfcls_own_tools():
    pytest.importorskip("bfcl_eval.model_handler.utils", reason="bfcl_eval not importable (see the module docstring)")
    import bfcl_eval

    path = Path(bfcl_eval.__file__).parent / "data" / "BFCL_v4_simple_python.json"
    questions = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    assert len(questions) == 400
    floats = 0
    for question in questions:
        (function,) = question["function"]
        ours = bfcl.bfcl_tools([function])
        assert _canonical(ours) == _canonical(bfcl_eval_tools(function)), question["id"]
        floats += sum(p.get("format") == "float" for p in ours[0]["function"]["parameters"]["properties"].values())
    assert floats > 0


# ----------------------------------------------------------------------------------------------- request, task


def test_the_request_is_bfcls_own_by_default(tmp_path):
    task = _task(tmp_path, "")
    data = task.questions[0].data
    body = scorers.chat_request("bfcl_simple", data, task.request, seed=7)
    assert body["temperature"] == 0.001 and "max_tokens" not in body
    assert body["tools"] == bfcl.bfcl_tools([data["function"]])
    description = body["tools"][0]["function"]["description"]
    assert description.endswith(" Note that the provided function is in Python 3 syntax.")
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert task.deviations is None


def test_a_deviation_is_stated_recorded_and_in_the_body(tmp_path):
    task = _task(tmp_path, "max_tokens: 64\ntemperature: 0\nbfcl_notes: false\n"
                           "deviation: the rig is slow; greedy like the other tasks\n")
    body = scorers.chat_request("bfcl_simple", task.questions[0].data, task.request)
    assert (body["max_tokens"], body["temperature"]) == (64, 0)
    assert "Python 3" not in body["tools"][0]["function"]["description"]
    assert task.deviations == {"from": "BFCL's own request", "reason": "the rig is slow; greedy like the other tasks",
                               "settings": ["max_tokens 64 (BFCL: no limit)", "temperature 0 (BFCL: 0.001)",
                                            "no Python 3 and float notes in the function documents (BFCL: both)"]}


@pytest.mark.parametrize(("extra", "message"), [
    ("max_tokens: 512\n", "departs from BFCL's own request (max_tokens 512 (BFCL: no limit)): say why under "
                          "deviation"),
    ("system: Be brief.\n", "a system prompt (BFCL: none)"),
    ("deviation: none really\n", "deviation given, but the request is BFCL's own"),
])
def test_an_unexplained_or_empty_deviation_is_refused(extra, message):
    with pytest.raises(EvalError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_task(f"name: b\nscorer: bfcl_simple\ndataset: {{path: q.json}}\nanswers: {{path: a.json}}\n{extra}",
                   "t.yaml")


def _task(tmp_path: Path, extra: str):
    answers = FIXTURE.parent / "possible_answer" / "bfcl_simple.json"
    (tmp_path / "t.yaml").write_text(f"name: b\nscorer: bfcl_simple\ndataset: {{path: {FIXTURE}}}\n"
                                     f"answers: {{path: {answers}}}\nlimit: 1\n{extra}")
    return load_task(str(tmp_path / "t.yaml"))


def _pin() -> None:
    import importlib.metadata

    rows = [{"function": function, "tools": bfcl_eval_tools(function)} for function in documents()]
    PINS.write_text(json.dumps({"bfcl_eval": importlib.metadata.version("bfcl-eval"), "rows": rows},
                               ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{PINS}: {len(rows)} documents", file=sys.stderr)


if __name__ == "__main__":
    _pin()
