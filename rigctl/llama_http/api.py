"""What llama-server says and is asked, without a connection: the typed records of its answers, the pure parsers
that make them (``parse_*``, tested without a server) and the request bodies the clients send.

Requests are greedy and thinking-off unless asked otherwise: ``temperature=0.0``, a fixed ``seed`` and
``chat_template_kwargs={"enable_thinking": False}``. With thinking on, ``reasoning_content`` holds the
reasoning and ``content`` the reply proper (the server splits them)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from rigctl.hostside.llama_server_http import ErrorBody, decode_json, error_body, props_fields

DEFAULT_SEED = 1234
Message = Mapping[str, Any]

# The serving figures rigctl records, defined here and nowhere else (records and reports name these).
#: Time to first token: the client's clock from sending a streamed request to the first delta that carries
#: content, reasoning or a tool call (a role-only first chunk is not a token).
TTFT_DEFINITION = "client clock, request sent -> first content/reasoning/tool-call delta"
#: Time per output token: the client's clock after the first token, per further token the server counted.
TPOT_DEFINITION = "client clock, (wall - TTFT) / (predicted_n - 1)"
#: Decode speed: the server's own ``timings.predicted_per_second``, as the build in question computes it (over
#: predicted_n or predicted_n - 1, see :attr:`Timings.decode_tokens`). Every llama-server build sends it; only a
#: server that sends the counts without the rate gets predicted_n / predicted_ms, and then no convention is known.
DECODE_DEFINITION = ("server timings.predicted_per_second, as that build counts tokens "
                     "(predicted_n / predicted_ms only where a server sends no rate)")

#: What a record states of its serving figures.
FIGURE_DEFINITIONS = {"ttft": TTFT_DEFINITION, "tpot": TPOT_DEFINITION, "decode": DECODE_DEFINITION}


def tpot_s(ttft_s: float | None, wall_s: float, predicted_n: int) -> float | None:
    """TPOT per :data:`TPOT_DEFINITION`; None without a first token or with fewer than two tokens."""
    return (wall_s - ttft_s) / (predicted_n - 1) if ttft_s is not None and predicted_n > 1 else None


@dataclass(frozen=True)
class Health:
    ok: bool
    status: str  # "ok", "loading model", or the error text


@dataclass(frozen=True)
class Props:
    build_info: str
    model_path: str
    total_slots: int
    n_ctx: int | None
    chat_template: str
    raw: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class Token:
    id: int
    piece: str


@dataclass(frozen=True)
class Timings:
    """The server's own timings of one request (milliseconds, tokens), with the rates it computed itself
    where it sent them (``reported_*``): those are the figures, as that build defines them."""

    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int = 0
    reported_prompt_per_second: float | None = None
    reported_predicted_per_second: float | None = None

    @property
    def prompt_per_second(self) -> float:
        if self.reported_prompt_per_second is not None:
            return self.reported_prompt_per_second
        return 1000.0 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0

    @property
    def decode_tokens(self) -> str | None:
        """Which token count the server's decode rate is over: ``predicted_n - 1`` where its own rate says the
        build counts from the second token (the first one's time is the prompt's), else ``predicted_n``; None
        where the server sent no rate to tell."""
        reported, n, ms = self.reported_predicted_per_second, self.predicted_n, self.predicted_ms
        if reported is None:
            return None
        if n > 1 and ms > 0 and abs(reported - 1000.0 * (n - 1) / ms) < abs(reported - 1000.0 * n / ms):
            return "predicted_n - 1"
        return "predicted_n"

    @property
    def predicted_per_second(self) -> float:
        """Decode speed per :data:`DECODE_DEFINITION`."""
        if self.reported_predicted_per_second is not None:
            return self.reported_predicted_per_second
        return 1000.0 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # as the server sent it: a JSON object, as text
    id: str = ""

    def parsed_arguments(self) -> dict[str, Any] | None:
        """The arguments as a dict, or None when they are not a JSON object."""
        try:
            value = json.loads(self.arguments) if isinstance(self.arguments, str) else self.arguments
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class ChatResult:
    content: str
    reasoning_content: str
    tool_calls: list[ToolCall]
    finish_reason: str  # "stop", "length", "tool_calls"
    timings: Timings | None
    usage: dict[str, Any]
    ttft_s: float | None = None  # streaming only: first content/reasoning/tool delta, client clock
    wall_s: float | None = None  # client clock, whole request
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def cutoff(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True)
class TokenProbs:
    """One generated position: the chosen token and the top-n candidates as ``piece -> probability``."""

    token: str
    id: int
    prob: float
    top: dict[str, float]
    top_ids: dict[int, float]


@dataclass(frozen=True)
class CompletionResult:
    content: str
    stop_type: str  # "eos", "limit", "word"
    probs: list[TokenProbs]
    timings: Timings | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Metrics:
    """One scrape of ``/metrics``: sample name (with ``{labels}`` when it has any) -> value."""

    samples: dict[str, float]

    def value(self, name: str, default: float | None = None) -> float:
        if name in self.samples:
            return self.samples[name]
        if default is None:
            raise KeyError(f"no metric {name!r} (have: {', '.join(sorted(self.samples)) or 'none'})")
        return default

    @property
    def busy_seconds(self) -> float:
        """Seconds the server spent on prompts plus generation since it started."""
        return self.value("llamacpp:prompt_seconds_total", 0.0) + self.value(
            "llamacpp:tokens_predicted_seconds_total", 0.0)


def parse_timings(data: Mapping[str, Any] | None) -> Timings | None:
    if not data:
        return None

    def rate(key: str) -> float | None:
        value = data.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
            and math.isfinite(value) and value >= 0 else None

    return Timings(prompt_n=int(data.get("prompt_n", 0)), prompt_ms=float(data.get("prompt_ms", 0.0)),
                   predicted_n=int(data.get("predicted_n", 0)), predicted_ms=float(data.get("predicted_ms", 0.0)),
                   cache_n=int(data.get("cache_n", 0)), reported_prompt_per_second=rate("prompt_per_second"),
                   reported_predicted_per_second=rate("predicted_per_second"))


def parse_props(data: Mapping[str, Any]) -> Props:
    return Props(**props_fields(data), raw=dict(data))


def _tool_calls(items: Sequence[Mapping[str, Any]] | None) -> list[ToolCall]:
    calls = []
    for item in items or []:
        function = item.get("function") or {}
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):  # some servers send an object
            arguments = json.dumps(arguments)
        calls.append(ToolCall(name=str(function.get("name", "")), arguments=arguments, id=str(item.get("id", ""))))
    return calls


def parse_chat(data: Mapping[str, Any]) -> ChatResult:
    """A non-streamed ``/v1/chat/completions`` answer."""
    try:
        choice = data["choices"][0]
        message = choice.get("message") or {}
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"no choices in the answer: {json.dumps(data)[:200]}") from None
    return ChatResult(content=message.get("content") or "", reasoning_content=message.get("reasoning_content") or "",
                      tool_calls=_tool_calls(message.get("tool_calls")),
                      finish_reason=choice.get("finish_reason") or "",
                      timings=parse_timings(data.get("timings")), usage=dict(data.get("usage") or {}), raw=dict(data))


class ChatStreamAssembler:
    """Folds ``/v1/chat/completions`` stream chunks into one :class:`ChatResult`."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason = ""
        self.timings: Mapping[str, Any] | None = None
        self.usage: dict[str, Any] = {}

    def add(self, chunk: Mapping[str, Any]) -> str:
        """Take one chunk; returns the text it added to the reply (content or reasoning or arguments)."""
        if chunk.get("timings"):
            self.timings = chunk["timings"]
        if chunk.get("usage"):
            self.usage = dict(chunk["usage"])
        added = ""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
                added += delta["content"]
            if delta.get("reasoning_content"):
                self.reasoning.append(delta["reasoning_content"])
                added += delta["reasoning_content"]
            for call in delta.get("tool_calls") or []:
                slot = self.calls.setdefault(int(call.get("index", 0)), {"id": "", "name": "", "arguments": ""})
                function = call.get("function") or {}
                slot["id"] = call.get("id") or slot["id"]
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
                added += function.get("arguments") or function.get("name") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return added

    def result(self, ttft_s: float | None, wall_s: float) -> ChatResult:
        calls = [ToolCall(c["name"], c["arguments"], c["id"]) for _, c in sorted(self.calls.items())]
        return ChatResult(content="".join(self.content), reasoning_content="".join(self.reasoning), tool_calls=calls,
                          finish_reason=self.finish_reason, timings=parse_timings(self.timings), usage=self.usage,
                          ttft_s=ttft_s, wall_s=wall_s)


