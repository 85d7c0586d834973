"""Pure scoring: GSM8K answer extraction, BFCL simple calls (checked by :mod:`rigctl.hostside.bfcl`), and
next-token-probability choice; the request bodies and records of each, and the summary of a run. No I/O here;
the runner (on the controller, :mod:`rigctl.evals.runner`) and the eval job (on the host,
:mod:`rigctl.hostside.eval_task`) feed replies in and write what comes out. Standard library only.

Whatever a server answers, the record functions (``gsm8k_record``, ``bfcl_record``, ``choice_record``)
return a record: a reply that cannot be read (a body the client could not hold, given as
:class:`Unreadable`; a message that is no object, tool calls that are no list, arguments that are no JSON,
numbers too long to convert, nesting too deep to parse) is a wrong answer with the reason in ``error``.
The one exception is an answer that is no answer at all, a 200 without ``choices`` (or without
``completion_probabilities``): :class:`NoAnswer`, which stops the run (resumable), since scoring it would
count a server fault as the model's mistake.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rigctl.hostside.bfcl import Check, bfcl_tools, check_simple_call, looks_like_missed_call

# ----------------------------------------------------------------------------------------------- GSM8K
# Three scores per reply. ``score`` is rigctl's own: the last number in the reply, normalised (commas, ``$``,
# trailing zeros, unicode digits), against the gold number. The other two are lm-eval 0.4's, computed the way
# lm-eval's ``gsm8k`` task computes them (lm_eval/tasks/gsm8k/gsm8k.yaml, metadata version 3.0), so they can
# be set beside published numbers: the reply cut at the task's stop sequences (``generation_kwargs.until``;
# lm-eval sends them as ``stop``, and a greedy reply cut after the fact is the same text), each filter of
# ``filter_list`` (``RegexFilter.apply`` in lm_eval/filters/extraction.py, then ``take_first``), and
# ``exact_match`` with the task's ``regexes_to_ignore`` and ``ignore_case`` applied to the filtered reply and to
# the dataset's whole answer field alike (``exact_match_hf_evaluate`` in lm_eval/api/metrics.py). A question asked
# as lm-eval's ``gsm8k_cot_llama`` asks it (gsm8k-cot-llama.yaml, metadata version 4.0) is scored as that task
# scores: cut at the stop sequences lm-eval sends (the first four of its five ``until``), strict-match the last
# ``The final answer is N``, and the reference its ``doc_to_target``, the answer field after its last ``####``.

#: The scores a GSM8K answer row carries, by key, with the names every table prints.
GSM8K_SCORES = {"score": "rigctl normalised", "lmeval_strict_match": "lm-eval strict-match",
                "lmeval_flexible_extract": "lm-eval flexible-extract"}
#: The lm-eval release whose scoring (here) and request (:mod:`rigctl.evals.lmeval`) rigctl reproduces.
LMEVAL_VERSION = "0.4.13"
LMEVAL_STOP = ("Question:", "</s>", "<|im_end|>")
LMEVAL_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # group_select 0: the first match
LMEVAL_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")  # group_select -1: the last match
LMEVAL_IGNORE = (",", r"\$", "(?s).*#### ", r"\.$")
LMEVAL_FALLBACK = "[invalid]"


@dataclass(frozen=True)
class LmevalScoring:
    """How one of lm-eval's GSM8K tasks reads a reply: where it is cut, its strict-match filter (the flexible one
    is the same for both), and whether the reference is the whole answer field or what follows its last ``####``."""

    stop: tuple[str, ...]
    strict: re.Pattern[str]
    strict_group: int
    reference_after_hashes: bool = False


