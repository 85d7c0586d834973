"""An upgrade's llama-bench gates from a bench run whose cells alternate two builds, and the report of an
upgrade and of a bisect record, every link in it pointing at a file that exists."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from handmade_runs import bench_record, bench_run

from rigctl.analysis.report.build import build_run_report
from rigctl.fleet.build import Build
from rigctl.results.record import RunRecord
from rigctl.results.store import ResultsStore
from rigctl.upgrade import gates as g
from rigctl.upgrade.bisect import STEPS_FILE
from rigctl.upgrade.paired import IDENTITY_FILE, SERVER_FILE, Side, bench_results


def build(name: str, key: str) -> Build:
    return Build(name=name, dir=f"/opt/llama.cpp/{name}", key=key, version=name.split("-")[0], commit="b11434",
                 build_number=11434, source="archive", cuda=False, cuda_architectures="none", cuda_version="none",
                 built_on="desktop", built_at="2026-12-03T09:00:00Z", cpu_target="portable",
                 cmake_flags=("-DCMAKE_BUILD_TYPE=Release",))


CURRENT, CANDIDATE = build("b11434-2baf2037762e", "2baf2037762e"), build("b11434-9c0d1e2f3a4b", "9c0d1e2f3a4b")


@pytest.fixture
def store(tmp_path: Path) -> ResultsStore:
    cells = []
    builds = {}
    for index in range(1, 11):  # five rounds, alternating current and candidate
        slow = index % 2 == 0
        cells.append(("smol", [bench_record((64, 0), [200.0 / (4 if slow else 1), 204.0 / (4 if slow else 1)]),
                               bench_record((0, 16), [40.0 / (5 if slow else 1), 41.0 / (5 if slow else 1)])]))
        builds[index] = CANDIDATE.name if slow else CURRENT.name
    bench_run(tmp_path / "results", "desktop", "bench-20261203T090000Z-aaaa", cells, builds=builds)
    return ResultsStore(tmp_path / "results")


def test_bench_gates_pair_each_round_s_cells_of_one_alternating_run(store: ResultsStore, tmp_path: Path):
    results, failed = bench_results(store, ["desktop/bench-20261203T090000Z-aaaa"], Side("current", CURRENT),
                                    Side("candidate", CANDIDATE), 0.9, 0.95)
    by_gate = {r.gate: r for r in results}
    assert set(by_gate) == {"bench pp64", "bench tg16"} and failed == {"current": 0, "candidate": 0}
    assert by_gate["bench tg16"].verdict == "fail" and by_gate["bench tg16"].estimate == pytest.approx(0.2)
    assert by_gate["bench pp64"].estimate == pytest.approx(0.25) and by_gate["bench pp64"].n == 5  # rounds paired
    assert "n=5 rounds paired" in by_gate["bench pp64"].figures
    assert by_gate["bench pp64"].detail["pooled"]["n"] == 10  # every repetition, as `rigctl compare` pools them
    assert all(f.startswith("desktop/bench-20261203T090000Z-aaaa/llama-bench/cell-") for f in
               by_gate["bench tg16"].detail["files"])
    # Load that slows both cells of a round alike cancels in the pairs; fewer than five pairs decide nothing.
    cells, builds = [], {}
    for index in range(1, 7):
        load = 1 + (index - 1) // 2  # each round slower than the one before
        slow = index % 2 == 0
        cells.append(("smol", [bench_record((0, 16), [40.0 / load * (0.97 if slow else 1.0)] * 2)]))
        builds[index] = CANDIDATE.name if slow else CURRENT.name
    bench_run(tmp_path / "drift", "desktop", "bench-20261203T090500Z-dddd", cells, builds=builds)
    drift, _ = bench_results(ResultsStore(tmp_path / "drift"), ["desktop/bench-20261203T090500Z-dddd"],
                             Side("current", CURRENT), Side("candidate", CANDIDATE), 0.9, 0.95)
    assert drift[0].estimate == pytest.approx(0.97) and drift[0].n == 3 and drift[0].verdict == "undecided"
    assert "fewer than 5" in drift[0].figures


def links_of(markdown: str, base: Path) -> list[Path]:
    return [base / target for target in re.findall(r"\]\(([^)#]+)\)", markdown) if not target.startswith("http")]


def refused_upgrade(store: ResultsStore, label: str = "b11434 CMAKE_BUILD_TYPE=Debug") -> tuple[Path, str, list]:
    """A refused upgrade's run directory in ``store`` (its record sealed), the refusal line and its bench gates."""
    bench, _ = bench_results(store, ["desktop/bench-20261203T090000Z-aaaa"], Side("current", CURRENT),
                             Side("candidate", CANDIDATE), 0.9, 0.95)
    identity = g.identity_gate([True] * 6, 0.8, detail={"differing": [], "file": IDENTITY_FILE})
    server = g.speed_gate("server decode", g.paired_log_ratio([40.0, 41.0, 39.0], [8.0, 8.3, 7.9]), 0.9, n_a=3,
                          n_b=3, mean_a=40.0, mean_b=8.1, unit="t/s", detail={"file": SERVER_FILE})
    results = [*bench, server, identity, g.errors_gate(0, 0, 0)]
    run_dir = store.root / "desktop" / "upgrade-20261203T091000Z-bbbb"
    (run_dir / "help").mkdir(parents=True)
    (run_dir / "help" / "llama-server.txt").write_text("-h, --help\n")
    (run_dir / SERVER_FILE).write_text(json.dumps({"repeat": 1, "prompt": 0, "side": "current"}) + "\n")
    (run_dir / IDENTITY_FILE).write_text(json.dumps({"kind": "chat", "side": "current", "text": "x"}) + "\n")
    line = f"upgrade to {label} refused by gate bench pp64 (failed): " + bench[0].figures
    record = RunRecord(id=run_dir.name, kind="upgrade", host="desktop", started="2026-12-03T09:10:00.0Z",
                       extra={"from": "b11434", "to": "b11434", "label": label,
                              "canary": "desktop", "scope": ["desktop", "laptop"], "instance": "smollm2",
                              "gates": {"speed_margin": 0.9}, "current": {"name": CURRENT.name, "key": CURRENT.key},
                              "candidate": {"name": CANDIDATE.name, "key": CANDIDATE.key, "plan": "build",
                                            "seconds": 412.0, "cmake_flags": ["-DCMAKE_BUILD_TYPE=Debug"]},
                              "measurement": {"results": [r.to_dict() for r in results],
                                              "bench_runs": ["desktop/bench-20261203T090000Z-aaaa"],
                                              "eval_runs": {}},
                              "verdict": "refused", "refused_by": "bench pp64", "problems": [line]})
    record.seal(run_dir)
    return run_dir, line, bench