class StreamError(Exception):
    """The server reported a failure inside a streamed (HTTP 200) reply: the request failed."""

    def __init__(self, body: ErrorBody):
        self.body = body
        super().__init__(f"error in the stream: {body.reason()}")


def parse_sse_line(line: str) -> Mapping[str, Any] | None:
    """One server-sent-events line: the JSON of a ``data:`` line, None for anything else or ``[DONE]``.
    A failure the server sends in either shape (an ``error:`` line, or a ``data:`` line holding ``error``)
    raises :class:`StreamError`."""
    if line.startswith("error:"):
        raise StreamError(error_body(line[6:].strip()))
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    chunk = decode_json(payload)  # nesting or numbers Python cannot hold: a ValueError like any bad chunk
    if isinstance(chunk, Mapping) and "error" in chunk:
        raise StreamError(error_body(payload))
    return chunk


def read_stream(text: str) -> ChatResult:
    """A whole recorded ``/v1/chat/completions`` stream (its lines as sent) as the reply it assembles; no
    client clock, so no TTFT. :class:`StreamError` where the server reported a failure in it."""
    assembler = ChatStreamAssembler()
    for line in text.splitlines():
        chunk = parse_sse_line(line)
        if chunk is not None:
            assembler.add(chunk)
    return assembler.result(None, 0.0)