#: lm-eval's GSM8K tasks by name; a question's ``lmeval_task`` picks one (gsm8k when it names none).
LMEVAL_TASKS = {
    "gsm8k": LmevalScoring(LMEVAL_STOP, LMEVAL_STRICT, 0),
    # until has a fifth, "<|im_end|>", which lm-eval's chat body leaves out (it sends four).
    "gsm8k_cot_llama": LmevalScoring(("<|eot_id|>", "<|start_header_id|>user<|end_header_id|>", "Q:", "</s>"),
                                     re.compile(r"The final answer is ((-?[$0-9.,]{2,})|(-?[0-9]+))"), -1, True),
}
# A minus right after a letter or digit is a hyphen or an operator ("x-5", "20-2"), and one followed by a
# space is a dash ("- 18", "Answer - 18"): neither is a sign. Commas between digits group them, wherever
# they stand ("1,8" is 18, as lm-eval and the gold's own normalisation read it).
_NUMBER = r"(?:(?<!\w)-)?(?:\$\s?)?\d+(?:,\d+)*(?:\.\d+)?"
_ANY_NUMBER = re.compile(_NUMBER)
_AFTER_HASHES = re.compile(r"####\s*(-?\$?\s?\d+(?:,\d+)*(?:\.\d+)?)")
_PLAIN = re.compile(r"(-?)(\d+)(?:\.(\d+))?")


def _ascii_digits(digits: str) -> str:
    return "".join(str(unicodedata.decimal(ch)) for ch in digits)


def normalise_number(text: str) -> str | None:
    """``"$1,234.50."`` -> ``"1234.5"``, ``"-7"`` -> ``"-7"``, ``"18.00"`` -> ``"18"``, ``"١٢"`` -> ``"12"``;
    None when not a plain decimal number.

    Done on the digits as text, so a number of any length keeps every digit (a decimal context of 28
    digits would round two long numbers to one, and raise on quantising them) and nothing like an
    exponent, ``NaN`` or ``Infinity`` is read as a number."""
    if not isinstance(text, str):
        return None
    cleaned = text.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    match = _PLAIN.fullmatch(cleaned)
    if not match:
        return None
    sign, whole, fraction = match.group(1), _ascii_digits(match.group(2)).lstrip("0") or "0", match.group(3)
    fraction = _ascii_digits(fraction).rstrip("0") if fraction else ""
    if whole == "0" and not fraction:
        sign = ""
    return f"{sign}{whole}" + (f".{fraction}" if fraction else "")


def last_number(reply: str) -> str | None:
    """The last number anywhere in the reply, normalised: what rigctl's own score compares."""
    matches = _ANY_NUMBER.findall(reply)
    return normalise_number(matches[-1]) if matches else None


def gsm8k_gold(answer: str) -> str:
    """The gold number of a GSM8K answer field (``... #### 72``), or the field itself when it is a bare number."""
    match = _AFTER_HASHES.search(answer) if "####" in answer else None
    gold = normalise_number(match.group(1) if match else answer)
    if gold is None:
        raise ValueError(f"no gold number in {answer[-60:]!r}")
    return gold


def lmeval_cut(reply: str, stops: Sequence[str] = LMEVAL_STOP) -> str:
    """The reply as lm-eval's task sees it: up to the first of its stop sequences."""
    for stop in stops:
        reply = reply.split(stop)[0]
    return reply


def lmeval_filter(pattern: re.Pattern[str], group_select: int, reply: str) -> str:
    """lm-eval's ``RegexFilter`` on one reply: the selected match, its first non-empty group when the pattern
    has several, stripped; ``[invalid]`` when nothing matches."""
    matches = pattern.findall(reply)
    if not matches:
        return LMEVAL_FALLBACK
    match = matches[group_select]
    if isinstance(match, tuple):
        match = next((group for group in match if group), LMEVAL_FALLBACK)
    return match.strip()


