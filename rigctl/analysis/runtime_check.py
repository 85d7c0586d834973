"""Proofs that the runtime is not to blame for a score.

* :func:`check_template`: every prompt rendered by the server's ``/apply-template`` and by
  transformers' ``apply_chat_template`` with the model's Hugging Face tokenizer must be
  byte-identical; for the rest, the first differing position with context on both sides.
* :func:`check_logits`: the server's next-token probabilities (``/completion`` with ``n_probs``)
  against a float32 transformers reference on the CPU from the Hugging Face checkout: top-1
  agreement and the KL divergence over the server's top-k (both distributions renormalised to those
  k tokens; the rest of the vocabulary is not seen from the server). Both sides get the same token
  ids (tokenised once by the server), so tokenisation cannot blur the comparison.

transformers and torch are not rigctl's dependencies (they are the ``verify`` extra, and large):
the reference side runs as :mod:`rigctl.analysis.hf_reference`, a standard-library script started with
whichever Python has them (:class:`HfReference`, ``--python`` on the CLI; default the Python rigctl
runs on). So a laptop keeps one tools venv for converters and checks, and rigctl's venv stays small.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx

from rigctl.errors import CheckError, ConfigError, ServerError
from rigctl.llama_http import ServerClient

log = logging.getLogger(__name__)

_HELPER = Path(__file__).with_name("hf_reference.py")
_MISSING = 3
DEFAULT_TOP_K = 20
CONTEXT = 40


# ----------------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Conversation:
    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


_WEATHER = _tool("get_weather", "Current weather for a city.",
                 {"city": {"type": "string", "description": "City name"},
                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"])
_AREA = _tool("triangle_area", "Area of a triangle from its base and height.",
              {"base": {"type": "number"}, "height": {"type": "number"}}, ["base", "height"])
_CONVERT = _tool("convert_currency", "Convert an amount between currencies.",
                 {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
                 ["amount", "from", "to"])
#: Written for these checks: math word problems (with and without a system prompt, one multi-turn)
#: and tool-calling requests with their tools.
BUILTIN_PROMPTS: tuple[Conversation, ...] = (
    Conversation("math-apples", [{"role": "user", "content":
                 "Tom has 12 apples and gives 5 to Ann. He then buys 3 bags of 4 apples. How many apples now?"}]),
    Conversation("math-train", [{"role": "user", "content":
                 "A train travels 180 km in 2.5 hours. What is its average speed in km/h?"}]),
    Conversation("math-system", [{"role": "system", "content": "Solve step by step. End with '#### <number>'."},
                                 {"role": "user", "content": "What is 15% of 240?"}]),
    Conversation("math-multiturn", [{"role": "user", "content": "What is 7 * 8?"},
                                    {"role": "assistant", "content": "7 * 8 = 56."},
                                    {"role": "user", "content": "And 56 divided by 4?"}]),
    Conversation("math-unicode", [{"role": "user", "content": "Ein Kuchen kostet 3,50 €. Was kosten 4 Kuchen?"}]),
    Conversation("tools-weather", [{"role": "user", "content": "What's the weather in Lisbon in celsius?"}],
                 [_WEATHER]),
    Conversation("tools-area", [{"role": "user", "content": "Find the area of a triangle with base 10 and height 5."}],
                 [_AREA, _WEATHER]),
    Conversation("tools-currency", [{"role": "system", "content": "Use the tools when they help."},
                                    {"role": "user", "content": "Convert 250 euros to dollars."}], [_CONVERT]),
)


def load_prompts(path: Path) -> list[Conversation]:
    """JSONL, one conversation a line: ``{"name": ..., "messages": [...], "tools": [...]}``."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read prompts: {exc.strerror}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            out.append(Conversation(str(data.get("name") or f"{path.stem}-{number}"), list(data["messages"]),
                                    data.get("tools")))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{number}: not a conversation ({type(exc).__name__}: {exc})") from None
    if not out:
        raise ConfigError(f"{path}: no prompts")
    return out


# ----------------------------------------------------------------------------------------------- reference


