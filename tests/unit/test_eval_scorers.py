"""Scorers without a server: GSM8K extraction, BFCL's AST checker on hand-made calls, the missed-call
detector, choice scoring, the summary, and task-file validation."""

from __future__ import annotations

import pytest

from rigctl.errors import EvalError
from rigctl.evals.tasks import parse_task
from rigctl.hostside import bfcl, scorers
from rigctl.hostside.scorers import summarise

# ----------------------------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(("text", "expected"), [
    ("1,234", "1234"),
    ("$1,234.50", "1234.5"),
    ("18.", "18"),
    ("18.00", "18"),
    ("-7", "-7"),
    ("$ 5", "5"),
    ("0.25", "0.25"),
    ("abc", None),
])
def test_normalise_number(text, expected):
    assert scorers.normalise_number(text) == expected


@pytest.mark.parametrize(("reply", "number"), [
    ("She pays 3 * $4 = $12.\n#### 12", "12"),
    ("The total is $1,234.", "1234"),
    ("It drops to -7 degrees.", "-7"),
    ("#### -7\nSo the answer is -7.", "-7"),
    ("#### $1,000", "1000"),
    ("So 37.50 dollars.", "37.5"),
    ("First 5, then 10, finally 15.", "15"),
    ("#### 42\nCheck: 40 + 2 = 42, plus 1 spare", "1"),
    # A dash before a number is no sign: a bullet, "Answer - 18", a hyphen or an operator.
    ("The answer:\n- 18", "18"),
    ("Answer - 18", "18"),
    ("ages 7-18", "18"),
    ("x-5", "5"),
    ("It owes -$5", "-5"),
    ("(-3)", "-3"),
    # Commas between digits group them, however many digits stand between.
    ("1,8", "18"),
    ("#### 1,8", "18"),
    ("12,34,567", "1234567"),
    ("1, 8", "8"),
    ("No numbers here.", None),
    ("", None),
])
def test_gsm8k_last_number(reply, number):
    assert scorers.last_number(reply) == number


ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def test_gsm8k_gold_and_score_with_cutoff():
    gold = scorers.gsm8k_gold(ANSWER)
    assert gold == "72"
    assert scorers.gsm8k_gold("1,200") == "1200"
    assert scorers.gsm8k_gold("... #### -1,000") == "-1000"
    with pytest.raises(ValueError, match="no gold number"):
        scorers.gsm8k_gold("#### many")
    right = scorers.score_gsm8k("48 + 24 = 72 clips.", gold, ANSWER, "stop")
    assert (right["score"], right["lmeval_strict_match"], right["lmeval_flexible_extract"], right["cutoff"]) == \
        (1, 0, 1, False)
    assert right["lmeval_strict"] == "[invalid]" and "error" not in right
    cut = scorers.score_gsm8k("First, 48 divided by 2 is", gold, ANSWER, "length")
    assert (cut["score"], cut["cutoff"], cut["number"], cut["error"]) == (0, True, "2", "last number 2, gold 72")
    strict = scorers.score_gsm8k("#### 72.", gold, ANSWER, "stop")
    assert (strict["score"], strict["lmeval_strict_match"], strict["lmeval_strict"]) == (1, 1, "72.")
    # lm-eval reads the reply only up to its stop sequences: a made-up next question does not count.
    stopped = scorers.score_gsm8k("It is 72.\n\nQuestion: and 5?\nAnswer: 5", gold, ANSWER, "stop")
    assert (stopped["score"], stopped["lmeval_flexible_extract"], stopped["lmeval_flexible"]) == (0, 1, "72.")


def test_gsm8k_summary_names_all_three_scores():
    rows = [{"set": "gsm8k", **scorers.score_gsm8k(reply, "72", ANSWER, "stop")}
            for reply in ("#### 72", "so 72", "#### $72", "none")]
    overall = summarise(rows, "gsm8k")["overall"]
    assert set(scorers.GSM8K_SCORES) <= set(overall)
    assert (overall["score"], overall["lmeval_strict_match"], overall["lmeval_flexible_extract"]) == (0.75, 0.25, 0.75)