def lmeval_ignore(text: str) -> str:
    """What lm-eval's ``exact_match`` compares: the task's ``regexes_to_ignore`` removed in order, lower case."""
    for pattern in LMEVAL_IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def score_gsm8k(reply: str, gold: str, answer: str, finish_reason: str, lmeval_task: str = "gsm8k") -> dict[str, Any]:
    """rigctl's ``score`` (the reply's last number, normalised, against ``gold``) and lm-eval's strict-match and
    flexible-extract as ``lmeval_task`` (:data:`LMEVAL_TASKS`) computes them against the dataset's ``answer``
    field. A wrong answer says why in ``error``."""
    scoring = LMEVAL_TASKS[lmeval_task]
    number = last_number(reply)
    cut = lmeval_cut(reply, scoring.stop)
    strict = lmeval_filter(scoring.strict, scoring.strict_group, cut)
    flexible = lmeval_filter(LMEVAL_FLEXIBLE, -1, cut)
    reference = lmeval_ignore(answer.split("####")[-1].strip() if scoring.reference_after_hashes else answer)
    out = {"number": number, "gold": gold, "score": int(number == gold),
           "lmeval_strict": strict, "lmeval_strict_match": int(lmeval_ignore(strict) == reference),
           "lmeval_flexible": flexible, "lmeval_flexible_extract": int(lmeval_ignore(flexible) == reference),
           "cutoff": finish_reason == "length", "finish_reason": finish_reason}
    if number != gold:
        out["error"] = "no number in the reply" if number is None else f"last number {number}, gold {gold}"
    return out


# ----------------------------------------------------------------------------------------------- tools

# A chat template that never renders the tool documents (SmolLM2's, say) gives a model no tools to call:
# llama-server drops them and every BFCL reply is tool-less. /props says so in chat_template_caps (llama.cpp
# probes the template with a tool and reports supports_tools); a server that does not say is asked to render
# a probe tool through /apply-template instead.
PROBE_TOOL = "rigctl_probe_tool"


def tool_support(props: Any, render: Callable[[dict[str, Any]], Any]) -> tuple[bool, str]:
    """Whether the served chat template carries tools, and how that was told: ``/props``
    ``chat_template_caps.supports_tools`` when the server reports it, else a probe tool rendered by
    ``render`` (a POST to ``/apply-template``) and looked for in the prompt."""
    caps = props.get("chat_template_caps") if isinstance(props, Mapping) else None
    reported = caps.get("supports_tools") if isinstance(caps, Mapping) else None
    if isinstance(reported, bool):
        return reported, f"/props chat_template_caps.supports_tools is {str(reported).lower()}"
    probe = {"name": PROBE_TOOL, "description": "Reports nothing.", "parameters": {"type": "dict", "properties": {}}}
    answer = render({"messages": [{"role": "user", "content": "Which tools do you have?"}],
                     "tools": bfcl_tools([probe])})
    prompt = answer.get("prompt") if isinstance(answer, Mapping) else None
    return isinstance(prompt, str) and PROBE_TOOL in prompt, \
        "a tool sent to /apply-template does not appear in the prompt"


def no_tools_problem(task: str, how: str) -> str:
    """The one line that refuses a tool-calling task on a template without tools; ``how`` says how it was told."""
    return (f"refusing {task}: the model's chat template cannot carry tools ({how}), so every reply would be "
            f"tool-less; serve a template with tool support (llama-server --chat-template-file), or set "
            f"allow_template_without_tools: true in the task to measure exactly that")


# ----------------------------------------------------------------------------------------------- choice


def score_choice(label_probs: Mapping[str, float | None], gold: str) -> dict[str, Any]:
    """The predicted label is the most probable label token; labels outside the server's top-n count as
    unseen (None) and lose to any seen label. No label seen: no prediction, score 0."""
    seen = {label: p for label, p in label_probs.items() if p is not None}
    pred = max(seen, key=lambda label: seen[label]) if seen else None
    return {"pred": pred, "gold": gold, "score": int(pred == gold), "label_probs": dict(label_probs),
            "label_mass": sum(seen.values()), "cutoff": False}


# ----------------------------------------------------------------------------------------------- requests, records
# Request bodies and answer records from raw JSON, shared by the controller's async runner and the host's
# eval job (which ships this file and speaks HTTP with the standard library): one set of rules for both.

DEFAULT_SEED = 1234


def messages(system: str | None, user: Sequence[Mapping[str, Any]] | str) -> list[dict[str, Any]]:
    turns = [{"role": "user", "content": user}] if isinstance(user, str) else [dict(m) for m in user]
    return ([{"role": "system", "content": system}] if system else []) + turns


