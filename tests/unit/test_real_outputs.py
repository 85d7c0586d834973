"""Every recorded real output under tests/fixtures/real/<kind>/ goes through the parser rigctl uses for its
kind and gives what the expectation file beside it says. The expectations were written by reading the raw
text, so a parser that misreads a real tool's output fails here, not on a user's host."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from rigctl.bench import matrix
from rigctl.fleet import host_facts
from rigctl.hostside import llama_version
from rigctl.hostside.llama_server_http import error_body
from rigctl.llama_http import api

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
SOURCE_PREFIX = "# source: "

#: kind (the folder under tests/fixtures/real) -> reader: the capture's text (source line removed) to a
#: JSON-able value compared with the expectation file.
READERS: dict[str, Callable[[str], object]] = {}


def _cpuinfo(text: str) -> object:
    model, flags = host_facts.read_cpu("capture", text)
    return {"cpu_model": model, "cpu_flags": sorted(flags)}


READERS["cpuinfo"] = _cpuinfo
READERS["os_release"] = lambda text: {"os": host_facts.read_os("capture", text)}
READERS["llama_version"] = lambda text: llama_version.parse(text).as_dict()


def _stream(text: str) -> object:
    try:
        reply = api.read_stream(text)
    except api.StreamError as exc:
        return {"error": {"message": exc.body.message, "type": exc.body.type, "code": exc.body.code}}
    timings = reply.timings
    assert timings is not None, "every recorded stream here carries the server's timings"
    return {"content": reply.content, "reasoning_content": reply.reasoning_content,
            "finish_reason": reply.finish_reason, "predicted_n": timings.predicted_n,
            "prompt_per_s": timings.prompt_per_second, "decode_per_s": timings.predicted_per_second,
            "decode_tokens": timings.decode_tokens}


def _metrics(text: str) -> object:
    metrics = api.parse_metrics(text)
    # JSON has no NaN that equals itself: a value that is not a number is compared as these words.
    return {"samples": {name: value if math.isfinite(value) else "not a number"
                        for name, value in metrics.samples.items()},
            "busy_seconds": metrics.busy_seconds}


def _bench_json(text: str) -> object:
    entries = matrix.parse_llama_bench_json(text, "capture")
    return [{"build": s.build, "test": s.test, "config": s.config, "flash_attn": s.flash_attn, "ngl": s.ngl,
             "n_prompt": s.n_prompt, "n_gen": s.n_gen, "depth": s.depth, "samples_ts": list(s.samples_ts)}
            for s in matrix.samples_from_cell(entries, host="h", run_id="r", build="", model="m", cell=0)]


READERS["llama_bench_json"] = _bench_json
READERS["server_stream"] = _stream
READERS["server_error_body"] = lambda text: vars(error_body(text))
READERS["server_metrics"] = _metrics


def captures() -> list[Path]:
    return sorted(p for p in REAL.glob("*/*") if p.is_file() and not p.name.endswith(".expect.json"))


def expectation(capture: Path) -> Path:
    return capture.with_name(capture.name.rsplit(".", 1)[0] + ".expect.json")


def recorded(capture: Path) -> tuple[str, str]:
    """The capture's source line and the output after it."""
    first, _, rest = capture.read_text(encoding="utf-8").partition("\n")
    return first, rest


@pytest.mark.parametrize("capture", captures(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_real_output_parses_to_its_expectation(capture: Path) -> None:
    source, output = recorded(capture)
    assert source.startswith(SOURCE_PREFIX) and len(source) > len(SOURCE_PREFIX) + 8, \
        f"{capture} does not start with a line naming its public source"
    assert capture.parent.name in READERS, f"no reader for kind {capture.parent.name!r}"
    assert expectation(capture).is_file(), f"{capture} has no expectation file beside it"
    expected = json.loads(expectation(capture).read_text())
    assert READERS[capture.parent.name](output) == expected