# ----------------------------------------------------------------------------------------------- BFCL

AREA = {"name": "geometry.triangle_area", "description": "Area of a triangle.",
        "parameters": {"type": "dict", "required": ["base", "height"], "properties": {
            "base": {"type": "integer"}, "height": {"type": "integer"},
            "unit": {"type": "string", "description": "optional"}}}}
AREA_TRUTH = {"geometry.triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}

TYPED = {"name": "plan_trip", "parameters": {"type": "dict", "required": ["city", "days"], "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "budget": {"type": "float"},
    "flexible": {"type": "boolean"}, "stops": {"type": "array", "items": {"type": "string"}},
    "prefs": {"type": "dict", "properties": {"seat": {"type": "string"}, "meal": {"type": "string"}}}}}}
TYPED_TRUTH = {"plan_trip": {"city": ["New York City", "NYC"], "days": [3], "budget": [500.0, ""],
                             "flexible": [True, ""], "stops": [["Boston", "Philadelphia"], ""],
                             "prefs": [{"seat": ["window"], "meal": ["veg", ""]}, ""]}}


def check(function, truth, *calls):
    return bfcl.check_simple_call(function, list(calls), truth)


def test_bfcl_right_call_with_and_without_optional():
    assert check(AREA, AREA_TRUTH, ("geometry_triangle_area", {"base": 10, "height": 5})).valid
    assert check(AREA, AREA_TRUTH, ("geometry_triangle_area", {"base": 10, "height": 5, "unit": "Units"})).valid


def test_bfcl_wrong_count_and_name():
    assert check(AREA, AREA_TRUTH).error_type == "simple_function_checker:wrong_count"
    two = check(AREA, AREA_TRUTH, ("geometry_triangle_area", {"base": 10, "height": 5}),
                ("geometry_triangle_area", {"base": 10, "height": 5}))
    assert two.error_type == "simple_function_checker:wrong_count"
    # The dotted name is what BFCL documents, but the tools API only carries the underscored one.
    assert check(AREA, AREA_TRUTH, ("geometry.triangle_area", {"base": 10, "height": 5})).error_type == \
        "simple_function_checker:wrong_func_name"
    assert check(AREA, AREA_TRUTH, ("triangle_area", {"base": 10, "height": 5})).error_type == \
        "simple_function_checker:wrong_func_name"


def test_bfcl_missing_and_unexpected_parameters():
    assert check(AREA, AREA_TRUTH, ("geometry_triangle_area", {"base": 10})).error_type == \
        "simple_function_checker:missing_required"
    extra = check(AREA, AREA_TRUTH, ("geometry_triangle_area", {"base": 10, "height": 5, "color": "red"}))
    assert extra.error_type == "simple_function_checker:unexpected_param"
    assert "color" in extra.error


def test_bfcl_omitted_parameter_that_is_not_optional():
    truth = {"geometry.triangle_area": {"base": [10], "height": [5], "unit": ["cm"]}}
    assert check(AREA, truth, ("geometry_triangle_area", {"base": 10, "height": 5})).error_type == \
        "simple_function_checker:missing_optional"