def chat_request(scorer: str, data: Mapping[str, Any], request: Mapping[str, Any], *, seed: int = DEFAULT_SEED,
                 thinking: bool = False) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body for a gsm8k or bfcl_simple question: seeded, thinking off unless asked
    (``chat_template_kwargs.enable_thinking``), with the task's ``request`` settings
    (:meth:`rigctl.evals.tasks.LoadedTask.request`): ``temperature``, ``max_tokens`` (None: no limit sent),
    ``stop`` (sent when given), and for bfcl_simple ``bfcl_notes``. A gsm8k question's ``prompt`` is the user's
    text, or the whole conversation (lm-eval's request: its examples as turns)."""
    body: dict[str, Any] = {"temperature": request["temperature"], "seed": seed,
                            "chat_template_kwargs": {"enable_thinking": thinking}}
    if request.get("max_tokens") is not None:
        body["max_tokens"] = request["max_tokens"]
    if request.get("stop"):
        body["stop"] = list(request["stop"])
    if scorer == "gsm8k":
        body["messages"] = messages(data["system"], data["prompt"])
    elif scorer == "bfcl_simple":
        body["messages"] = messages(data["system"], data["messages"])
        body["tools"] = bfcl_tools([data["function"]], notes=bool(request.get("bfcl_notes", True)))
    else:
        raise ValueError(f"scorer {scorer!r} does not chat")
    return body


@dataclass(frozen=True)
class Unreadable:
    """Stands in for an answer whose body the client could not hold (see
    :func:`rigctl.hostside.llama_server_http.decode_json`): scored as a wrong answer with ``reason``."""

    reason: str


class NoAnswer(ValueError):
    """A 200 that carries no answer to score: the run stops on it, to be resumed."""


def _message(answer: Any) -> tuple[Mapping[str, Any], Mapping[str, Any], str]:
    """The first choice, its message and what was wrong with the answer's shape ("" when nothing).
    NoAnswer when there are no choices at all."""
    if isinstance(answer, Unreadable):
        return {}, {}, f"unreadable answer: {answer.reason}"
    choices = answer.get("choices") if isinstance(answer, Mapping) else None
    if not isinstance(choices, list) or not choices:
        raise NoAnswer(f"no choices in the answer: {_excerpt(answer)}")
    choice = choices[0]
    if not isinstance(choice, Mapping):
        return {}, {}, f"the first choice is no object: {_excerpt(choice)}"
    message = choice.get("message")
    if message is None:
        return choice, {}, ""
    if not isinstance(message, Mapping):
        return choice, {}, f"the message is no object: {_excerpt(message)}"
    return choice, message, ""


def _excerpt(value: Any, limit: int = 200) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    except (ValueError, RecursionError):
        text = repr(type(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return "" if content is None else _excerpt(content)


def _chat_reply(answer: Any) -> dict[str, Any]:
    choice, message, problem = _message(answer)
    finish = choice.get("finish_reason")
    usage = answer.get("usage") if isinstance(answer, Mapping) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, Mapping) else None
    out: dict[str, Any] = {"reply": _text(message.get("content")), "finish_reason": finish if isinstance(finish, str)
                           else "", "tokens": tokens if isinstance(tokens, int) else None}
    if message.get("reasoning_content"):
        out["reasoning"] = _text(message["reasoning_content"])
    if problem:
        out["error"] = problem
    return out


def _arguments(raw: Any) -> Any:
    """Tool-call arguments: JSON text decoded; text that is not JSON, or that decodes to a lone surrogate
    (which the answers file could not hold), is kept as text (the checker says so)."""
    if not isinstance(raw, str):
        return raw
    try:
        value = json.loads(raw)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError):  # not JSON, an integer past Python's digit limit, nesting too deep,
        return raw                        # a lone surrogate (UnicodeEncodeError is a ValueError)
    return value


def _calls(message: Mapping[str, Any]) -> tuple[list[tuple[str, Any]], str]:
    """(name, arguments) of every tool call, and what was malformed about them ("" when nothing)."""
    items = message.get("tool_calls")
    if items is None:
        return [], ""
    if not isinstance(items, list):
        return [], f"tool_calls is no list: {_excerpt(items)}"
    calls: list[tuple[str, Any]] = []
    for item in items:
        function = item.get("function") if isinstance(item, Mapping) else None
        if not isinstance(function, Mapping):
            return calls, f"a tool call without a function object: {_excerpt(item)}"
        name = function.get("name", "")
        calls.append((name if isinstance(name, str) else _excerpt(name), _arguments(function.get("arguments", ""))))
    return calls, ""


def gsm8k_record(data: Mapping[str, Any], answer: Any) -> dict[str, Any]:
    reply = _chat_reply(answer)
    scored = score_gsm8k(reply["reply"], data["gold"], data["answer"], reply["finish_reason"],
                         data.get("lmeval_task", "gsm8k"))
    return {**reply, **scored, **({"error": reply["error"]} if "error" in reply else {})}


def bfcl_record(data: Mapping[str, Any], answer: Any) -> dict[str, Any]:
    reply = _chat_reply(answer)
    _, message, _ = _message(answer)
    calls, problem = _calls(message)
    try:
        check = Check(False, problem, "simple_function_checker:malformed_call") if problem else \
            check_simple_call(data["function"], calls, data["possible_answer"])
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # values no checker rule foresaw
        check = Check(False, f"arguments the checker cannot read: {exc}", "simple_function_checker:unreadable")
    if reply.get("error"):
        check = Check(False, reply["error"], "malformed_answer")
    toolless = not calls
    return {**reply, "tool_calls": [{"name": n, "arguments": a} for n, a in calls], "score": int(check.valid),
            "error": check.error, "error_type": check.error_type, "toolless": toolless,
            "missed_call": toolless and looks_like_missed_call(reply["reply"]),
            "cutoff": reply["finish_reason"] == "length"}


def template_request(data: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/apply-template`` body of a choice question: the model's own chat template, thinking closed."""
    return {"messages": messages(data["system"], data["prompt"]), "chat_template_kwargs": {"enable_thinking": False}}


def completion_request(prompt: str, *, n_probs: int, seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """One greedy token from ``/completion`` with the top ``n_probs`` candidates' probabilities."""
    return {"prompt": prompt, "n_predict": 1, "n_probs": n_probs, "temperature": 0.0, "seed": seed,
            "cache_prompt": True}


def _probability(entry: Mapping[str, Any]) -> float:
    return math.exp(float(entry["logprob"])) if "logprob" in entry else float(entry.get("prob", 0.0))


def first_token_probs(answer: Any) -> tuple[dict[int, float], str]:
    """Token id -> probability of the first generated position's top candidates, and the most probable
    token's text. Candidates that cannot be read (no id, a probability that is no number) are left out;
    no readable position raises ValueError; no positions at all, NoAnswer."""
    if isinstance(answer, Unreadable):
        raise ValueError(f"unreadable answer: {answer.reason}")
    positions = answer.get("completion_probabilities") if isinstance(answer, Mapping) else None
    if not isinstance(positions, list) or not positions:
        raise NoAnswer(f"no completion_probabilities in the answer (was n_probs sent?): {_excerpt(answer)}")
    if not isinstance(positions[0], Mapping):
        raise ValueError(f"the first position is no object: {_excerpt(positions[0])}")
    first = positions[0]
    entries = first.get("top_logprobs") or first.get("top_probs") or first.get("probs") or []
    probs: dict[int, float] = {}
    best: tuple[float, str] | None = None
    for entry in entries if isinstance(entries, list) else []:
        try:
            token, probability = int(entry["id"]), _probability(entry)
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
        if not 0.0 <= probability <= 1.0:
            continue
        probs[token] = probability
        if best is None or probability > best[0]:
            best = (probability, str(entry.get("token", entry.get("tok_str", ""))))
    return probs, best[1] if best else str(first.get("token", first.get("tok_str", "")))


def label_token(label: str, tokenize_answer: Mapping[str, Any]) -> dict[str, Any]:
    """A label's first token from the server's ``/tokenize`` answer (``with_pieces``)."""
    tokens = tokenize_answer.get("tokens") or []
    if not tokens:
        raise ValueError(f"label {label!r}: the server's tokenizer gives no tokens")
    first = tokens[0]
    if isinstance(first, Mapping):
        piece = first.get("piece", "")
        piece = bytes(piece).decode("utf-8", errors="replace") if isinstance(piece, list) else str(piece)
        return {"id": int(first["id"]), "piece": piece, "n_tokens": len(tokens)}
    return {"id": int(first), "piece": "", "n_tokens": len(tokens)}


def clashing_labels(labels: Sequence[str], tokens: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    """Two labels of one set that start with the same token (they could not be told apart), or None."""
    seen: dict[int, str] = {}
    for label in labels:
        first = int(tokens[label]["id"])
        if first in seen:
            return seen[first], label
        seen[first] = label
    return None


def choice_record(data: Mapping[str, Any], answer: Any,
                  tokens: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    try:
        probs, best = first_token_probs(answer)
    except NoAnswer:
        raise
    except ValueError as exc:
        probs, best, problem = {}, "", str(exc)
    else:
        problem = ""
    label_probs = {label: probs.get(int(tokens[label]["id"])) for label in data["labels"]}
    out = {**score_choice(label_probs, data["gold"]), "top_token": best}
    if problem or out["pred"] is None:
        out["error"] = problem or "no label among the server's top candidates"
    elif not out["score"]:
        out["error"] = f"picked {out['pred']!r}, gold {data['gold']!r}"
    return out


# ----------------------------------------------------------------------------------------------- summary


class _Sums:
    """One block of a summary, added to an answer at a time."""

    def __init__(self, scorer: str):
        self.scorer = scorer
        self.n = self.cutoffs = self.toolless = self.missed_calls = 0
        self.sums = dict.fromkeys(GSM8K_SCORES if scorer == "gsm8k" else ("score",), 0.0)

    def add(self, row: Mapping[str, Any]) -> None:
        self.n += 1
        self.sums["score"] += float(row["score"])
        for key in self.sums.keys() - {"score"}:
            self.sums[key] += float(row.get(key, 0))
        self.cutoffs += 1 if row.get("cutoff") else 0
        self.toolless += 1 if row.get("toolless") else 0
        self.missed_calls += 1 if row.get("missed_call") else 0

    def mean(self, key: str = "score") -> float | None:
        return self.sums[key] / self.n if self.n else None

    def block(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n": self.n, "score": self.mean(), "cutoffs": self.cutoffs}
        out.update({key: self.mean(key) for key in self.sums if key != "score"})
        if self.scorer == "bfcl_simple":
            out["toolless"], out["missed_calls"] = self.toolless, self.missed_calls
        return out


class Tally:
    """A run's summary kept as its answers come (:func:`summarise`'s, without holding the answers): sums and
    counts per set and overall, so a run of any length costs the same memory and the same time per answer."""

    def __init__(self, scorer: str):
        self.scorer = scorer
        self.overall = _Sums(scorer)
        self.sets: dict[str, _Sums] = {}

    def add(self, row: Mapping[str, Any]) -> None:
        name = str(row["set"])
        block = self.sets.get(name) or self.sets.setdefault(name, _Sums(self.scorer))
        block.add(row)
        self.overall.add(row)

    def summary(self) -> dict[str, Any]:
        """Per set and overall: n, score (mean), cut-offs; tool-less and missed calls for bfcl_simple;
        lm-eval's two scores for gsm8k. ``overall.score`` averages questions, ``overall.macro`` averages sets."""
        per_set = {name: block.block() for name, block in sorted(self.sets.items())}
        overall = self.overall.block()
        scores = [s["score"] for s in per_set.values() if s["score"] is not None]
        overall["macro"] = sum(scores) / len(scores) if scores else None
        return {"sets": per_set, "overall": overall}


def summarise(rows: Iterable[Mapping[str, Any]], scorer: str) -> dict[str, Any]:
    """:meth:`Tally.summary` of ``rows``."""
    tally = Tally(scorer)
    for row in rows:
        tally.add(row)
    return tally.summary()