def test_a_refused_upgrade_renders_with_every_figure_linked_to_its_raw_file(store: ResultsStore, tmp_path: Path):
    run_dir, line, bench = refused_upgrade(store)
    out = tmp_path / "report"
    report = build_run_report(store.find(f"desktop/{run_dir.name}"), store, out)
    text = report.path.read_text()
    assert text.startswith("# Upgrade b11434 -> b11434 CMAKE_BUILD_TYPE=Debug on desktop: refused")
    assert f"**Refused:** {line}" in text
    assert "| bench tg16 | fail | [0.200x" in text and "| identity | pass | [100%" in text
    assert "| candidate | b11434-9c0d1e2f3a4b |" in text and "build 412 s" in text
    assert report.charts == [out / f"upgrade-{run_dir.name}.png"] and report.charts[0].is_file()
    links = links_of(text, out)
    assert len(links) >= 8 and all(p.exists() for p in links), [p for p in links if not p.exists()]


def test_a_bisect_renders_its_steps_and_the_first_bad_build(store: ResultsStore, tmp_path: Path):
    run_dir = store.root / "desktop" / "bisect-20261203T100000Z-cccc"
    run_dir.mkdir(parents=True)
    steps = [{"version": "b11434", "label": "b11434 CMAKE_BUILD_TYPE=Debug", "build": "b11434-1111", "plan": "build",
              "build_s": 300.0, "verdict": "bad", "gate": {"gate": "bench tg16", "verdict": "fail", "figures": "f",
                                                        "estimate": 0.2, "low": 0.19, "high": 0.21, "n": 6,
                                                        "threshold": 0.9},
              "runs": []},
             {"version": "b11401", "label": "b11401", "build": "b11401-2222", "plan": "present", "build_s": 20.0,
              "verdict": "good", "gate": {"gate": "bench tg16", "verdict": "pass", "figures": "g", "estimate": 1.0,
                                          "low": 0.97, "high": 1.03, "n": 6, "threshold": 0.9}, "runs": []}]
    (run_dir / STEPS_FILE).write_text("".join(json.dumps(s) + "\n" for s in steps))
    record = RunRecord(id=run_dir.name, kind="bisect", host="desktop", started="2026-12-03T10:00:00.0Z",
                       status="done", extra={"good": "b11393", "bad": "b11434 CMAKE_BUILD_TYPE=Debug",
                                             "gate": "bench tg16", "first_bad": "b11434 CMAKE_BUILD_TYPE=Debug",
                                             "last_good": "b11401",
                                             "builds": ["b11393", "b11401", "b11434 CMAKE_BUILD_TYPE=Debug"]})
    record.seal(run_dir)
    report = build_run_report(store.find(f"desktop/{run_dir.name}"), store, tmp_path / "bisect")
    text = report.path.read_text()
    assert "first bad build **b11434 CMAKE_BUILD_TYPE=Debug**, last good b11401" in text
    rows = [line for line in text.splitlines() if line.startswith("| b114")]
    assert [r.split(" | ")[0] for r in rows] == ["| b11401", "| b11434 CMAKE_BUILD_TYPE=Debug"]  # in build order
    assert all(p.exists() for p in links_of(text, tmp_path / "bisect"))
    chart = tmp_path / "bisect" / f"{run_dir.name}.png"
    assert report.charts == [chart] and f"]({chart.name})" in text and chart.read_bytes()[:4] == b"\x89PNG"


