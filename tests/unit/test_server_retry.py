"""The sync and async llama-server clients share one retry loop (rigctl.llama_http.client._Attempts): the same calls,
streamed or not, are retried the same way and fail with the same one-line error. A scripted loopback server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rigctl.errors import ServerError
from rigctl.llama_http.client import AsyncServerClient, Retry, ServerClient

FAST = Retry(attempts=3, backoff=0.01, max_wait=0.02)
LOADING = (503, b'{"error": {"message": "Loading model"}}', "application/json")
SSE = (200, b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (
    {"choices": [{"delta": {"content": "4"}}]},
    {"choices": [{"delta": {"content": "2"}, "finish_reason": "stop"}],
     "timings": {"prompt_n": 3, "prompt_ms": 1.5, "predicted_n": 2, "predicted_ms": 4.0}},
)) + b"data: [DONE]\n\n", "text/event-stream")


class Scripted:
    """Answers POST /v1/chat/completions from a queue of (status, body, content type), the last one forever."""

    def __init__(self, answers: list[tuple[int, bytes, str]]):
        self.answers, self.calls = list(answers), 0
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                scripted.calls += 1
                status, body, kind = scripted.answers.pop(0) if len(scripted.answers) > 1 else scripted.answers[0]
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator:
    made: list[Scripted] = []

    def start(*answers: tuple[int, bytes, str]) -> Scripted:
        made.append(Scripted(list(answers)))
        return made[-1]

    yield start
    for server in made:
        server.close()


def both(url: str, call: str) -> tuple[object, object]:
    """The outcome (result or ServerError) of the same call on the sync and on the async client."""
    messages = [{"role": "user", "content": "6*7?"}]

    def sync() -> object:
        with ServerClient(url, retry=FAST) as client:
            try:
                return getattr(client, call)(messages, max_tokens=4)
            except ServerError as exc:
                return exc

    async def run_async() -> object:
        async with AsyncServerClient(url, retry=FAST) as client:
            try:
                return await getattr(client, call)(messages, max_tokens=4)
            except ServerError as exc:
                return exc

    return sync(), asyncio.run(run_async())


def test_a_stream_is_retried_past_loading_and_assembled_alike(serve) -> None:
    server = serve(LOADING, LOADING, SSE)
    sync, async_ = both(server.url, "chat_stream")
    assert server.calls == 3 + 1  # two 503s then the stream, for the sync client; the async one got the stream
    for reply in (sync, async_):
        assert not isinstance(reply, ServerError)
        assert reply.content == "42" and reply.finish_reason == "stop"
        assert reply.timings is not None and reply.timings.predicted_n == 2
        assert reply.ttft_s is not None and reply.ttft_s <= reply.wall_s


def test_a_4xx_is_not_retried_and_fails_alike(serve) -> None:
    server = serve((400, b'{"error": {"message": "bad messages"}}', "application/json"))
    for call in ("chat", "chat_stream"):
        before = server.calls
        sync, async_ = both(server.url, call)
        assert server.calls - before == 2  # once each
        assert isinstance(sync, ServerError) and isinstance(async_, ServerError)
        assert str(sync) == str(async_)
        assert str(sync).endswith("POST /v1/chat/completions: HTTP 400: bad messages")


def test_5xx_to_the_last_attempt_fails_alike(serve) -> None:
    server = serve(LOADING)
    for call in ("chat", "chat_stream"):
        before = server.calls
        sync, async_ = both(server.url, call)
        assert server.calls - before == 2 * FAST.attempts
        assert str(sync) == str(async_) and str(sync).endswith("HTTP 503: Loading model")


def test_refused_connections_are_retried_and_named_alike() -> None:
    for call in ("chat", "chat_stream"):
        sync, async_ = both("http://127.0.0.1:9", call)
        for error in (sync, async_):  # httpx words the refusal its own way in each transport
            assert isinstance(error, ServerError)
            assert str(error).startswith("http://127.0.0.1:9: POST /v1/chat/completions: ConnectError: ")
            assert str(error).endswith(f"(after {FAST.attempts} attempts)")