@dataclass(frozen=True)
class HfReference:
    """The transformers side: a Hugging Face checkout and a Python that has transformers and torch."""

    checkout: Path
    python: Path = Path(sys.executable)
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not (self.checkout / "config.json").is_file() and not (self.checkout / "tokenizer_config.json").is_file():
            raise ConfigError(f"{self.checkout}: not a Hugging Face checkout (no config.json or tokenizer_config.json)")

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        try:
            done = subprocess.run([str(self.python), str(_HELPER)], input=json.dumps(request), capture_output=True,
                                  text=True, timeout=self.timeout, env=env, check=False)
        except FileNotFoundError:
            raise ConfigError(f"--python {self.python}: no such interpreter") from None
        except subprocess.TimeoutExpired:
            raise CheckError(f"transformers reference ({request['op']}) ran past {self.timeout:g} s") from None
        if done.returncode == _MISSING:
            raise ConfigError(f"{done.stderr.strip()}: install the extra (pip install 'rigctl[verify]') or pass "
                              "--python with a Python that has transformers and torch")
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
            raise CheckError(f"transformers reference ({request['op']}) failed: {last}")
        return json.loads(done.stdout)

    def render(self, conversations: Sequence[Conversation], *, chat_template: str | None = None,
               template_kwargs: dict[str, Any] | None = None) -> list[str]:
        answer = self._call({"op": "render", "checkout": str(self.checkout), "chat_template": chat_template,
                             "template_kwargs": template_kwargs or {},
                             "conversations": [{"messages": c.messages, "tools": c.tools} for c in conversations]})
        return [str(p) for p in answer["prompts"]]

    def logprobs(self, prompts: Sequence[Sequence[int]], candidates: Sequence[Sequence[int]],
                 top_k: int) -> list[dict[str, Any]]:
        answer = self._call({"op": "logits", "checkout": str(self.checkout), "prompts": [list(p) for p in prompts],
                             "candidates": [list(c) for c in candidates], "top_k": top_k})
        return answer["results"]


# ----------------------------------------------------------------------------------------------- template


def first_difference(a: str, b: str) -> int | None:
    """Index of the first character where ``a`` and ``b`` differ (the shorter length when one is a
    prefix of the other), or None when they are identical."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def context(text: str, position: int, width: int = CONTEXT) -> str:
    """``width`` characters either side of ``position``, with the position marked by ``⟦⟧``."""
    start = max(0, position - width)
    return (("…" if start else "") + repr(text[start:position])[1:-1] + "⟦" + repr(text[position:position + 1])[1:-1]
            + "⟧" + repr(text[position + 1:position + width])[1:-1] + ("…" if position + width < len(text) else ""))


@dataclass(frozen=True)
class TemplateResult:
    name: str
    server: str
    reference: str
    position: int | None  # first differing character, None when identical

    @property
    def identical(self) -> bool:
        return self.position is None


Result = TypeVar("Result")


@dataclass(frozen=True)
class ServerCheck(Generic[Result]):
    """One served endpoint checked against a transformers checkout: a result per prompt."""

    endpoint: str
    checkout: str
    results: tuple[Result, ...]


@dataclass(frozen=True)
class TemplateCheck(ServerCheck[TemplateResult]):
    """Each prompt as the server's ``/apply-template`` and transformers' ``apply_chat_template`` render it."""

    @property
    def identical(self) -> int:
        return sum(r.identical for r in self.results)

    @property
    def differing(self) -> tuple[TemplateResult, ...]:
        return tuple(r for r in self.results if not r.identical)


def server_render(server: ServerClient, conversation: Conversation, template_kwargs: dict[str, Any]) -> str:
    """The prompt as the server renders it (``/apply-template``), tools included when the conversation has any."""
    if not conversation.tools:
        return server.apply_template(conversation.messages, **template_kwargs)
    # ServerClient.apply_template sends no tools: post the same body with them, errors as ServerError.
    body: dict[str, Any] = {"messages": conversation.messages, "tools": conversation.tools}
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    try:
        response = server.http.post("/apply-template", json=body)
    except httpx.HTTPError as exc:
        raise ServerError(str(server.endpoint), "POST /apply-template", f"{type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        raise ServerError(str(server.endpoint), "POST /apply-template", f"HTTP {response.status_code}",
                          response.status_code)
    return str(response.json()["prompt"])


def check_template(server: ServerClient, reference: HfReference, conversations: Sequence[Conversation], *,
                   chat_template: str | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> TemplateCheck:
    """Render every conversation on both sides and compare byte for byte.

    ``chat_template`` replaces the tokenizer's template on the reference side (to check a template
    file, or to prove the check catches a difference); ``template_kwargs`` go to both sides
    (default: thinking off, as every eval runs)."""
    kwargs = {"enable_thinking": False} if template_kwargs is None else template_kwargs
    served = [server_render(server, c, kwargs) for c in conversations]
    expected = reference.render(conversations, chat_template=chat_template, template_kwargs=kwargs)
    results = tuple(TemplateResult(c.name, s, r, first_difference(s, r))
                    for c, s, r in zip(conversations, served, expected, strict=True))
    return TemplateCheck(endpoint=str(server.endpoint), checkout=str(reference.checkout), results=results)


# ----------------------------------------------------------------------------------------------- logits


def kl_over_top(server_probs: dict[int, float], reference_logprobs: dict[int, float]) -> float:
    """KL(server || reference) over the server's top-k tokens, each side renormalised to them."""
    ids = [i for i, p in server_probs.items() if p > 0 and i in reference_logprobs]
    if not ids:
        return float("nan")
    ps = [server_probs[i] for i in ids]
    qs = [math.exp(reference_logprobs[i]) for i in ids]
    zp, zq = sum(ps), sum(qs)
    return sum((p / zp) * math.log((p / zp) / (q / zq)) for p, q in zip(ps, qs, strict=True) if q > 0)


