"""Every scorer survives whatever a server sends back (hypothesis): arbitrary text, huge numbers, unicode
digits, malformed tool calls and probability lists. The worst outcome is a wrong answer with its reason in
``error``, a row the runner can write as JSON; never an exception."""

from __future__ import annotations

import json
import re

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rigctl.hostside import bfcl, scorers

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

GSM8K = {"system": None, "prompt": "q", "gold": "72", "answer": "48 + 24 = 72\n#### 72"}
BFCL = {"system": None, "messages": [{"role": "user", "content": "q"}],
        "function": {"name": "math.gcd", "parameters": {"type": "dict", "properties": {
            "a": {"type": "integer"}, "b": {"type": "float"}, "names": {"type": "array", "items": {"type": "string"}},
            "opts": {"type": "dict"}}, "required": ["a"]}},
        "possible_answer": {"math.gcd": {"a": [12], "b": [1.5, ""], "names": [["x", "y"], ""],
                                         "opts": [{"k": [1]}, ""]}}}
CHOICE = {"system": None, "prompt": "q", "labels": ["yes", "no"], "gold": "yes"}
TOKENS = {"yes": {"id": 1, "piece": "yes"}, "no": {"id": 2, "piece": "no"}}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)
unicode_digits = st.text(alphabet=st.characters(categories=["Nd"]), min_size=1, max_size=40)
huge_numbers = st.integers(min_value=10 ** 20, max_value=10 ** 400).map(str)
number_words = st.one_of(huge_numbers, unicode_digits, huge_numbers.map(lambda s: f"{int(s):,}"),
                         st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(
                             ["NaN", "Infinity", "-0", "1e999999999", "0.000", "$-0.50.", "1,2,3", "１２"]))
replies = st.one_of(st.text(), number_words, st.tuples(st.text(max_size=40), number_words).map(" ".join),
                    number_words.map(lambda n: f"So the answer is #### {n}"))
malformed_json = st.one_of(
    st.text(max_size=60), json_values.map(json.dumps),
    st.sampled_from(['{"a": 12', '{"a": 12,}', "[" * 5000 + "]" * 5000, '{"a": ' + "1" * 5000 + "}", '{"a": NaN}',
                     '{"a": 1e400}', '"just a string"', "null", '{"a": {"a": {"a": 12}}}', '{"a": 12}']))
tool_calls = st.one_of(
    json_values,
    st.lists(st.one_of(json_values, st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": st.one_of(st.just("math_gcd"), st.text(max_size=10), json_values),
             "arguments": st.one_of(malformed_json, json_values)})})), max_size=3))
messages = st.one_of(json_values, st.fixed_dictionaries(
    {"content": st.one_of(replies, json_values)},
    optional={"tool_calls": tool_calls, "reasoning_content": st.one_of(st.text(max_size=20), json_values)}))
chat_answers = st.one_of(json_values, st.fixed_dictionaries({"choices": st.one_of(json_values, st.lists(
    st.fixed_dictionaries({"message": messages},
                          optional={"finish_reason": st.one_of(st.sampled_from(["stop", "length"]), json_values)}),
    min_size=1, max_size=2))}, optional={"usage": json_values}))
probability_entries = st.lists(st.one_of(json_values, st.fixed_dictionaries(
    {"id": st.one_of(st.integers(0, 3), json_values)},
    optional={"logprob": st.one_of(st.floats(allow_nan=True, allow_infinity=True), json_values),
              "prob": st.one_of(st.floats(allow_nan=True, allow_infinity=True), json_values),
              "token": json_values})), max_size=5)
completion_answers = st.one_of(json_values, st.fixed_dictionaries({"completion_probabilities": st.one_of(
    json_values, st.lists(st.fixed_dictionaries({"top_logprobs": st.one_of(probability_entries, json_values)}),
                          max_size=2))}))


def _survives(row: dict) -> None:
    """A scored row: 0 or 1, a reason when wrong, and JSON the runner can write as UTF-8."""
    assert row["score"] in (0, 1), row
    if row["score"] == 0:
        assert isinstance(row.get("error"), str) and row["error"], row
    json.dumps(row, ensure_ascii=False).encode("utf-8")


def _scored(record, answer, key: str = "choices"):
    """The record of ``answer``, which raises NoAnswer exactly when ``key`` holds no non-empty list."""
    holds = isinstance(answer, dict) and isinstance(answer.get(key), list) and bool(answer[key])
    try:
        row = record(answer)
    except scorers.NoAnswer:
        assert not holds, answer
        return None
    assert holds, answer
    _survives(row)
    return row


