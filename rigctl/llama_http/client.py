"""An HTTP client for one llama-server (or any OpenAI-compatible endpoint), sync and async.

Everything rigctl asks a server goes through here: evals, server-speed benches, the drafter race, the
exporter and the MCP tools. One :class:`Endpoint` names the server (base URL, API key, a label for
messages); :class:`ServerClient` (httpx.Client) and :class:`AsyncServerClient` (httpx.AsyncClient) have
the same methods, the async ones awaited::

    from rigctl.llama_http import Endpoint, ServerClient

    endpoint = server_endpoint(host, host.server("smollm2"))     # rigctl.forward; or Endpoint("http://h:8080")
    with ServerClient(endpoint) as server:
        server.health()                        # Health(ok=True, status="ok")
        server.props().build_info              # "b11434-1d2f3a4", also .model_path, .total_slots, .n_ctx
        server.tokenize(" yes")                # [Token(id=9805, piece=" yes")]
        server.apply_template(messages)        # the prompt text in the model's own chat template
        reply = server.chat(messages, max_tokens=256, seed=1234)   # ChatResult
        reply.content, reply.reasoning_content, reply.tool_calls, reply.finish_reason, reply.timings
        stream = server.chat_stream(messages, max_tokens=128)      # ChatResult + ttft_s, wall_s
        done = server.complete(prompt, n_predict=1, n_probs=20)    # CompletionResult, .probs[0].top
        server.metrics().value("llamacpp:prompt_seconds_total")    # Metrics (Prometheus text, parsed)
        server.post_json("/v1/chat/completions", body)             # any JSON endpoint, raw answer

Every call has explicit timeouts (:class:`Timeouts`). Connection errors (refused, reset, the server closing
the connection mid-request) and 5xx answers (including 503 "loading model") are retried with exponential
backoff (:class:`Retry`); 4xx answers and read timeouts are not, since retrying cannot change them. What
still fails raises :class:`rigctl.errors.ServerError` naming the endpoint, the call and the reason.
What the server answers is parsed by :mod:`rigctl.llama_http.api`'s pure functions; the bodies sent are built
there too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import certifi
import httpx

from rigctl.errors import ConfigError, ServerError, UnreadableAnswer
from rigctl.hostside.llama_server_http import (
    RETRY_ATTEMPTS,
    RETRY_BACKOFF,
    RETRY_MAX_WAIT,
    UnreadableJSON,
    attempts_within,
    decode_json,
    error_body,
    retry_wait,
    retryable_status,
)
from rigctl.llama_http.api import (
    ChatResult,
    ChatStreamAssembler,
    CompletionResult,
    Health,
    Message,
    Metrics,
    Props,
    StreamError,
    Token,
    chat_body,
    completion_body,
    parse_chat,
    parse_completion,
    parse_metrics,
    parse_props,
    parse_sse_line,
    parse_tokens,
)
from rigctl.trust import MASK, redact, register_secret

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Timeouts:
    """Seconds. ``read`` bounds one whole generation, so it is long by default."""

    connect: float = 5.0
    read: float = 600.0
    write: float = 30.0
    pool: float = 600.0  # waiting for a free connection when more requests are queued than connections

    def httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect, read=self.read, write=self.write, pool=self.pool)


@dataclass(frozen=True)
class Retry:
    """``attempts`` tries in all; the n-th wait is ``backoff * 2**n`` seconds (capped, with jitter)."""

    attempts: int = RETRY_ATTEMPTS
    backoff: float = RETRY_BACKOFF
    max_wait: float = RETRY_MAX_WAIT

    def wait(self, attempt: int) -> float:
        return retry_wait(attempt, self.backoff, self.max_wait)

    @classmethod
    def within(cls, wait_s: float) -> Retry:
        """Enough attempts that their waits add up to ``wait_s`` (a server's restart:
        :func:`rigctl.hostside.units.restart_wait_s`), never fewer than the default."""
        return cls(attempts=attempts_within(wait_s, RETRY_BACKOFF, RETRY_MAX_WAIT))


NO_RETRY = Retry(attempts=1)


@dataclass(frozen=True)
class Endpoint:
    """One server: its base URL (``http://host:port``, no ``/v1``), API key and a label for messages.

    ``via``: where this process connects instead of ``url``, a local SSH forward to a server that listens on
    its host's loopback only (:mod:`rigctl.forward`); ``url`` stays the server's own address on its host,
    what records and messages name, the same in every command."""

    url: str
    api_key: str | None = None
    label: str = ""
    via: str | None = None

    def __post_init__(self) -> None:
        for url in (self.url, self.via or self.url):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"server URL {url!r}: must start with http:// or https://")
        object.__setattr__(self, "url", self.url.rstrip("/").removesuffix("/v1"))
        register_secret(self.api_key)  # masked in every log line from now on
        if not self.label:
            object.__setattr__(self, "label", self.url)

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        key = "None" if self.api_key is None else repr(MASK)
        return f"Endpoint(url={self.url!r}, api_key={key}, label={self.label!r}, via={self.via!r})"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def dial_url(self) -> str:
        """The base URL this process's HTTP client connects to."""
        return self.via or self.url


# ----------------------------------------------------------------------------------------------- transport


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    body: Any = None

    @property
    def what(self) -> str:
        return f"{self.method} {self.path}"


def _error_reason(response: httpx.Response) -> str:
    body = error_body(response.content)
    return f"HTTP {response.status_code}: {body.reason() if body.message.strip() else response.reason_phrase}"


_SSL_CONTEXT: ssl.SSLContext | None = None


def _ssl_context() -> ssl.SSLContext:
    """One verifying TLS context per process: loading the CA bundle costs tens of milliseconds of CPU, and an
    eval or bench opens a client per run."""
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = ssl.create_default_context(cafile=certifi.where())  # what httpx verifies against
    return _SSL_CONTEXT


_RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectTimeout)


