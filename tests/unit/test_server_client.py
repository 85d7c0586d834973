"""rigctl.llama_http.client without a llama-server: the pure parsers on llama-server's answer shapes, and retries,
timeouts and the API key against a scripted HTTP server on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rigctl.errors import ConfigError, ServerError
from rigctl.forward import server_endpoint
from rigctl.inventory import Host
from rigctl.llama_http.api import (
    ChatStreamAssembler,
    chat_body,
    parse_chat,
    parse_completion,
    parse_metrics,
    parse_sse_line,
)
from rigctl.llama_http.client import NO_RETRY, AsyncServerClient, Endpoint, Retry, ServerClient, Timeouts

FAST = Retry(attempts=3, backoff=0.01, max_wait=0.02)


def test_parse_chat_with_tool_calls_and_reasoning():
    reply = parse_chat({"choices": [{"finish_reason": "tool_calls", "message": {
        "content": None, "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"function": {"name": "g", "arguments": {"y": 2}}}]}}],
        "usage": {"completion_tokens": 7}, "timings": {"prompt_n": 3, "prompt_ms": 30.0, "predicted_n": 7,
                                                       "predicted_ms": 70.0}})
    assert (reply.content, reply.reasoning_content, reply.finish_reason) == ("", "think", "tool_calls")
    assert reply.tool_calls[0].parsed_arguments() == {"x": 1} and reply.tool_calls[1].parsed_arguments() == {"y": 2}
    assert reply.timings.predicted_per_second == pytest.approx(100.0) and not reply.cutoff
    with pytest.raises(ValueError, match="no choices"):
        parse_chat({"error": "x"})


def test_stream_assembly_and_sse_lines():
    assembler = ChatStreamAssembler()
    for line in ['data: {"choices":[{"delta":{"reasoning_content":"hm"}}]}',
                 'data: {"choices":[{"delta":{"content":"He"}}]}', "",
                 'data: {"choices":[{"delta":{"content":"llo"},"finish_reason":"length"}]}',
                 'data: {"choices":[],"usage":{"completion_tokens":3},"timings":{"prompt_n":1,"prompt_ms":1,'
                 '"predicted_n":3,"predicted_ms":3}}', "data: [DONE]"]:
        chunk = parse_sse_line(line)
        if chunk is not None:
            assembler.add(chunk)
    result = assembler.result(0.1, 0.5)
    assert (result.content, result.reasoning_content, result.cutoff) == ("Hello", "hm", True)
    assert result.timings.predicted_n == 3 and result.usage == {"completion_tokens": 3}


def test_parse_completion_probabilities():
    done = parse_completion({"content": "No", "stop_type": "limit", "completion_probabilities": [
        {"id": 5, "token": "No", "logprob": -0.5, "top_logprobs": [
            {"id": 5, "token": "No", "logprob": -0.5}, {"id": 9, "token": "Yes", "logprob": -1.5}]}]})
    top = done.probs[0]
    assert top.top_ids[9] == pytest.approx(0.22313, rel=1e-4) and top.top["No"] == pytest.approx(0.60653, rel=1e-4)
    old_format = parse_completion({"completion_probabilities": [{"content": "a", "probs": [{"tok_str": "a",
                                                                                          "prob": 0.7}]}]})
    assert old_format.probs[0].top == {"a": 0.7}


def test_parse_metrics():
    metrics = parse_metrics(
        "# HELP llamacpp:prompt_seconds_total x\n# TYPE llamacpp:prompt_seconds_total counter\n"
        "llamacpp:prompt_seconds_total 1.5\n# TYPE llamacpp:tokens_predicted_seconds_total counter\n"
        "llamacpp:tokens_predicted_seconds_total 2.25\n# TYPE llamacpp:requests_processing gauge\n"
        "llamacpp:requests_processing 1\n")
    assert metrics.busy_seconds == pytest.approx(3.75)
    assert metrics.value("llamacpp:requests_processing") == 1.0
    with pytest.raises(KeyError, match="no metric 'nope'"):
        metrics.value("nope")


def test_request_defaults_are_greedy_seeded_thinking_off():
    body = chat_body([{"role": "user", "content": "hi"}], max_tokens=5)
    assert (body["temperature"], body["seed"], body["chat_template_kwargs"]) == (0.0, 1234, {"enable_thinking": False})
    assert "tools" not in body and "stream" not in body


def test_endpoint_validation_and_inventory():
    assert Endpoint("http://h:8080/v1/").url == "http://h:8080"
    with pytest.raises(ConfigError, match="must start with http"):
        Endpoint("h:8080")
    host = Host("desktop", "10.0.0.1", "root", ("all",), {
        "llama_server_api_key": "k", "llama_server_profiles": {"p": {"host": "0.0.0.0"}},
        "llama_server_instances": {"qwen": {"artifact": "q", "profile": "p", "port": 8081}}})
    endpoint = server_endpoint(host, host.server("qwen"))  # listening on every address: asked directly
    assert (endpoint.url, endpoint.api_key, endpoint.label) == ("http://10.0.0.1:8081", "k", "desktop/qwen")
    with pytest.raises(ConfigError, match="no llama_server instance 'gemma' .*instances: qwen"):
        host.server("gemma")


class Script:
    """A loopback HTTP server answering from a list of (status, body) per path; records headers."""

    def __init__(self, answers: dict[str, list[tuple[int, object]]]):
        self.answers = answers
        self.seen: list[tuple[str, str | None]] = []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                script.seen.append((self.path, self.headers.get("Authorization")))
                queue = script.answers[self.path]
                status, body = queue.pop(0) if len(queue) > 1 else queue[0]
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = _answer  # noqa: N815 (http.server's names)
            do_POST = _answer  # noqa: N815

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def script():
    server = Script({
        "/props": [(503, {"error": {"message": "Loading model"}}), (503, {"error": {"message": "Loading model"}}),
                   (200, {"build_info": "b1-abc", "model_path": "/m.gguf", "total_slots": 1})],
        "/tokenize": [(400, {"error": {"message": "bad content"}})],
        "/health": [(503, {"error": {"message": "Loading model"}})],
    })
    yield server
    server.close()


def test_5xx_is_retried_4xx_is_not_and_the_key_is_sent(script):
    with ServerClient(Endpoint(script.url, api_key="sekret"), retry=FAST) as client:
        assert client.props().build_info == "b1-abc"
        assert [p for p, _ in script.seen].count("/props") == 3
        with pytest.raises(ServerError, match=r"POST /tokenize: HTTP 400: bad content") as info:
            client.tokenize("x")
        assert info.value.status == 400
        assert [p for p, _ in script.seen].count("/tokenize") == 1
        health = client.health()
        assert not health.ok and "Loading model" in health.status
    assert {auth for _, auth in script.seen} == {"Bearer sekret"}


def test_connection_refused_is_retried_then_named():
    with ServerClient("http://127.0.0.1:9", retry=FAST) as client, \
            pytest.raises(ServerError, match=r"http://127.0.0.1:9: GET /props: ConnectError.*after 3 attempts"):
        client.props()


def test_read_timeout_is_not_retried():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    try:
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with ServerClient(endpoint, timeouts=Timeouts(read=0.3), retry=FAST) as client, \
                pytest.raises(ServerError, match=r"GET /props: ReadTimeout: timed out$"):
            client.props()
    finally:
        listener.close()


def test_async_client_retries_too(script):
    async def main() -> str:
        async with AsyncServerClient(script.url, retry=FAST) as client:
            return (await client.props()).model_path

    assert asyncio.run(main()) == "/m.gguf"


def test_a_key_with_a_line_break_is_never_shown_by_the_header_error():
    """httpx refuses the header and quotes it, escaped: the message names the call, never the key."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with ServerClient(Endpoint(url, api_key="sk-4f1c9e\n"), retry=NO_RETRY) as client:
            with pytest.raises(ServerError, match=r"GET /props: LocalProtocolError") as info:
                client.props()
            health = client.health()
    finally:
        listener.close()
    assert "4f1c9e" not in str(info.value) and "Bearer ***" in str(info.value)
    assert "4f1c9e" not in health.status