@dataclass(frozen=True)
class LogitsResult:
    name: str
    n_tokens: int
    server_top1: int
    reference_top1: int
    server_top1_prob: float
    reference_top1_prob: float
    server_mass: float  # probability mass the server's top-k covers
    kl: float

    @property
    def agree(self) -> bool:
        return self.server_top1 == self.reference_top1


@dataclass(frozen=True)
class LogitsCheck(ServerCheck[LogitsResult]):
    """Each prompt's next-token distribution from the server's top-k against the reference's."""

    model_path: str
    build: str
    top_k: int

    @property
    def agreement(self) -> int:
        return sum(r.agree for r in self.results)

    @property
    def mean_kl(self) -> float:
        values = [r.kl for r in self.results if not math.isnan(r.kl)]
        return sum(values) / len(values) if values else float("nan")

    @property
    def max_kl(self) -> float:
        values = [r.kl for r in self.results if not math.isnan(r.kl)]
        return max(values) if values else float("nan")


def check_logits(server: ServerClient, reference: HfReference, conversations: Sequence[Conversation], *,
                 top_k: int = DEFAULT_TOP_K) -> LogitsCheck:
    """Next-token distributions of the served artifact against the float32 reference, prompt by prompt."""
    if top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {top_k}")
    props = server.props()
    names, prompt_ids, server_top = [], [], []
    for conversation in conversations:
        text = server_render(server, conversation, {"enable_thinking": False})
        ids = [t.id for t in server.tokenize(text, add_special=True)]
        done = server.complete(ids, n_predict=1, n_probs=top_k)
        if not done.probs:
            raise CheckError(f"{server.endpoint}: /completion returned no probabilities for {conversation.name}")
        names.append(conversation.name)
        prompt_ids.append(ids)
        server_top.append(done.probs[0].top_ids)
    reference_out = reference.logprobs(prompt_ids, [list(t) for t in server_top], top_k)
    results = []
    for name, ids, top, ref in zip(names, prompt_ids, server_top, reference_out, strict=True):
        ref_candidates = {int(k): float(v) for k, v in ref["candidates"].items()}
        ref_top1, ref_top1_logprob = ref["top"][0]
        server_top1 = max(top, key=top.__getitem__)
        results.append(LogitsResult(name=name, n_tokens=len(ids), server_top1=server_top1,
                                    reference_top1=int(ref_top1), server_top1_prob=top[server_top1],
                                    reference_top1_prob=math.exp(ref_top1_logprob), server_mass=sum(top.values()),
                                    kl=kl_over_top(top, ref_candidates)))
    return LogitsCheck(endpoint=str(server.endpoint), model_path=props.model_path, build=props.build_info,
                       checkout=str(reference.checkout), top_k=top_k, results=tuple(results))
