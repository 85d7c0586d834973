"""BFCL's simple-category rules, restated from its own code (``bfcl_eval``'s ``ast_checker``, Python): the
tools as BFCL sends them to an OpenAI-compatible server, and the checker of the one call a reply makes.
Standard library only; pure.

* exactly one call, and its name is the function's name (dots sent as underscores, since the OpenAI tools
  API allows no dots in names);
* every required parameter is present; every parameter given is in the schema *and* in the possible
  answer (else "unexpected parameter");
* types per schema: string, integer, float (an integer is accepted for a float), boolean, array/tuple
  (items checked one level deep), dict; ``any`` reads as string. When the possible answers hold a
  different type than the schema (a variable name in place of a value), a value of the answers' type
  passes the type check and is compared as such;
* values: strings compared after normalisation (drop spaces and ``,./-_*^``, lower case, ``'`` -> ``"``),
  lists element-wise with the same normalisation for string elements, dicts key by key, lists of dicts
  dict by dict in order, anything else by equality with one of the possible answers;
* a parameter in the possible answer that the call omits is only fine when ``""`` is among its answers
  (optional)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_CALL_MARKERS = re.compile(r"tool_call|<function", re.IGNORECASE)

_PYTHON_TYPES: dict[str, type] = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list,
                                  "tuple": list, "dict": dict, "any": str}
_STRIP = re.compile(r"[ ,./\-_*^]")

# BFCL's own request for an FC model through an OpenAI-compatible API (gorilla's berkeley-function-call-
# leaderboard, bfcl_eval): each function's description gets the Python hint
# (``func_doc_language_specific_pre_processing``), its types are cast by ``_cast_to_openai_type`` with
# ``GORILLA_TO_OPENAPI`` (model_handler/utils.py, constants/type_mappings.py), and the query sends
# ``temperature`` (the CLI's default, 0.001) and no token limit (``OpenAICompletionsHandler._query_FC``).
#: The bfcl-eval release whose request and checker rigctl reproduces (tests/unit/data/bfcl_tools.json is its output).
BFCL_EVAL_VERSION = "2026.3.23"
BFCL_PYTHON_NOTE = " Note that the provided function is in Python 3 syntax."
BFCL_FLOAT_NOTE = " This is a float type value."
BFCL_TEMPERATURE = 0.001
GORILLA_TO_OPENAPI = {
    "integer": "integer", "number": "number", "float": "number", "string": "string", "boolean": "boolean",
    "bool": "boolean", "array": "array", "list": "array", "dict": "object", "object": "object", "tuple": "array",
    "any": "string", "byte": "integer", "short": "integer", "long": "integer", "double": "number",
    "char": "string", "ArrayList": "array", "Array": "array", "HashMap": "object", "Hashtable": "object",
    "Queue": "array", "Stack": "array", "Any": "string", "String": "string", "Bigint": "integer",
}


def bfcl_name(name: str) -> str:
    """A BFCL function name as sent through the OpenAI tools API (no dots allowed there)."""
    return name.replace(".", "_")


def _openapi(kind: Any) -> str:
    return GORILLA_TO_OPENAPI.get(kind, "string") if isinstance(kind, str) else "string"


def _cast_properties(properties: Mapping[str, Any], notes: bool) -> dict[str, Any]:
    """BFCL's ``_cast_to_openai_type``: types through GORILLA_TO_OPENAPI (anything else a string); a float
    parameter also gets ``format: float`` and the float note (with ``notes``); nested properties are cast
    alike, array items only have their type mapped (two levels deep) or, for objects, their properties cast."""
    out: dict[str, Any] = {}
    for key, value in properties.items():
        prop = dict(value) if isinstance(value, Mapping) else {}
        if "type" not in prop:
            prop["type"] = "string"
        else:
            if prop["type"] == "float" and notes:
                prop["format"] = "float"
                prop["description"] = str(prop.get("description", "")) + BFCL_FLOAT_NOTE
            prop["type"] = _openapi(prop["type"])
        if prop["type"] in ("array", "object"):
            if isinstance(prop.get("properties"), Mapping):
                prop["properties"] = _cast_properties(prop["properties"], notes)
            elif isinstance(prop.get("items"), Mapping):
                items = prop["items"] = dict(prop["items"])
                items["type"] = _openapi(items.get("type"))
                if items["type"] == "array" and isinstance(items.get("items"), Mapping):
                    items["items"] = {**items["items"], "type": _openapi(items["items"].get("type"))}
                elif items["type"] == "object" and isinstance(items.get("properties"), Mapping):
                    items["properties"] = _cast_properties(items["properties"], notes)
        out[key] = prop
    return out


def bfcl_tools(functions: Sequence[Mapping[str, Any]], *, notes: bool = True) -> list[dict[str, Any]]:
    """BFCL function documents as OpenAI ``tools``, as BFCL sends them: names with underscores, BFCL's types
    cast to OpenAPI's, and (``notes``, BFCL's own request) the Python 3 note on each description and the float
    note with ``format: float`` on each float parameter. The documents themselves are left as they are."""
    tools = []
    for function in functions:
        parameters = dict(function.get("parameters") or {})
        parameters["type"] = "object"
        parameters["properties"] = _cast_properties(parameters.get("properties") or {}, notes)
        description = str(function.get("description", "")) + (BFCL_PYTHON_NOTE if notes else "")
        tools.append({"type": "function", "function": {"name": bfcl_name(function["name"]),
                                                       "description": description, "parameters": parameters}})
    return tools


def standardise(text: str) -> str:
    """BFCL's string normalisation: no spaces or ``,./-_*^``, lower case, single quotes as double quotes."""
    return _STRIP.sub("", text).lower().replace("'", '"')