def _probability(entry: Mapping[str, Any]) -> float:
    # Current servers send logprob; older ones sent prob.
    if "logprob" in entry:
        return math.exp(float(entry["logprob"]))
    return float(entry.get("prob", 0.0))


def parse_completion(data: Mapping[str, Any]) -> CompletionResult:
    """A ``/completion`` answer, with ``completion_probabilities`` when ``n_probs`` was asked."""
    probs = []
    for position in data.get("completion_probabilities") or []:
        top_entries = position.get("top_logprobs") or position.get("top_probs") or position.get("probs") or []
        top: dict[str, float] = {}
        top_ids: dict[int, float] = {}
        for entry in top_entries:
            p = _probability(entry)
            piece = str(entry.get("token", entry.get("tok_str", "")))
            top[piece] = max(p, top.get(piece, 0.0))
            top_ids[int(entry.get("id", -1))] = p
        probs.append(TokenProbs(token=str(position.get("token", position.get("content", ""))),
                                id=int(position.get("id", -1)), prob=_probability(position), top=top, top_ids=top_ids))
    return CompletionResult(content=str(data.get("content", "")), stop_type=str(data.get("stop_type", "")),
                            probs=probs, timings=parse_timings(data.get("timings")), raw=dict(data))


def parse_metrics(text: str) -> Metrics:
    """Prometheus text exposition -> :class:`Metrics`. prometheus_client names every counter sample
    ``*_total`` (llama-server's ``llamacpp:n_tokens_max`` counter reads as ``llamacpp:n_tokens_max_total``)."""
    samples: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    except ValueError as exc:
        raise ValueError(f"not Prometheus text: {exc}") from None
    return Metrics(samples)


def chat_body(messages: Sequence[Message], *, max_tokens: int, temperature: float = 0.0, seed: int = DEFAULT_SEED,
              tools: Sequence[Mapping[str, Any]] | None = None, thinking: bool = False, stream: bool = False,
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of a chat completion: greedy, seeded and thinking off unless asked otherwise."""
    body: dict[str, Any] = {"messages": list(messages), "max_tokens": max_tokens, "temperature": temperature,
                            "seed": seed, "chat_template_kwargs": {"enable_thinking": thinking}}
    if tools:
        body["tools"] = list(tools)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body.update(extra or {})
    return body


def completion_body(prompt: str | Sequence[int], *, n_predict: int, n_probs: int = 0, temperature: float = 0.0,
                    seed: int = DEFAULT_SEED, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt if isinstance(prompt, str) else list(prompt), "n_predict": n_predict,
                            "temperature": temperature, "seed": seed, "cache_prompt": True}
    if n_probs:
        body["n_probs"] = n_probs
    body.update(extra or {})
    return body


def parse_tokens(data: Mapping[str, Any]) -> list[Token]:
    tokens = []
    for item in data["tokens"]:
        if isinstance(item, Mapping):
            piece = item.get("piece", "")
            # Pieces that are not valid UTF-8 on their own come as byte lists.
            if isinstance(piece, list):
                piece = bytes(piece).decode("utf-8", errors="replace")
            tokens.append(Token(int(item["id"]), str(piece)))
        else:
            tokens.append(Token(int(item), ""))
    return tokens
