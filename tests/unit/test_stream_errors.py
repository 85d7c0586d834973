"""A failure llama-server sends inside a 200 stream is that request's error, in both shapes builds have sent
(an SSE ``error:`` field until September 2025, ``data: {"error": ...}`` since), and the decode speed recorded is
the server's own. The streams are recorded real ones (tests/fixtures/real/), served over loopback HTTP to
rigctl's own client and load driver."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from local_http import Handler, LocalServer

from rigctl.bench.load import drive_level, summarize_level
from rigctl.errors import ServerError
from rigctl.llama_http import ServerClient
from rigctl.llama_http.api import FIGURE_DEFINITIONS, Timings, parse_timings

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"


def recorded(kind: str, name: str) -> str:
    """The output of a recorded capture, its source line dropped."""
    return (REAL / kind / name).read_text().partition("\n")[2]


#: The 2025 shape, as llama.cpp b5966 sent it (coddy-agent PR #106).
OLD_SHAPE = recorded("server_stream", "coddy-agent-pr106-b5966-error-field.txt")
#: The current shape: llama.cpp's server sends the error object it used to put in the `error:` field as a
#: `data:` line holding {"error": object} (ggml-org/llama.cpp PR #16109). The object is a recorded real one
#: (textgen issue #7257: what a server returned with no 400 status).
NEW_SHAPE = "data: " + json.dumps(json.loads(recorded("server_error_body", "textgen-issue7257-200-body.txt")),
                                  separators=(",", ":")) + "\n\ndata: [DONE]\n\n"
#: A reply that did stream, with the server's timings (openai-php issue #780, llama.cpp b9554).
GOOD = recorded("server_stream", "openai-php-issue780-b9554-timings.txt") + "\ndata: [DONE]\n\n"


class StreamServer(LocalServer):
    """Answers every POST with HTTP 200 and the next of ``bodies`` as an event stream, in turn."""

    def __init__(self, bodies: list[str]):
        super().__init__()
        self.bodies = bodies

    def handler(self) -> type[Handler]:
        server = self

        class Streams(Handler):
            server_requests = server.requests

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = server.bodies[len(server.requests) % len(server.bodies)]
                self.log_message("")
                self.send_body(body.encode(), "text/event-stream")

        return Streams


@pytest.mark.parametrize("body", [OLD_SHAPE, NEW_SHAPE], ids=["error-field-2025", "data-error-2026"])
def test_a_failure_inside_a_200_stream_is_a_server_error(body: str) -> None:
    with StreamServer([body]) as server, ServerClient(server.base_url) as client, \
            pytest.raises(ServerError, match="error in the stream: the request exceeds the available context "
                                             r"size.*\((invalid_request|exceed_context_size)_error\)$") as raised:
        client.chat_stream([{"role": "user", "content": "hi"}], max_tokens=8)
    assert raised.value.status == 400
    assert "\n" not in str(raised.value)


def test_a_stream_that_streamed_gives_the_servers_own_decode_speed() -> None:
    with StreamServer([GOOD]) as server, ServerClient(server.base_url) as client:
        reply = client.chat_stream([{"role": "user", "content": "hi"}], max_tokens=8)
    assert reply.reasoning_content == "Playful" and reply.ttft_s is not None
    assert reply.timings is not None
    assert reply.timings.predicted_per_second == 68.83475824187315  # the server's figure, not recomputed
    assert reply.timings.decode_tokens == "predicted_n"


def test_the_load_curve_counts_stream_failures_as_errors_never_as_empty_successes() -> None:
    with StreamServer([GOOD, OLD_SHAPE, NEW_SHAPE]) as server:
        requests, wall_s = drive_level(server.base_url, 1, 6, 8, 60.0, [("chat", [{"role": "user", "content": "hi"}])])
    assert [r.ok for r in sorted(requests, key=lambda r: r.index)] == [True, False, False] * 2
    failed = [r for r in requests if not r.ok]
    assert all("exceeds the available context size" in (r.error or "") and r.tokens == 0 and r.ttft_s is None
               for r in failed)
    level = summarize_level(1, requests, wall_s)
    assert (level.requests, level.errors) == (6, 4)
    assert level.ttft_s["p50"] is not None and level.ttft_s["p50"] > 0  # only the replies that streamed count
    good = [r for r in requests if r.ok]
    assert {r.decode_per_s for r in good} == {68.83475824187315} and {r.decode_tokens for r in good} == {"predicted_n"}


def test_decode_speed_over_the_builds_own_token_count() -> None:
    # A build that counts from the second token (its first token's time is the prompt's): its own rate is over
    # predicted_n - 1, and that is the rate recorded, with the convention named.
    over_n_minus_1 = parse_timings({"prompt_n": 10, "prompt_ms": 50.0, "predicted_n": 24, "predicted_ms": 460.0,
                                    "predicted_per_second": 1000.0 * 23 / 460.0})
    assert over_n_minus_1 is not None
    assert over_n_minus_1.predicted_per_second == pytest.approx(50.0)
    assert over_n_minus_1.decode_tokens == "predicted_n - 1"
    # No rate from the server (an OpenAI-compatible server with llama.cpp's timings keys only): recomputed.
    recomputed = Timings(10, 50.0, 24, 480.0)
    assert recomputed.predicted_per_second == pytest.approx(50.0) and recomputed.decode_tokens is None
    assert set(FIGURE_DEFINITIONS) == {"ttft", "tpot", "decode"}