def test_bfcl_types():
    base = {"city": "NYC", "days": 3}
    name = "plan_trip"
    assert check(TYPED, TYPED_TRUTH, (name, base)).valid
    assert check(TYPED, TYPED_TRUTH, (name, {**base, "days": "3"})).error_type == "type_error:simple"
    assert check(TYPED, TYPED_TRUTH, (name, {**base, "days": 3.0})).error_type == "type_error:simple"
    # An integer is fine where a float is asked; a bool is not an integer.
    assert check(TYPED, TYPED_TRUTH, (name, {**base, "budget": 500})).valid
    assert check(TYPED, TYPED_TRUTH, (name, {**base, "flexible": 1})).error_type == "type_error:simple"
    assert check(TYPED, TYPED_TRUTH, (name, {**base, "flexible": True})).valid
    # As in BFCL, items are type-checked against each list among the possible answers; an optional ("")
    # answer lets the type check pass and leaves the mismatch to the value check.
    assert check(TYPED, TYPED_TRUTH, (name, {**base, "stops": ["Boston", 3]})).error_type == "value_error:list"
    required_stops = {"plan_trip": {**TYPED_TRUTH["plan_trip"], "stops": [["Boston", "Philadelphia"]]}}
    assert check(TYPED, required_stops, (name, {**base, "stops": ["Boston", 3]})).error_type == "type_error:nested"
    assert check(TYPED, TYPED_TRUTH, (name, {**base, "stops": "Boston"})).error_type == "type_error:simple"


def test_bfcl_values_after_string_normalisation():
    name = "plan_trip"
    assert check(TYPED, TYPED_TRUTH, (name, {"city": "new-york city", "days": 3})).valid
    assert check(TYPED, TYPED_TRUTH, (name, {"city": "N.Y.C.", "days": 3})).valid
    assert check(TYPED, TYPED_TRUTH, (name, {"city": "Boston", "days": 3})).error_type == "value_error:string"
    assert check(TYPED, TYPED_TRUTH, (name, {"city": "NYC", "days": 4})).error_type == "value_error:others"
    assert check(TYPED, TYPED_TRUTH, (name, {"city": "NYC", "days": 3, "stops": ["boston", "PHILADELPHIA"]})).valid
    assert check(TYPED, TYPED_TRUTH, (name, {"city": "NYC", "days": 3, "stops": ["Philadelphia", "Boston"]})) \
        .error_type == "value_error:list"
    assert check(TYPED, TYPED_TRUTH, (name, {"city": "NYC", "days": 3, "prefs": {"seat": "Window"}})).valid
    wrong = check(TYPED, TYPED_TRUTH, (name, {"city": "NYC", "days": 3, "prefs": {"seat": "aisle"}}))
    assert wrong.error_type == "value_error:dict_value"
    assert check(TYPED, TYPED_TRUTH, (name, {"city": "NYC", "days": 3, "prefs": {"seat": "window", "pet": "cat"}})) \
        .error_type == "value_error:dict_key"
    assert bfcl.standardise("April 1, 2024") == bfcl.standardise("april 1 2024") == "april12024"
    assert bfcl.standardise("it's") == 'it"s'


def test_bfcl_variable_in_place_of_value():
    # BFCL's possible answers sometimes hold a variable name where the schema asks for a number.
    function = {"name": "scale", "parameters": {"type": "dict", "required": ["factor"],
                                                "properties": {"factor": {"type": "integer"}}}}
    truth = {"scale": {"factor": ["k"]}}
    assert check(function, truth, ("scale", {"factor": "k"})).valid
    assert check(function, truth, ("scale", {"factor": "j"})).error_type == "value_error:others"


def test_bfcl_arguments_not_an_object():
    assert check(AREA, AREA_TRUTH, ("geometry_triangle_area", "base=10")).error_type == \
        "simple_function_checker:bad_arguments"


def test_bfcl_tools_are_openai_schema():
    (tool,) = bfcl.bfcl_tools([TYPED | {"name": "trips.plan"}])
    function = tool["function"]
    assert tool["type"] == "function" and function["name"] == "trips_plan"
    props = function["parameters"]["properties"]
    assert function["parameters"]["type"] == "object"
    assert (props["budget"]["type"], props["prefs"]["type"], props["stops"]["type"]) == ("number", "object", "array")
    assert props["prefs"]["properties"]["seat"]["type"] == "string"