def test_the_key_from_the_environment_loses_its_line_break(tmp_path):
    """RIGCTL_API_KEY from an env file ends in a line break: the server gets the key without it, and no
    output shows the key."""
    import os
    import socket
    import subprocess
    import sys

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(60)
    seen: list[bytes] = []

    def answer() -> None:
        try:
            while True:
                conn, _ = listener.accept()
                with conn:
                    head = b""
                    while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
                        head += chunk
                    seen.append(head)
                    conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
        except OSError:
            return

    threading.Thread(target=answer, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    (tmp_path / "q.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    task = tmp_path / "t.yaml"
    task.write_text("name: t\nscorer: gsm8k\ndataset: {path: q.jsonl}\nprompt: '{question}'\n")
    env = {**os.environ, "RIGCTL_API_KEY": "sk-4f1c9e\n"}
    try:
        done = subprocess.run([sys.executable, "-m", "rigctl.cli", "eval", "run", "-t", str(task), "--url", url,
                               "--results", str(tmp_path / "results")], capture_output=True, text=True, timeout=120,
                              env=env)
    finally:
        listener.close()
    assert seen and all(b"\r\nauthorization: bearer sk-4f1c9e\r\n" in head.lower() for head in seen), \
        seen + [done.stderr.encode()]
    assert "4f1c9e" not in done.stdout + done.stderr


@pytest.mark.parametrize(("body", "reason"), [
    (b'{"content": "\\udc00"}', "a string with a lone UTF-16 surrogate, which UTF-8 cannot carry"),
    (b"[" * 50_000 + b"]" * 50_000, "JSON nested too deep to read"),
    (b'{"n": ' + b"1" * 4301 + b"}", "a number too long to read (Exceeds the limit (4300 digits)"),
])
def test_json_python_cannot_hold_is_told_apart_from_text_that_is_no_json(body, reason):
    from rigctl.hostside.llama_server_http import UnreadableJSON, decode_json

    with pytest.raises(UnreadableJSON) as info:
        decode_json(body)
    assert str(info.value).startswith(reason)
    # A surrogate pair is one character, and 4,300 digits still an integer: both read.
    assert decode_json(b'["\\ud83d\\ude00", ' + b"1" * 4300 + b"]")[0] == "\U0001f600"
    with pytest.raises(json.JSONDecodeError):
        decode_json(b"<html>bad gateway</html>")


def test_a_stream_chunk_python_cannot_hold_is_a_server_error_not_a_crash():
    from rigctl.llama_http.client import _Base, _Call

    client = _Base("http://127.0.0.1:9")
    deep = "data: " + "[" * 50_000 + "]" * 50_000
    with pytest.raises(ServerError, match=r"POST /v1/chat/completions: unexpected answer: JSON nested too deep"):
        client._parse(_Call("POST", "/v1/chat/completions"), parse_sse_line, deep)
