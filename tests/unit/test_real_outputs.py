"""Every recorded real output under tests/fixtures/real/<kind>/ goes through the parser rigctl uses for its
kind and gives what the expectation file beside it says. The expectations were written by reading the raw
text, so a parser that misreads a real tool's output fails here, not on a user's host."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from rigctl.bench import matrix
from rigctl.fleet import host_facts
from rigctl.fleet.state import NVIDIA_SMI_FIELDS, parse_nvidia_smi
from rigctl.hostside import llama_version, nvidia_smi
from rigctl.hostside.llama_server_http import error_body
from rigctl.hostside.stamp import GPU_FIELDS, parse_gpu_query
from rigctl.llama_http import api

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
SOURCE_PREFIX = "# source: "

def _nvidia_smi_summary(text: str) -> object:
    """Plain ``nvidia-smi``: the versions rigctl reads from its header (the probe, the llama_cpp role's
    probe module)."""
    return dataclasses.asdict(nvidia_smi.summary_versions(text))


def _nvidia_smi_list(text: str) -> object:
    """``nvidia-smi -L``: each GPU and its MIG instances (the probe)."""
    return [{**dataclasses.asdict(gpu), "mig": [dataclasses.asdict(m) for m in gpu.mig]}
            for gpu in nvidia_smi.list_gpus(text)]


#: rigctl's field names that nvidia-smi's CSV header spells otherwise (``--help-query-gpu`` lists both).
_HEADER_NAMES = {"clocks.sm": "clocks.current.sm", "clocks.mem": "clocks.current.memory"}


def _project(text: str, fields: Sequence[str]) -> str | None:
    """A recorded ``--query-gpu=<many fields> --format=csv`` answer (header, units) cut down to what
    ``--query-gpu=<fields> --format=csv,noheader,nounits`` prints on the same GPUs: the columns by the
    header's names, each cell without the unit the header names (what ``nounits`` leaves out), as the
    exporter's own replaying stand-in does. None when the capture lacks one of the fields."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = [re.sub(r" \[[^]]*\]$", "", name.strip()) for name in lines[0].split(",")]
    units = [re.search(r"\[([^]]*)\]$", name.strip()) for name in lines[0].split(",")]
    columns = []
    for field in fields:
        name = _HEADER_NAMES.get(field, field)
        if name not in header:
            return None
        columns.append(header.index(name))
    out = []
    for line in lines[1:]:
        cells = [c.strip() for c in line.split(",")]
        kept = []
        for column in columns:
            unit = units[column]
            cell = cells[column]
            kept.append(cell.removesuffix(f" {unit.group(1)}") if unit else cell)
        out.append(", ".join(kept))
    return "\n".join(out) + "\n"


#: Every field rigctl asks nvidia-smi for (the probe, fleet state, bench readings, stamp, the gpu_host
#: role) and how rigctl reads its cell.
_FIELD_READERS: dict[str, Callable[[str], object]] = {
    **dict.fromkeys(("name", "uuid", "pci.bus_id", "driver_version", "compute_cap", "persistence_mode"),
                    nvidia_smi.cell),
    **dict.fromkeys(("index", "memory.total", "memory.used", "temperature.gpu", "clocks.sm", "clocks.mem",
                     "clocks.max.sm"), nvidia_smi.whole),
    **dict.fromkeys(("utilization.gpu", "power.draw", "power.limit"), nvidia_smi.number),
    "clocks_event_reasons.active": nvidia_smi.reasons,
}


def _nvidia_smi_query(text: str) -> object:
    """A recorded ``--query-gpu`` answer: each field rigctl asks for that it holds, per GPU, as rigctl reads
    the cell; then through each of rigctl's readers whose fields it holds all of: the fleet state's GPU
    samples, the bench's clock readings and the stamp's GPU."""
    out: dict[str, object] = {"cells": []}
    for field, read in _FIELD_READERS.items():
        column = _project(text, [field])
        if column is None:
            continue
        lines = column.splitlines()
        while len(out["cells"]) < len(lines):
            out["cells"].append({})
        for row, line in zip(out["cells"], lines, strict=True):
            row[field] = read(line)
    state = _project(text, NVIDIA_SMI_FIELDS)
    if state is not None:
        out["fleet_state"] = [dataclasses.asdict(sample) for sample in parse_nvidia_smi(state)]
    readings = _project(text, nvidia_smi.READING_FIELDS)
    if readings is not None:
        out["readings"] = [nvidia_smi.parse_reading(line) for line in readings.splitlines()]
    stamp = _project(text, GPU_FIELDS.split(","))
    if stamp is not None:
        out["stamp"] = parse_gpu_query(stamp)
    health = _project(text, nvidia_smi.HEALTH_FIELDS)
    if health is not None:
        out["health"] = [dataclasses.asdict(gpu) for gpu in nvidia_smi.parse_health(health)]
    return out


#: kind (the folder under tests/fixtures/real) -> reader: the capture's text (source line removed) to a
#: JSON-able value compared with the expectation file.
READERS: dict[str, Callable[[str], object]] = {
    "nvidia-smi-summary": _nvidia_smi_summary,
    "nvidia-smi-list": _nvidia_smi_list,
    "nvidia-smi-query": _nvidia_smi_query,
}


def _cpuinfo(text: str) -> object:
    model, flags = host_facts.read_cpu("capture", text)
    return {"cpu_model": model, "cpu_flags": sorted(flags)}


READERS["cpuinfo"] = _cpuinfo
#: ``nvidia-smi -q``: the health cells the lab's stand-in replays from it.
READERS["nvidia-smi-q"] = nvidia_smi.query_health_cells
#: Kernel logs (dmesg, journalctl, syslog): the Xid reports, each GPU's PCI address and the code.
READERS["kernel_log_xid"] = lambda text: [{"bus": list(x.bus), "code": x.code} for x in nvidia_smi.parse_xids(text)]
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