@pytest.mark.parametrize(("text", "missed"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', True),
    ("I will use tool_call now", True),
    ("<function=get_weather>{\"city\": \"Paris\"}</function>", True),
    ('Sure: {"name": "get_weather", "arguments": {"city": "Paris"}}', True),
    ('```json\n[{"name": "f", "parameters": {"x": 1}}]\n```', True),
    ('{"call": {"name": "f", "arguments": {}}}', True),
    ('The JSON {"city": "Paris"} has no name.', False),
    ('{"name": "Ann", "age": 31}', False),
    ("The weather in Paris is sunny.", False),
    ("{ not json", False),
])
def test_missed_call_detector(text, missed):
    assert bfcl.looks_like_missed_call(text) is missed


# ----------------------------------------------------------------------------------------------- choice


def test_choice_scoring():
    right = scorers.score_choice({"yes": 0.6, "no": 0.3}, "yes")
    assert (right["pred"], right["score"], right["label_mass"]) == ("yes", 1, pytest.approx(0.9))
    unseen = scorers.score_choice({"yes": None, "no": 0.01}, "yes")
    assert (unseen["pred"], unseen["score"], unseen["label_probs"]) == ("no", 0, {"yes": None, "no": 0.01})
    nothing = scorers.score_choice({"yes": None, "no": None}, "no")
    assert (nothing["pred"], nothing["score"]) == (None, 0)


def test_summary_per_set_and_overall():
    rows = [{"id": "a", "set": "x", "score": 1, "cutoff": False}, {"id": "b", "set": "x", "score": 0, "cutoff": True},
            {"id": "c", "set": "y", "score": 1, "cutoff": False, "toolless": True, "missed_call": True}]
    summary = summarise(rows, "bfcl_simple")
    assert summary["sets"]["x"] == {"n": 2, "score": 0.5, "cutoffs": 1, "toolless": 0, "missed_calls": 0}
    assert summary["overall"]["score"] == pytest.approx(2 / 3)
    assert summary["overall"]["macro"] == pytest.approx(0.75)
    assert (summary["overall"]["toolless"], summary["overall"]["missed_calls"]) == (1, 1)


# ----------------------------------------------------------------------------------------------- task files


@pytest.mark.parametrize(("text", "message"), [
    ("name: t\nscorer: gsm8k\ndataset: {hf: a/b, file: x.jsonl}\n", "needs revision and file"),
    ("name: t\nscorer: gsm8k\ndataset: {url: 'http://x/y', path: y.jsonl}\n", "exactly one of hf, url, path"),
    ("name: t\nscorer: magic\ndataset: {path: y.jsonl}\n", "magic"),
    ("name: t\nscorer: gsm8k\ndataset: {path: y.jsonl}\nmax_tokens: 0\n", "max_tokens"),
    ("name: t\nscorer: gsm8k\ndataset: {path: y.jsonl, sha256: abc}\n", "sha256"),
    ("name: t\nscorer: gsm8k\ndataset: {path: y.jsonl}\ntemperature: 1\n", "temperature"),
    ("name: t\nscorer: choice\nsets: [{name: a, dataset: {path: y}, prompt: p, gold: g, labels: {x: y}}]\n",
     "labels"),
    ("- just a list\n", "a task file is a mapping"),
])
def test_bad_task_files_name_the_culprit(text, message):
    with pytest.raises(EvalError, match=message) as info:
        parse_task(text, "bad.yaml")
    assert str(info.value).startswith("bad.yaml: ")
    assert "\n" not in str(info.value)


def test_answered_cuts_a_torn_last_line(tmp_path):
    from rigctl.evals.runner import answered

    path = tmp_path / "answers.jsonl"
    assert answered(path) == set()
    path.write_text('{"id": "a", "set": "s", "score": 1}\n{"id": "b", "set": "s", "sc')
    assert answered(path) == {("s", "a")}
    assert path.read_text() == '{"id": "a", "set": "s", "score": 1}\n'