class _Attempts:
    """The retry loop's decisions for one call, whichever client does the I/O: which failures and answers
    are tried again, how long to wait, and the error once it gives up. Iterate for the attempts; after each
    one, :meth:`failed` (an httpx error) or :meth:`answered` (a response), then sleep :meth:`wait` seconds."""

    def __init__(self, client: _Base, call: _Call, retry: Retry):
        self.client, self.call, self.retry = client, call, retry
        self.attempt = -1

    def __iter__(self) -> Iterator[int]:
        for attempt in range(self.retry.attempts):
            self.attempt = attempt
            yield attempt

    @property
    def last(self) -> bool:
        return self.attempt == self.retry.attempts - 1

    def failed(self, exc: httpx.HTTPError) -> None:
        """Raise ServerError unless ``exc`` is transient and attempts are left."""
        if not isinstance(exc, _RETRYABLE):
            raise self.client._fail(self.call, exc, self.attempt + 1) from None
        if self.last:
            raise self.client._fail(self.call, exc, self.retry.attempts) from None
        log.info("%s: %s: %s; retrying", self.client.endpoint, self.call.what, type(exc).__name__)

    def answered(self, response: httpx.Response) -> bool:
        """True when ``response`` is the answer (a 2xx/3xx), False to try again (a retryable status, 5xx, with
        attempts left);
        ServerError for any other 4xx/5xx. An error's reason is read from its body: read it first."""
        if retryable_status(response.status_code) and not self.last:
            log.info("%s: %s: HTTP %s; retrying", self.client.endpoint, self.call.what, response.status_code)
            return False
        self.client._check(self.call, response)
        return True

    def wait(self) -> float:
        return self.retry.wait(self.attempt)


class _Stream:
    """A streamed chat reply as its lines arrive: the assembled reply and the time to its first token."""

    def __init__(self, client: _Base, call: _Call, on_text: Callable[[str], None] | None):
        self.client, self.call, self.on_text = client, call, on_text
        self.start = time.perf_counter()
        self.assembler = ChatStreamAssembler()
        self.ttft: float | None = None

    def line(self, line: str) -> None:
        try:
            chunk = self.client._parse(self.call, parse_sse_line, line)
        except StreamError as exc:  # a failure sent inside a 200 reply: this request failed, not an empty reply
            raise ServerError(str(self.client.endpoint), self.call.what, str(exc), exc.body.code) from None
        if chunk is None:
            return
        added = self.assembler.add(chunk)
        if added:
            self.ttft = self.ttft if self.ttft is not None else time.perf_counter() - self.start
            if self.on_text:
                self.on_text(added)

    def result(self) -> ChatResult:
        return self.assembler.result(self.ttft, time.perf_counter() - self.start)


