"""rigctl bench on the lab rigs: llama-bench matrices, clock gating, server speed and a drafter race end to end."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from rigctl.bench.matrix import (
    bench_test_name,
    load_run_samples,
    summarize,
)
from rigctl.results.store import ResultsStore

# ----------------------------------------------------------------------------------------------- lab


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest):
    from benchlab import served_inventory

    return served_inventory(request)


# What the stand-in nvidia-smi answers, one reading per call: hot, cooling, and hot again after cells.
# Per cell: the cool-down's readings, then (clock readings far apart) the poller's as the cell starts
# and as it ends.
TEMPERATURES = [72, 55, 38, 50, 66, 47, 39, 41, 58, 36, 44, 61, 35, 37, 35]


@pytest.mark.lab
def test_two_artifact_bench_alternates_waits_while_hot_and_summarises(served, tmp_path: Path) -> None:
    from benchlab import rigctl

    from rigctl.lab.rigs import Lab

    Lab.from_inventory(served).set_gpu("desktop", temperature=80, temperature_sequence=TEMPERATURES)
    done = rigctl("bench", "run", "-H", "desktop", "-m", "smollm2-135m-q4_1,smollm2-135m-q4_0", "-p", "16",
                  "-n", "4", "-r", "1", "-t", "1", "--rounds", "2", "--order", "alternate", "--cooldown", "40",
                  "--cooldown-poll", "0.2", "--clock-sample", "600", "--wait", results=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cooling down" in done.stdout  # progress streamed while it waited
    job_id = next(line.split()[2] for line in done.stdout.splitlines() if " started " in line)
    store = ResultsStore(tmp_path)
    run = store.find(f"desktop/{job_id}")  # the pull also brings the host's earlier runs
    record = run.record
    assert record.status == "done" and store.verify(run) == []
    assert [a.name for a in record.artifacts] == ["smollm2-135m-q4_1", "smollm2-135m-q4_0"]
    for artifact in record.artifacts:
        assert artifact.manifest and artifact.sha256 == artifact.manifest["sha256"]
    assert record.llama_cpp.commit and record.llama_cpp.build_key
    assert record.gpu.name == "Lab stand-in for RTX 3050 OEM" and record.gpu.vram_mib == 8192
    # What ran on the card before the bench took it: the server's argv as deployed, read on the rig.
    from benchlab import assert_deployed

    assert [s.name for s in record.servers] == ["smollm2"]
    assert_deployed(record.servers[0], served, "desktop", "smollm2")
    assert len(record.commands) == 4 and all(" -p 16 -n 4 -r 1 " in c for c in record.commands)
    # The instance serving on the rig gave the card up for the run and is back.
    assert record.extra["servers_stopped"] == ["smollm2"] and "restore_problems" not in record.extra
    from rigctl.ssh import SshClient, SshTarget

    with SshClient(SshTarget.from_host(served.host("desktop"))) as ssh:
        assert ssh.run("systemctl is-active llama-server@smollm2.service", timeout=30).stdout.strip() == "active"

    cells = [json.loads(line) for line in (run.path / "cells.jsonl").read_text().splitlines()]
    assert [c["artifact"] for c in cells] == ["smollm2-135m-q4_1", "smollm2-135m-q4_0"] * 2
    readings = [t for c in cells for t in c["cooldown"]["readings"]]
    # Every reading came from the sequence in order; each cell started at or below 40 °C, after every
    # hotter reading before it, and the first cell had to wait.
    assert readings == [t for t in TEMPERATURES if t in readings][: len(readings)]
    for c in cells:
        *hot, start = c["cooldown"]["readings"]
        assert start <= 40 and all(t > 40 for t in hot) and c["temp_start_c"] == start
    assert [c["temp_end_c"] for c in cells] == [66, 58, 61, 35]  # the poller's reading as each cell ended
    assert cells[0]["cooldown"]["readings"][:2] == [72, 55] and cells[0]["cooldown"]["waited_s"] > 0
    # llama-bench's own time, inside the cell's span (which also holds the clock poller's start and end).
    for c in cells:
        span = (datetime.fromisoformat(c["ended"].replace("Z", "+00:00"))
                - datetime.fromisoformat(c["started"].replace("Z", "+00:00"))).total_seconds()
        assert 0 < c["llama_bench_s"] <= span + 0.01, (c["llama_bench_s"], span)

    summary = rigctl("bench", "summary", run.id, "--csv", str(tmp_path / "s.csv"), "--png", str(tmp_path / "s.png"),
                     results=tmp_path, timeout=120)
    assert summary.returncode == 0, summary.stderr
    rows = summarize(load_run_samples(run))
    # The ratio recomputed here from the raw llama-bench files, independently of the summary code.
    per_model: dict[tuple[str, str], list[float]] = {}
    for c in cells:
        for entry in json.loads((run.path / c["raw"]).read_text()):
            name = bench_test_name(entry["n_prompt"], entry["n_gen"])
            per_model.setdefault((name, c["artifact"]), []).extend(entry["samples_ts"])
    for test in ("pp16", "tg4"):
        q4_1 = next(r for r in rows if r.test == test and r.model == "smollm2-135m-q4_1")
        expected = np.mean(per_model[(test, "smollm2-135m-q4_1")]) / np.mean(per_model[(test, "smollm2-135m-q4_0")])
        assert q4_1.n == 2 and q4_1.cells == 2  # one repetition in each of two cells
        assert q4_1.ratio["smollm2-135m-q4_0"] == pytest.approx(expected)
        assert f"{q4_1.ratio['smollm2-135m-q4_0']:.3f}" in summary.stdout
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert len((tmp_path / "s.csv").read_text().splitlines()) == 1 + len(rows)


@pytest.mark.lab
def test_wait_follows_every_host_at_once(served, tmp_path: Path) -> None:
    from benchlab import rigctl

    from rigctl.lab.rigs import Lab

    lab = Lab.from_inventory(served)
    # Desktop stays hot until its cool-down times out; laptop is cool and done long before.
    lab.set_gpu("desktop", temperature=80, temperature_sequence=[])
    lab.set_gpu("laptop", temperature=35, temperature_sequence=[])
    try:
        done = rigctl("bench", "run", "-H", "desktop,laptop", "-m", "smollm2-135m-q4_1", "-p", "16", "-n", "4",
                      "-r", "1", "-t", "1", "--cooldown", "40", "--cooldown-timeout", "20", "--cooldown-poll", "0.5",
                      "--keep-servers", "--wait", results=tmp_path, timeout=600)
    finally:
        lab.set_gpu("desktop", temperature=35, temperature_sequence=[])
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    ids = {line.split(":")[0]: line.split()[2] for line in lines if " started " in line}
    assert set(ids) == {"desktop", "laptop"}
    ended = {host: lines.index(next(line for line in lines if line.startswith(f"{host}: {job_id} done")))
             for host, job_id in ids.items()}
    # Followed one after the other, laptop's end would only show after desktop's.
    assert ended["laptop"] < ended["desktop"], done.stdout
    store = ResultsStore(tmp_path)
    for host, job_id in ids.items():
        assert f"+ {host}/{job_id}" in done.stdout
        run = store.find(f"{host}/{job_id}")
        assert run.record.status == "done" and store.verify(run) == []


@pytest.mark.lab
def test_drafter_race_reports_acceptance_and_identical_greedy_text(served, tmp_path: Path) -> None:
    from benchlab import rigctl

    done = rigctl("bench", "spec", "desktop", "--baseline", "smollm2-q4_0", "--prompts", "code,facts",
                  "--repeats", "1", "--temperatures", "0", "--max-tokens", "24", results=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    [run] = list(ResultsStore(tmp_path).runs("desktop", kind="spec"))
    requests = [json.loads(line) for line in (run.path / "requests.jsonl").read_text().splitlines()]
    assert [(r["contender"], r["prompt"]) for r in requests] == [
        ("smollm2-q4_0", "code"), ("smollm2-q4_0-draft", "code"), ("smollm2-q4_0", "facts"),
        ("smollm2-q4_0-draft", "facts")]
    drafted = [r for r in requests if r["contender"] == "smollm2-q4_0-draft"]
    assert all(r["draft_n"] > 0 and 0 < r["draft_n_accepted"] <= r["draft_n"] for r in drafted)
    assert all(r["tokens"] > 0 for r in requests)
    # SmolLM2 Q4_1 drafting for its own Q4_0 changes the speed, never the greedy text.
    base = {r["prompt"]: r["text"] for r in requests if r["contender"] == "smollm2-q4_0"}
    assert all(r["text"] == base[r["prompt"]] for r in drafted)
    summary = {(s["contender"], s["prompt"]): s for s in run.record.extra["summary"]}
    overall = summary[("smollm2-q4_0-draft", "overall")]
    accepted = sum(r["draft_n_accepted"] for r in drafted)
    assert overall["acceptance"] == pytest.approx(accepted / sum(r["draft_n"] for r in drafted))
    assert list(overall["identical"]) == [2, 2]
    assert "| smollm2-q4_0-draft | overall | 2 |" in done.stdout
    metrics = json.loads((run.path / "metrics.json").read_text())
    assert metrics["smollm2-q4_0-draft"]["llamacpp:spec_decode_num_accepted_tokens_total"] == accepted
    assert run.record.extra["started_instances"] == ["smollm2-q4_0", "smollm2-q4_0-draft"]  # and stopped after
    from benchlab import assert_deployed

    assert [s.name for s in run.record.servers] == ["smollm2-q4_0", "smollm2-q4_0-draft"]
    for server in run.record.servers:
        assert_deployed(server, served, "desktop", server.name)
    assert run.record.extra["baseline"] == "smollm2-q4_0" and run.record.servers[1].draft
    assert run.record.llama_cpp.commit and run.record.gpu.name == "Lab stand-in for RTX 3050 OEM"


@pytest.mark.lab
def test_server_speed_sweep_load_time_and_memory_per_context(served, tmp_path: Path) -> None:
    from benchlab import rigctl

    from rigctl.lab.rigs import Lab

    Lab.from_inventory(served).set_gpu("desktop", memory_used_mib=1234)
    done = rigctl("bench", "server", "desktop", "smollm2", "--prompt-lengths", "16,48", "--max-tokens", "4",
                  "--ctx-sizes", "512,1024", results=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    [run] = list(ResultsStore(tmp_path).runs("desktop", kind="server-speed"))
    sweep = [json.loads(line) for line in (run.path / "sweep.jsonl").read_text().splitlines()]
    assert [p["prompt_tokens"] for p in sweep] == [16, 48]  # built to length with the server's tokenizer
    assert all(p["ttft_s"] > 0 and p["decode_per_s"] > 0 and p["predicted_n"] == 4 for p in sweep)
    [load] = [json.loads(line) for line in (run.path / "load.jsonl").read_text().splitlines()]
    assert load["load_s"] > 0
    memory = [json.loads(line) for line in (run.path / "memory.jsonl").read_text().splitlines()]
    assert memory == [{"ctx_size": 512, "memory_used_mib": 1234}, {"ctx_size": 1024, "memory_used_mib": 1234}]
    assert run.record.extra["kv_bytes_per_token"] == pytest.approx(0.0, abs=1e-6)  # the stand-in's memory is flat
    assert run.record.server.build_info.startswith("b11434")
    from benchlab import assert_deployed

    assert_deployed(run.record.server, served, "desktop", "smollm2")
    assert run.record.artifacts[0].sha256 and run.record.llama_cpp.build_key
    from rigctl.ssh import SshClient, SshTarget

    with SshClient(SshTarget.from_host(served.host("desktop"))) as ssh:  # the instance is back, the probe gone
        states = ssh.run("systemctl is-active llama-server@smollm2.service rigctl-ctxprobe-smollm2.service",
                         timeout=30, check=False).stdout.split()
    assert states == ["active", "inactive"]


# ----------------------------------------------------------------------------------------------- clocks


@pytest.mark.lab
def test_a_card_that_throttles_mid_cell_is_marked_with_its_clock_series(served, tmp_path: Path) -> None:
    from benchlab import rigctl

    from rigctl.lab.rigs import Lab

    lab = Lab.from_inventory(served)
    # One reading per nvidia-smi call that asks for clocks (readings far apart: only the start and end of
    # each cell). Cell 1: cool and free, starts at once; cell 2: the gate sees a HW thermal slowdown and
    # waits one poll, the cell starts clean, then the card throttles (the last entry sticks).
    fine = {"clocks_sm_mhz": 1950, "clocks_event_reasons": 0}
    throttled = {"clocks_sm_mhz": 1100, "clocks_event_reasons": 0x20, "power_draw_w": 75.0}
    lab.set_gpu("desktop", temperature=35, temperature_sequence=[], clocks_sm_mhz=1950, clocks_event_reasons=0,
                clocks_sequence=[fine, fine, fine, {"clocks_event_reasons": 0x40}, fine, fine, throttled])
    try:
        done = rigctl("bench", "run", "-H", "desktop", "-m", "smollm2-135m-q4_1", "-p", "16", "-n", "4", "-r", "2",
                      "-t", "1", "--rounds", "2", "--cooldown", "40", "--cooldown-poll", "0.5", "--clock-sample",
                      "600", "--keep-servers", "--wait", results=tmp_path, timeout=600)
    finally:
        lab.set_gpu("desktop", clocks_sequence=[], clocks_sm_mhz=1950, clocks_event_reasons=0, power_draw_w=20.0)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = next(line.split()[2] for line in done.stdout.splitlines() if " started " in line)
    store = ResultsStore(tmp_path)
    run = store.find(f"desktop/{job_id}")
    assert store.verify(run) == []
    first, second = [json.loads(line) for line in (run.path / "cells.jsonl").read_text().splitlines()]
    # The cool, unthrottled card: one reading and no wait.
    assert first["cooldown"]["readings"] == [35] and first["cooldown"]["reasons"] == [0]
    assert first["cooldown"]["waited_s"] < 0.5 and not first["throttle"]["throttled"]
    # The gate held the second cell while the thermal reason was active.
    assert second["cooldown"]["reasons"] == [0x40, 0] and second["cooldown"]["waited_s"] >= 0.5
    assert second["throttle"] == {"throttled": True, "min_sm_fraction": pytest.approx(1100 / 1950, abs=1e-4),
                                  "reasons": ["sw_thermal_slowdown"], "samples": 2,
                                  "why": ["reason sw_thermal_slowdown", "SM clock at 56% of its max (below 80%)"]}
    series = [json.loads(line) for line in (run.path / second["clocks"]).read_text().splitlines()]
    assert [(r["sm_mhz"], r["reasons"], r["max_sm_mhz"]) for r in series] == [(1950, 0, 1950), (1100, 0x20, 1950)]
    assert series[1]["power_w"] == 75.0 and series[0]["t_s"] < series[1]["t_s"]
    assert second["clocks"] in {f.path for f in run.record.files}  # sealed with the run

    summary = rigctl("bench", "summary", run.id, results=tmp_path, timeout=120)
    assert summary.returncode == 0, summary.stderr
    assert "(1 throttled cell left out)" in summary.stdout
    assert (f"desktop/{run.id} cell 2 (smollm2-135m-q4_1): reason sw_thermal_slowdown; SM clock at 56% of its max"
            in summary.stdout)
    rows = summarize(load_run_samples(run))
    tg = next(r for r in rows if r.test == "tg4")
    raw = json.loads((run.path / first["raw"]).read_text())
    values = next(e["samples_ts"] for e in raw if e["n_gen"] == 4)
    assert tg.cells == 1 and tg.mean == pytest.approx(np.mean(values))  # only the clean cell's repetitions
    assert (tg.cold, tg.steady) == (pytest.approx(values[0]), pytest.approx(values[1]))