RIGCTL = [str(Path(sys.executable).parent / "rigctl")]


def _report(store: ResultsStore, ref: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RIGCTL, "report", ref, "--results", str(store.root), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(("kind", "extra", "steps", "key"), [
    ("upgrade", {"measurement": ["not", "a", "mapping"]}, None, "extra: measurement"),
    ("upgrade", {"measurement": {"results": [{"verdict": "pass"}]}}, None, "extra: measurement.results.0.gate"),
    ("upgrade", {"rollout": [{"ok": True}]}, None, "extra: rollout.0.host"),
    ("upgrade", {"gates": {"speed_margin": "fast"}}, None, "extra: gates.speed_margin"),
    ("upgrade", {"candidate": "b11434"}, None, "extra: candidate"),
    ("bisect", {"builds": "b1"}, None, "extra: builds"),
    ("bisect", {"first_bad": "b2", "builds": ["b1", "b2"]}, [{"version": "b2"}], f"{STEPS_FILE}:1: label"),
    ("bisect", {}, [["a list"]], f"{STEPS_FILE}:1: a list, not a JSON object"),
])
def test_a_malformed_upgrade_or_bisect_record_is_one_line_naming_file_and_key(store: ResultsStore, tmp_path: Path,
                                                                              kind: str, extra: dict, steps, key: str):
    run_dir = store.root / "desktop" / f"{kind}-20261203T100000Z-dddd"
    run_dir.mkdir(parents=True)
    if steps is not None:
        (run_dir / STEPS_FILE).write_text("".join(json.dumps(s) + "\n" for s in steps))
    RunRecord(id=run_dir.name, kind=kind, host="desktop", started="2026-12-03T10:00:00.0Z", status="done",
              extra=extra).seal(run_dir)
    done = _report(store, f"desktop/{run_dir.name}", tmp_path / "out")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: ") and key in lines[0], lines
    assert str(run_dir) in lines[0]


def test_report_of_a_directory_says_not_a_run_without_a_warning_per_sibling(store: ResultsStore, tmp_path: Path):
    for sibling in ("junk-1", "junk-2"):
        (store.root / "desktop" / sibling).mkdir()
    for ref in (store.root / "desktop", store.root):
        done = _report(store, str(ref), tmp_path / "out")
        assert done.returncode == 2 and done.stderr.strip() == f"error: {ref}: not a run (a directory without run.json)"
        done = subprocess.run([*RIGCTL, "compare", str(ref), "desktop/bench-20261203T090000Z-aaaa", "--results",
                               str(store.root)], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2 and done.stderr.strip() == f"error: {ref}: not a run (a directory without run.json)"


def test_report_of_an_upgrade_record_prints_its_text_as_text(store: ResultsStore, tmp_path: Path):
    """What the record says (its label, its refusal) reaches the terminal with markup and escapes shown, not
    interpreted: no terminal control, no crash on a closing tag."""
    label = "b11434 [/] [bold]x\x1b[2J\x1b]0;owned\x07"
    run_dir, _line, _bench = refused_upgrade(store, label)
    done = subprocess.run([sys.executable, "-m", "rigctl.cli", "report", f"desktop/{run_dir.name}",
                           "--out", str(tmp_path / "report")], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "RIGCTL_RESULTS": str(store.root), "COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "b11434 [/] [bold]x\\x1b[2J\\x1b]0;owned\\x07" in done.stdout