@dataclass(frozen=True)
class Check:
    valid: bool
    error: str = ""
    error_type: str = ""


OK = Check(True)

def _answer_type(possible: Sequence[Any]) -> type | None:
    for answer in possible:
        if answer != "":
            return type(answer)
    return None


def _type_check(param: str, value: Any, possible: Sequence[Any], expected: type, nested: type | None,
                described: str) -> tuple[Check, bool]:
    """(result, is_variable): a value of the answers' type passes as a variable when it differs from the schema."""
    answer_type = _answer_type(possible)
    is_variable = answer_type is not None and answer_type is not expected
    if type(value) is expected:
        if nested is None:
            return OK, is_variable
        for candidate in possible:
            if isinstance(candidate, list) and all(
                    _type_check(param, item, candidate, nested, None, nested.__name__)[0].valid for item in value):
                return OK, is_variable
            if not isinstance(candidate, list):
                return OK, is_variable
        return Check(False, f"parameter {param!r}: items of {value!r} are not all {nested.__name__}",
                     "type_error:nested"), is_variable
    if answer_type is not None and type(value) is answer_type:
        return OK, True
    return Check(False, f"parameter {param!r}: expected {described}, got {type(value).__name__} ({value!r})",
                 "type_error:simple"), is_variable


def _std(value: Any) -> Any:
    return standardise(value) if isinstance(value, str) else value


def _check_string(param: str, value: str, possible: Sequence[Any]) -> Check:
    if standardise(value) in [standardise(p) for p in possible if isinstance(p, str)]:
        return OK
    return Check(False, f"parameter {param!r}: {value!r} is not one of {list(possible)!r}", "value_error:string")


def _check_list(param: str, value: list, possible: Sequence[Any]) -> Check:
    given = [_std(v) for v in value]
    if any(isinstance(p, list) and given == [_std(v) for v in p] for p in possible):
        return OK
    return Check(False, f"parameter {param!r}: {value!r} is not one of {list(possible)!r}", "value_error:list")


def _check_dict(param: str, value: Mapping[str, Any], possible: Sequence[Any]) -> Check:
    failure = Check(False, f"parameter {param!r}: {value!r} matches none of the possible dicts", "value_error:dict")
    for answer in possible:
        if not isinstance(answer, Mapping):
            continue
        unexpected = [k for k in value if k not in answer]
        wrong = [k for k, v in value.items() if k in answer and _std(v) not in [_std(a) for a in answer[k]]]
        missing = [k for k, options in answer.items() if k not in value and "" not in options]
        if not unexpected and not wrong and not missing:
            return OK
        if unexpected:
            failure = Check(False, f"parameter {param!r}: unexpected dict key {unexpected[0]!r}",
                            "value_error:dict_key")
        elif missing:
            failure = Check(False, f"parameter {param!r}: missing dict key {missing[0]!r}", "value_error:dict_key")
        else:
            failure = Check(False, f"parameter {param!r}: key {wrong[0]!r} = {value[wrong[0]]!r} not allowed",
                            "value_error:dict_value")
    return failure