@SETTINGS
@given(st.one_of(replies, st.text()))
@example("12345678901234567890123456789")  # the GSM8K reply that raised decimal.InvalidOperation
@example("$1,234,567,890,123,456,789,012,345,678.00")
def test_normalise_number_gives_plain_ascii_or_none(text):
    value = scorers.normalise_number(text)
    assert value is None or re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]*[1-9])?", value), value
    if value is not None:
        assert scorers.normalise_number(value) == value


@SETTINGS
@given(st.integers(min_value=-(10 ** 500), max_value=10 ** 500))
def test_numbers_of_any_length_keep_every_digit(number):
    assert scorers.normalise_number(str(number)) == str(number)
    assert scorers.normalise_number(f"{number:,}") == str(number)
    arabic_indic = str(number).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    assert scorers.normalise_number(arabic_indic) == str(number)
    # Two long numbers that differ in the last digit stay apart (a 28-digit context rounded them together).
    assert scorers.normalise_number(str(number * 10 + 1)) != scorers.normalise_number(str(number * 10 + 2))


@SETTINGS
@given(replies, st.sampled_from(["stop", "length", ""]))
def test_gsm8k_scoring_never_raises(reply, finish):
    row = scorers.score_gsm8k(reply, "72", GSM8K["answer"], finish)
    _survives(row)
    assert row["score"] == int(row["number"] == "72")


@SETTINGS
@given(chat_answers)
@example({"choices": [{"message": {"content": "it is 12345678901234567890123456789"}}]})
@example({"choices": [{"message": "a string"}]})
@example({"error": {"message": "bad request"}})
def test_gsm8k_record_survives_any_answer(answer):
    _scored(lambda a: scorers.gsm8k_record(GSM8K, a), answer)


def test_an_unreadable_body_is_a_wrong_answer_with_its_reason():
    for record in (lambda a: scorers.gsm8k_record(GSM8K, a), lambda a: scorers.bfcl_record(BFCL, a),
                   lambda a: scorers.choice_record(CHOICE, a, TOKENS)):
        row = record(scorers.Unreadable("JSON nested too deep to read"))
        _survives(row)
        assert row["score"] == 0 and row["error"] == "unreadable answer: JSON nested too deep to read"


@SETTINGS
@given(chat_answers)
@example({"choices": [{"message": {"content": "", "tool_calls": [
    {"function": {"name": "math_gcd", "arguments": '{"a": ' + "9" * 5000 + "}"}}]}}]})
@example({"choices": [{"message": {"content": "", "tool_calls": [
    {"function": {"name": "math_gcd", "arguments": "[" * 5000}}]}}]})
@example({"choices": [{"message": {"content": "", "tool_calls": [
    {"function": {"name": "math_gcd", "arguments": {"a": 12, "b": 10 ** 400}}}]}}]})
@example({"choices": [{"message": {"content": "", "tool_calls": "math_gcd(12)"}}]})
@example({"choices": [{"message": {"content": "", "tool_calls": [
    {"function": {"name": "math_gcd", "arguments": '{"a": "\\ud800"}'}}]}}]})
def test_bfcl_record_survives_any_answer(answer):
    row = _scored(lambda a: scorers.bfcl_record(BFCL, a), answer)
    assert row is None or row["toolless"] == (not row["tool_calls"])


def test_a_right_bfcl_call_still_scores():
    answer = {"choices": [{"message": {"content": "", "tool_calls": [
        {"function": {"name": "math_gcd", "arguments": '{"a": 12, "b": 1.5}'}}]}, "finish_reason": "stop"}]}
    row = scorers.bfcl_record(BFCL, answer)
    assert row["score"] == 1 and row["error"] == ""


@SETTINGS
@given(completion_answers)
@example({"completion_probabilities": [{"top_logprobs": [{"id": 1, "logprob": "high"}, {"id": 2, "logprob": 1e999}]}]})
@example({"completion_probabilities": "none"})
def test_choice_record_survives_any_answer(answer):
    row = _scored(lambda a: scorers.choice_record(CHOICE, a, TOKENS), answer, "completion_probabilities")
    assert row is None or all(p is None or 0.0 <= p <= 1.0 for p in row["label_probs"].values())


@SETTINGS
@given(st.one_of(st.text(), malformed_json, st.text().map(lambda s: "{" * 3000 + s)))
def test_missed_call_detector_survives_any_text(text):
    assert isinstance(bfcl.looks_like_missed_call(text), bool)


@SETTINGS
@given(st.lists(chat_answers, min_size=1, max_size=5))
def test_summaries_of_whatever_was_scored(answers):
    scored = [_scored(lambda a: scorers.bfcl_record(BFCL, a), answer) for answer in answers]
    rows = [{"id": str(i), "set": "s", **row} for i, row in enumerate(scored) if row is not None]
    summary = scorers.summarise(rows, "bfcl_simple")
    assert summary["overall"]["n"] == len(rows)
    assert summary["overall"]["toolless"] == sum(r["toolless"] for r in rows)