class _Base:
    def __init__(self, endpoint: Endpoint | str, *, timeouts: Timeouts = Timeouts(), retry: Retry = Retry()):
        self.endpoint = endpoint if isinstance(endpoint, Endpoint) else Endpoint(endpoint)
        self.timeouts = timeouts
        self.retry = retry

    def _check(self, call: _Call, response: httpx.Response) -> None:
        if response.status_code >= 400:
            raise ServerError(str(self.endpoint), call.what, _error_reason(response), response.status_code)

    def _fail(self, call: _Call, exc: Exception, attempts: int) -> ServerError:
        # The HTTP library may quote the request's headers (an illegal value, escaped): never the key.
        reason = redact(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, [self.endpoint.api_key])
        if attempts > 1:
            reason += f" (after {attempts} attempts)"
        return ServerError(str(self.endpoint), call.what, reason)

    def _json(self, call: _Call, response: httpx.Response) -> Any:
        try:
            return decode_json(response.content)
        except UnreadableJSON as exc:
            raise UnreadableAnswer(str(self.endpoint), call.what, str(exc)) from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ServerError(str(self.endpoint), call.what, f"not JSON: {response.text[:120]!r}") from None

    def _parse(self, call: _Call, parser: Callable[[Any], Any], data: Any) -> Any:
        try:
            return parser(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ServerError(str(self.endpoint), call.what, f"unexpected answer: {exc}") from None

    @staticmethod
    def _unhealthy(exc: ServerError) -> Health:
        return Health(False, str(exc).split(": ", 2)[-1])

    def _healthy(self, call: _Call, response: httpx.Response) -> Health:
        return Health(True, str(self._json(call, response).get("status", "ok")))


class ServerClient(_Base):
    """Synchronous client (httpx.Client); a context manager. See the module docstring."""

    def __init__(self, endpoint: Endpoint | str, *, timeouts: Timeouts = Timeouts(), retry: Retry = Retry()):
        super().__init__(endpoint, timeouts=timeouts, retry=retry)
        self.http = httpx.Client(base_url=self.endpoint.dial_url, headers=self.endpoint.headers(),
                                 timeout=timeouts.httpx(), verify=_ssl_context())

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _send(self, call: _Call, *, retry: Retry | None = None) -> httpx.Response:
        attempts = _Attempts(self, call, retry or self.retry)
        for _ in attempts:
            try:
                response = self.http.request(call.method, call.path, json=call.body)
            except httpx.HTTPError as exc:
                attempts.failed(exc)
            else:
                if attempts.answered(response):
                    return response
            time.sleep(attempts.wait())
        raise AssertionError("unreachable")

    def _get(self, call: _Call, parser: Callable[[Any], Any]) -> Any:
        response = self._send(call)
        return self._parse(call, parser, self._json(call, response))

    def health(self) -> Health:
        """``GET /health`` once, without retries: ok, or the reason it is not."""
        call = _Call("GET", "/health")
        try:
            response = self._send(call, retry=NO_RETRY)
        except ServerError as exc:
            return self._unhealthy(exc)
        return self._healthy(call, response)

    def wait_healthy(self, timeout: float) -> Health:
        """Poll ``/health`` until it is ok or ``timeout`` seconds pass (then ServerError)."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if health.ok:
                return health
            if time.monotonic() > deadline:
                raise ServerError(str(self.endpoint), "GET /health",
                                  f"not healthy after {timeout:g} s: {health.status}")
            time.sleep(0.25)

    def props(self) -> Props:
        return self._get(_Call("GET", "/props"), parse_props)

    def tokenize(self, text: str, *, add_special: bool = False) -> list[Token]:
        call = _Call("POST", "/tokenize", {"content": text, "add_special": add_special, "with_pieces": True})
        return self._get(call, parse_tokens)

    def apply_template(self, messages: Sequence[Message], **template_kwargs: Any) -> str:
        body: dict[str, Any] = {"messages": list(messages)}
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        return self._get(_Call("POST", "/apply-template", body), lambda d: str(d["prompt"]))

    def chat(self, messages: Sequence[Message], **kwargs: Any) -> ChatResult:
        """Keyword arguments as :func:`chat_body`."""
        call = _Call("POST", "/v1/chat/completions", chat_body(messages, **kwargs))
        start = time.perf_counter()
        result = self._get(call, parse_chat)
        return _with_wall(result, time.perf_counter() - start)

    def chat_stream(self, messages: Sequence[Message], *, on_text: Callable[[str], None] | None = None,
                    **kwargs: Any) -> ChatResult:
        """A streamed chat completion: the assembled reply, the server's timings and the client's time to the
        first token. Not retried once the first byte arrived (a half-streamed reply cannot be resumed)."""
        call = _Call("POST", "/v1/chat/completions", chat_body(messages, stream=True, **kwargs))
        attempts = _Attempts(self, call, self.retry)
        for _ in attempts:
            stream = _Stream(self, call, on_text)
            try:
                with self.http.stream(call.method, call.path, json=call.body) as response:
                    if response.status_code >= 400:
                        response.read()
                    if attempts.answered(response):
                        for line in response.iter_lines():
                            stream.line(line)
                        return stream.result()
            except httpx.HTTPError as exc:
                attempts.failed(exc)
            time.sleep(attempts.wait())
        raise AssertionError("unreachable")

    def complete(self, prompt: str | Sequence[int], **kwargs: Any) -> CompletionResult:
        """``POST /completion`` (keyword arguments as :func:`completion_body`)."""
        return self._get(_Call("POST", "/completion", completion_body(prompt, **kwargs)), parse_completion)

    def metrics(self) -> Metrics:
        call = _Call("GET", "/metrics")
        response = self._send(call)
        return self._parse(call, parse_metrics, response.text)

    def post_json(self, path: str, body: Any) -> Any:
        """Any JSON endpoint, raw: the decoded answer (same timeouts, retries and errors)."""
        call = _Call("POST", path, body)
        return self._json(call, self._send(call))


class AsyncServerClient(_Base):
    """Asynchronous client (httpx.AsyncClient) with the same methods, awaited; an async context manager.

    ``max_connections`` should be at least the number of requests you keep in flight.
    """

    def __init__(self, endpoint: Endpoint | str, *, timeouts: Timeouts = Timeouts(), retry: Retry = Retry(),
                 max_connections: int = 16):
        super().__init__(endpoint, timeouts=timeouts, retry=retry)
        self.http = httpx.AsyncClient(base_url=self.endpoint.dial_url, headers=self.endpoint.headers(),
                                      timeout=timeouts.httpx(), verify=_ssl_context(),
                                      limits=httpx.Limits(max_connections=max_connections,
                                                          max_keepalive_connections=max_connections))

    async def __aenter__(self) -> AsyncServerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _send(self, call: _Call, *, retry: Retry | None = None) -> httpx.Response:
        attempts = _Attempts(self, call, retry or self.retry)
        for _ in attempts:
            try:
                response = await self.http.request(call.method, call.path, json=call.body)
            except httpx.HTTPError as exc:
                attempts.failed(exc)
            else:
                if attempts.answered(response):
                    return response
            await asyncio.sleep(attempts.wait())
        raise AssertionError("unreachable")

    async def _get(self, call: _Call, parser: Callable[[Any], Any]) -> Any:
        response = await self._send(call)
        return self._parse(call, parser, self._json(call, response))

    async def health(self) -> Health:
        call = _Call("GET", "/health")
        try:
            response = await self._send(call, retry=NO_RETRY)
        except ServerError as exc:
            return self._unhealthy(exc)
        return self._healthy(call, response)

    async def props(self) -> Props:
        return await self._get(_Call("GET", "/props"), parse_props)

    async def tokenize(self, text: str, *, add_special: bool = False) -> list[Token]:
        call = _Call("POST", "/tokenize", {"content": text, "add_special": add_special, "with_pieces": True})
        return await self._get(call, parse_tokens)

    async def apply_template(self, messages: Sequence[Message], **template_kwargs: Any) -> str:
        body: dict[str, Any] = {"messages": list(messages)}
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        return await self._get(_Call("POST", "/apply-template", body), lambda d: str(d["prompt"]))

    async def chat(self, messages: Sequence[Message], **kwargs: Any) -> ChatResult:
        call = _Call("POST", "/v1/chat/completions", chat_body(messages, **kwargs))
        start = time.perf_counter()
        result = await self._get(call, parse_chat)
        return _with_wall(result, time.perf_counter() - start)

    async def chat_stream(self, messages: Sequence[Message], *, on_text: Callable[[str], None] | None = None,
                          **kwargs: Any) -> ChatResult:
        call = _Call("POST", "/v1/chat/completions", chat_body(messages, stream=True, **kwargs))
        attempts = _Attempts(self, call, self.retry)
        for _ in attempts:
            stream = _Stream(self, call, on_text)
            try:
                async with self.http.stream(call.method, call.path, json=call.body) as response:
                    if response.status_code >= 400:
                        await response.aread()
                    if attempts.answered(response):
                        async for line in response.aiter_lines():
                            stream.line(line)
                        return stream.result()
            except httpx.HTTPError as exc:
                attempts.failed(exc)
            await asyncio.sleep(attempts.wait())
        raise AssertionError("unreachable")

    async def complete(self, prompt: str | Sequence[int], **kwargs: Any) -> CompletionResult:
        return await self._get(_Call("POST", "/completion", completion_body(prompt, **kwargs)), parse_completion)

    async def metrics(self) -> Metrics:
        call = _Call("GET", "/metrics")
        response = await self._send(call)
        return self._parse(call, parse_metrics, response.text)

    async def post_json(self, path: str, body: Any) -> Any:
        call = _Call("POST", path, body)
        return self._json(call, await self._send(call))


def _with_wall(result: ChatResult, wall_s: float) -> ChatResult:
    return replace(result, wall_s=wall_s)