def _check_list_of_dicts(param: str, value: list, possible: Sequence[Any]) -> Check:
    for answer in possible:
        if isinstance(answer, list) and len(answer) == len(value) and all(
                isinstance(v, Mapping) and _check_dict(param, v, [a]).valid
                for v, a in zip(value, answer, strict=True)):
            return OK
    return Check(False, f"parameter {param!r}: {value!r} matches none of the possible lists of dicts",
                 "value_error:list_dict")


def check_simple_call(function: Mapping[str, Any], calls: Sequence[tuple[str, Any]],
                      possible_answer: Mapping[str, Mapping[str, Sequence[Any]]]) -> Check:
    """BFCL's AST check of a simple-category reply: ``calls`` as (name, arguments) pairs from the reply's tool
    calls, ``possible_answer`` the ground truth entry ``{function name: {param: [possible values]}}``."""
    if len(calls) != 1:
        return Check(False, f"expected one call, got {len(calls)}", "simple_function_checker:wrong_count")
    name, arguments = calls[0]
    expected_name = bfcl_name(function["name"])
    if name != expected_name:
        return Check(False, f"called {name!r}, expected {expected_name!r}", "simple_function_checker:wrong_func_name")
    if not isinstance(arguments, Mapping):
        return Check(False, f"arguments are not a JSON object: {arguments!r}", "simple_function_checker:bad_arguments")
    answers = next(iter(possible_answer.values()))
    parameters = function.get("parameters") or {}
    details = parameters.get("properties") or {}
    for param in parameters.get("required") or []:
        if param not in arguments:
            return Check(False, f"missing required parameter {param!r}", "simple_function_checker:missing_required")
    for param, value in arguments.items():
        if param not in details or param not in answers:
            return Check(False, f"unexpected parameter {param!r}", "simple_function_checker:unexpected_param")
        described = str(details[param].get("type", "any"))
        expected = _PYTHON_TYPES.get(described, str)
        nested = None
        if described in ("array", "tuple"):
            nested = _PYTHON_TYPES.get(str((details[param].get("items") or {}).get("type", "any")), str)
        if described == "float" and type(value) is int:
            try:
                value = float(value)
            except OverflowError:
                return Check(False, f"parameter {param!r}: {value} is too large for a float", "type_error:simple")
        check, is_variable = _type_check(param, value, answers[param], expected, nested, described)
        if not check.valid:
            return check
        if not is_variable and expected is dict:
            check = _check_dict(param, value, answers[param])
        elif not is_variable and expected is list and nested is dict:
            check = _check_list_of_dicts(param, value, answers[param])
        elif not is_variable and expected is str:
            check = _check_string(param, value, answers[param])
        elif not is_variable and expected is list:
            check = _check_list(param, value, answers[param])
        elif value not in answers[param]:
            check = Check(False, f"parameter {param!r}: {value!r} is not one of {answers[param]!r}",
                          "value_error:others")
        if not check.valid:
            return check
    for param, options in answers.items():
        if param not in arguments and "" not in options:
            return Check(False, f"parameter {param!r} omitted but not optional",
                         "simple_function_checker:missing_optional")
    return OK


def looks_like_missed_call(text: str) -> bool:
    """Whether a reply without tool calls holds call-like text the server's parser may have missed:
    ``tool_call``, ``<function``, or a JSON object with ``name`` and ``arguments`` (or ``parameters``)."""
    if _CALL_MARKERS.search(text):
        return True
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except (ValueError, RecursionError):  # not JSON here, a number past the digit limit, too deep
            continue
        if _is_call_object(value):
            return True
    return False


def _is_call_object(value: Any) -> bool:
    if isinstance(value, list):
        return any(_is_call_object(item) for item in value)
    if not isinstance(value, Mapping):
        return False
    if "name" in value and ("arguments" in value or "parameters" in value):
        return True
    return any(_is_call_object(v) for v in value.values() if isinstance(v, Mapping | list))
