"""One bad host or record is that host's or record's one-line error, and the rest of a fan-out completes:
the results store's one JSON reader (records, JSONL rows, llama-bench output), pull, the per-host fan-out,
the exporter (scraped over loopback HTTP), MCP and compare."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from exporter_support import parse_samples, sample_value, seed_results
from handmade_runs import bench_record, bench_run, eval_run
from hypothesis import given, settings
from hypothesis import strategies as st
from labrigs_support import LAB_INVENTORY, REPO

from rigctl import jobs
from rigctl.analysis.compare import compare_runs, load_answers
from rigctl.analysis.latest import ResultsReader
from rigctl.connections import on_each_host
from rigctl.errors import ConfigError, RigctlError, one_line
from rigctl.inventory import Host, Inventory
from rigctl.results.record import (
    DEFERRED_DEPTH,
    JSON_DEPTH,
    RUN_FILE,
    Artifact,
    Gpu,
    LlamaCppBuild,
    RawFile,
    RunRecord,
    Server,
    Task,
    check_json,
    parse_json,
)
from rigctl.results.store import ResultsStore, read_jsonl
from rigctl.services.exporter import Exporter
from rigctl.services.mcp_server import FleetTools

RIGCTL = str(Path(sys.executable).parent / "rigctl")
ROWS = [{"id": f"q{i}", "set": "s", "score": i % 2} for i in range(20)]
GOOD_A, GOOD_B = "eval-20261201T010000Z-000a", "eval-20261201T020000Z-000b"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


#: run.json texts a hostile or broken host could leave in the store: past what json.loads itself reads, past
#: Python's integer digit limit, past JSON_DEPTH but inside json's limit, an integer past 64 bits.
HOSTILE_RECORDS = {
    "deep": (nested(200_000), "nested deeper than 64 levels"),
    "digits": ('{"seed": ' + "9" * 5001 + "}", "an integer of 5001 digits (at most 64 bits are read)"),
    "extra": (None, "nested deeper than 64 levels"),
    "wide": (None, "an integer of 65 bits (at most 64 are read)"),
}


def _hostile_store(root: Path) -> list[Path]:
    """Two good eval runs on desktop, and on laptop one run.json of each kind in HOSTILE_RECORDS."""
    eval_run(root, "desktop", GOOD_A, "m-a", ROWS)
    eval_run(root, "desktop", GOOD_B, "m-b", [{**r, "score": 1} for r in ROWS])
    good = json.loads((root / "desktop" / GOOD_A / RUN_FILE).read_text())
    texts = {"extra": json.dumps({**good, "extra": {"x": json.loads(nested(200))}}),
             "wide": json.dumps({**good, "seed": 2**64})}
    dirs = []
    for n, (name, (text, _)) in enumerate(HOSTILE_RECORDS.items()):
        run_dir = root / "laptop" / f"eval-20261201T0{n}0000Z-{name[:4].ljust(4, 'f')}"
        run_dir.mkdir(parents=True)
        (run_dir / RUN_FILE).write_text(text or texts[name])
        dirs.append(run_dir)
    return dirs


# ----------------------------------------------------------------------------------------------- the JSON reader


def test_the_json_bounds_are_exact() -> None:
    check_json(json.loads(nested(JSON_DEPTH)), "x")
    check_json({"k": json.loads(nested(JSON_DEPTH - 1))}, "x")
    with pytest.raises(ConfigError, match="^x: JSON nested deeper than 64 levels$"):
        check_json(json.loads(nested(JSON_DEPTH + 1)), "x")
    check_json([2**64 - 1, -(2**63), True, 1e308, float("inf"), "9" * 10_000], "x")
    for wide in (2**64, -(2**63) - 1):
        with pytest.raises(ConfigError, match="^x: an integer of .* bits"):
            check_json({"a": [wide]}, "x")
    with pytest.raises(ConfigError, match="^x: an integer of 65 bits"):
        check_json(2**64, "x")
    with pytest.raises(json.JSONDecodeError):  # not JSON at all: the caller names it in its own words
        parse_json("{", "x")
    # A deferred document (a run listing) nests deeper, and keeps a wide integer for check_json to refuse.
    listing = parse_json('{"r": {"seed": ' + "9" * 5001 + ', "extra": ' + nested(100) + "}}", "x", deferred=True)
    with pytest.raises(ConfigError, match="^r: an integer of 5001 digits"):
        check_json(listing["r"], "r")
    assert parse_json(str(-(2**63)), "x") == -(2**63) and parse_json("1.5e999", "x") == float("inf")


def test_nesting_is_measured_before_parsing_strings_and_torn_lines_aside(monkeypatch) -> None:
    import rigctl.results.record as record

    # Brackets inside strings, escaped quotes included, do not nest.
    text = json.dumps(["[" * 1000, '\\"{' * 500, {"k": "]" * 50}])
    assert parse_json(text, "x") == json.loads(text)
    # A torn line (an unterminated string) is json's to refuse, whatever brackets the string held.
    with pytest.raises(json.JSONDecodeError):
        parse_json('{"reply": "' + "[" * 1000, "x")
    # Too deep: refused before json.loads is called at all, so the parser never recurses past the bound.
    monkeypatch.setattr(record.json, "loads", lambda *a, **k: pytest.fail("parsed a document past the bound"))
    with pytest.raises(ConfigError, match="^x: JSON nested deeper than 64 levels$"):
        parse_json(nested(200_000), "x")
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        parse_json('{"a": ' + nested(65) + "}", "x")


def test_hostile_records_are_skipped_and_compare_of_two_good_runs_works(tmp_path: Path, caplog) -> None:
    root = tmp_path / "results"
    hostile = _hostile_store(root)
    store = ResultsStore(root)
    with caplog.at_level(logging.WARNING):
        assert [run.id for run in store.runs()] == [GOOD_A, GOOD_B]
    for run_dir, (_, message) in zip(hostile, HOSTILE_RECORDS.values(), strict=True):
        assert any(f"skipping {run_dir}: " in r.getMessage() and message in r.getMessage() for r in caplog.records), \
            (run_dir, caplog.text)
    # By bare id, find reads only the directories the ids name: the hostile ones are never opened.
    result = compare_runs([store.find(GOOD_A), store.find(GOOD_B)])
    assert result.pairs[0].recorded.overall.n == 20

    done = subprocess.run([RIGCTL, "compare", GOOD_A, GOOD_B, "--results", str(root)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "overall" in done.stdout and "Traceback" not in done.stdout + done.stderr
    assert not [line for line in done.stderr.splitlines() if line.startswith("warning: skipping")], done.stderr
    # A ref no directory is named by is looked for in every record: the hostile ones are skipped with a
    # warning each, and the ref is not found, in one error line.
    done = subprocess.run([RIGCTL, "compare", GOOD_A, "eval-20261201T090000Z-none", "--results", str(root)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode != 0 and "Traceback" not in done.stdout + done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: skipping")]
    assert len(warnings) >= len(HOSTILE_RECORDS), done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"error: run 'eval-20261201T090000Z-none': not found under "
                                                    f"{root}")


def test_hostile_rows_and_bench_output_are_one_error_naming_file_and_line(tmp_path: Path) -> None:
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps(ROWS[0]) + "\n" + nested(100_000) + "\n" + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(ConfigError, match=f"^{answers}:2: JSON nested deeper than 64 levels$"):
        read_jsonl(answers)
    answers.write_text('{"id": "q0", "set": "s", "score": ' + "1" * 5001 + "}\n" + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(ConfigError, match=f"^{answers}:1: an integer of 5001 digits"):
        read_jsonl(answers)

    root = tmp_path / "results"
    run_dir = bench_run(root, "desktop", "bench-20261201T010000Z-000c", [("m", [bench_record((512, 0), [1.0])])])
    raw = next((run_dir / "llama-bench").iterdir())
    raw.write_text(nested(100_000))
    run = ResultsStore(root).find("desktop/bench-20261201T010000Z-000c")
    from rigctl.bench.matrix import load_run_samples

    with pytest.raises(ConfigError, match=f"{raw.name}: JSON nested deeper"):
        load_run_samples(run)
    eval_dir = eval_run(root, "desktop", "eval-20261201T010000Z-000d", "m", ROWS)
    (eval_dir / "answers.jsonl").write_text(nested(100_000) + "\n" + json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ConfigError, match="answers.jsonl:1: JSON nested deeper"):
        load_answers(ResultsStore(root).find("desktop/eval-20261201T010000Z-000d"))


_FIELDS = sorted({f.name for cls in (RunRecord, Server, Gpu, Artifact, Task, LlamaCppBuild)
                  for f in dataclasses.fields(cls)}
                 | {"server", "contenders", "baseline", "fanout", "slots", "slot_ctx", "args", "url", "probe_port",
                    "spec"})  # and the keys only version-1 records have
_leaf = (st.none() | st.booleans() | st.integers(-3, 3) | st.floats() | st.text(max_size=4)
         | st.sampled_from(["bench", "eval", "done", "-c", "4096"]))
_shaped = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.sampled_from(_FIELDS), inner, max_size=4), max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(data=st.dictionaries(st.sampled_from(_FIELDS), _shaped, max_size=10), version_1=st.booleans())
def test_any_json_shaped_like_a_record_is_a_record_or_a_config_error(data: dict, version_1: bool) -> None:
    if version_1:  # the older shape goes through the upgrade first
        data.pop("version", None)
    try:
        record = RunRecord.from_dict(data, "fuzz")
    except ConfigError as exc:
        assert str(exc).startswith("fuzz: ") and "\n" not in str(exc)
        return
    json.dumps(record.to_dict())
    assert all(server.ctx_size is None or server.ctx_size >= 0 for server in record.servers)


# ----------------------------------------------------------------------------------------------- pull


def _host(name: str) -> Host:
    return Host(name=name, address="192.0.2.1", user="root", groups=("all",), vars={})


def _listing_entry(host: str, run_id: str, files: dict[str, bytes], *, listed: dict[str, bytes] | None = None,
                   **changes) -> dict:
    """A run as a host's listing sends it: its record (``listed``: the files it claims, by default
    ``files``) and every file inline, run.json included."""
    claimed = files if listed is None else listed
    record = RunRecord(id=run_id, kind="bench", host=host, started="2026-12-01T01:00:00Z", status="done",
                       files=[RawFile(p, hashlib.sha256(b).hexdigest(), len(b)) for p, b in claimed.items()])
    data = {**record.to_dict(), **changes}
    inline = {p: base64.b64encode(b).decode() for p, b in files.items()}
    inline[RUN_FILE] = base64.b64encode(json.dumps(data).encode()).decode()
    return {"record": data, "inline": inline, "active": False}


class _FakeHost:
    """What ssh.run returns for a host's run listing; ``answer`` the text, or an exception it raises."""

    def __init__(self, name: str, answer: str | BaseException):
        self.host = name
        self.answer = answer

    def run(self, cmd: str, **_: object) -> SimpleNamespace:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return SimpleNamespace(stdout=self.answer, stderr="", rc=0, ok=True)

    def get(self, remote: str, *_: object, **__: object) -> None:
        raise AssertionError(f"{remote}: every file of these runs comes inline")


def test_one_bad_run_or_host_costs_only_itself_in_pull(tmp_path: Path, monkeypatch) -> None:
    ok = {"cells.jsonl": b"{}\n"}
    run = "bench-20261201T0{}0000Z-00{}0".format
    mixed = {
        run(1, 1): _listing_entry("mixed", run(1, 1), ok),
        run(2, 2): _listing_entry("mixed", run(2, 2), {"x": b"1", "x/y": b"2"}),
        run(3, 3): _listing_entry("mixed", run(3, 3), {"n" * 300: b"1"}),
        run(4, 4): _listing_entry("mixed", run(4, 4), ok, extra={"deep": json.loads(nested(200))}),
        run(5, 5): _listing_entry("mixed", run(5, 5), {"cells.jsonl": b"tampered"}, listed=ok),
        run(6, 6): _listing_entry("mixed", run(6, 6), ok, seed=10**30),
        run(7, 7): _listing_entry("mixed", run(7, 7), ok, seed=123456789),  # made 5,001 digits in the text
    }
    answers = {
        "good": json.dumps({run(1, 1): _listing_entry("good", run(1, 1), ok)}),
        "mixed": json.dumps(mixed).replace('"seed": 123456789', '"seed": ' + "7" * 5001),
        "deep": "{" + '"a": [' + nested(200_000) + "]}",
        "broken": RuntimeError("a bug a host's answer found"),
    }

    @contextlib.contextmanager
    def session(host: Host, client: object = None):
        yield _FakeHost(host.name, answers[host.name])

    monkeypatch.setattr(jobs, "session", session)
    store = ResultsStore(tmp_path / "results")
    outcome = jobs.pull_hosts([_host(name) for name in answers], store)

    assert list(outcome) == list(answers)
    assert not isinstance(outcome["good"], Exception), repr(outcome["good"])
    assert outcome["good"].copied == [run(1, 1)]
    assert outcome["mixed"].copied == [run(1, 1)]
    refused = dict(zip(sorted(mixed)[1:], outcome["mixed"].refused, strict=True))
    assert "raw file 'x' is also the directory of another raw file" in refused[run(2, 2)]
    assert "File name too long" in refused[run(3, 3)]
    assert "nested deeper than 64 levels" in refused[run(4, 4)]
    assert "sha256 is" in refused[run(5, 5)]
    assert "an integer of 31 digits" in refused[run(6, 6)]
    assert "an integer of 5001 digits" in refused[run(7, 7)]
    assert all(line.startswith(f"mixed: run {rid!r} refused: ") and "\n" not in line for rid, line in refused.items())
    # Nothing of a refused run is left behind: no run directory, no staging directory.
    assert sorted(os.listdir(store.root / "mixed")) == [run(1, 1)]
    for name, needle in (("deep", f"nested deeper than {DEFERRED_DEPTH} levels"),
                         ("broken", "broken: RuntimeError: a bug a host's answer found")):
        assert isinstance(outcome[name], RigctlError) and needle in str(outcome[name]), outcome[name]
        assert "\n" not in str(outcome[name])


def test_any_exception_in_one_host_is_that_hosts_one_line_error() -> None:
    def work(host: Host) -> str:
        if host.name == "bad":
            raise KeyError("x\n" * 500)
        return host.name

    outcome = on_each_host([_host("bad"), _host("fine")], work)
    assert outcome["fine"] == "fine"
    assert isinstance(outcome["bad"], RigctlError)
    assert str(outcome["bad"]).startswith("bad: KeyError: ") and "\n" not in str(outcome["bad"])
    assert len(str(outcome["bad"])) <= len("bad: ") + 300
    assert one_line(FileNotFoundError(2, "No such file or directory", "/x")) == "No such file or directory: /x"


# ----------------------------------------------------------------------------------------------- exporter


GOOD_PROBE = {"fact": "", "nvidia_smi": {"rc": 0, "out": "0, GPU-aaaa, RTX 3050, 51, 100, 8192, 10\n"},
              "units": {"out": ""}, "models": {}}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("hostile", ["[1, 2]", '"text"', nested(200_000), json.dumps({"models": [1]}),
                                     json.dumps({"nvidia_smi": "x", "models": {"m": 3}}), "9" * 5001])
def test_a_hostile_probe_answer_and_hostile_runs_leave_every_other_hosts_metrics_served(
        tmp_path: Path, monkeypatch, caplog, hostile: str) -> None:
    root = tmp_path / "results"
    seed_results(root)
    _hostile_store(root)
    bad_answers = eval_run(root, "laptop", "eval-20261201T050000Z-0bad", "m-a", ROWS)
    (bad_answers / "answers.jsonl").write_text(nested(100_000) + "\n")
    answers = {"desktop": json.dumps(GOOD_PROBE), "laptop": hostile}

    class FakeClient:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self) -> FakeClient:
            return self

        def __exit__(self, *_: object) -> None:
            return None

        def run(self, cmd: str, **_: object) -> SimpleNamespace:
            return SimpleNamespace(stdout=answers[self.name], rc=0, ok=True)

    monkeypatch.setattr("rigctl.ssh.SshClient.for_host", classmethod(lambda cls, host, **_: FakeClient(host.name)))
    exporter = Exporter(Inventory.load(LAB_INVENTORY), results=ResultsStore(root), host_timeout=5.0)
    port = _free_port()
    server, _thread = exporter.serve(f"127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.WARNING):
            snapshot = exporter.collect_once()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200
            samples = parse_samples(reply.read().decode())
    finally:
        server.shutdown()
        exporter.stop()
    assert snapshot.hosts["laptop"].up is False and "\n" not in snapshot.hosts["laptop"].error
    assert any(r.getMessage().startswith("laptop: ") for r in caplog.records), caplog.text
    assert sample_value(samples, "rigctl_host_up", host="desktop") == 1.0
    assert sample_value(samples, "rigctl_host_up", host="laptop") == 0.0
    assert sample_value(samples, "rigctl_gpu_temperature_celsius", host="desktop") == 51.0
    assert sample_value(samples, "rigctl_results_readable") == 1.0
    # The seeded results are served; the hostile runs and the run with hostile answers are left out.
    assert sample_value(samples, "rigctl_bench_tokens_per_second", host="desktop", run="bench-b") == 140.0
    assert sample_value(samples, "rigctl_eval_score_ratio", host="laptop", run="eval-a") == 0.75
    assert {labels["run"] for labels, _ in samples["rigctl_eval_score_ratio"]} == {"eval-a", GOOD_A, GOOD_B}
    assert "skipping eval run laptop/eval-20261201T050000Z-0bad" in caplog.text


def test_results_reader_leaves_out_a_run_whose_files_provoke_anything(tmp_path: Path, monkeypatch, caplog) -> None:
    root = tmp_path / "results"
    seed_results(root)
    import rigctl.analysis.latest as latest_module

    real = latest_module.bench_results

    def bench_results(run):
        if run.id == "bench-a":
            raise ZeroDivisionError("what a run's numbers could do")
        return real(run)

    monkeypatch.setattr(latest_module, "bench_results", bench_results)
    with caplog.at_level(logging.WARNING):
        bench, evals = ResultsReader(ResultsStore(root)).latest()
    assert [b.run_id for b in bench] == ["bench-b"] and [e.run_id for e in evals] == ["eval-a"]
    assert "skipping bench run desktop/bench-a: ZeroDivisionError: what a run's numbers could do" in caplog.text


# ----------------------------------------------------------------------------------------------- MCP


def test_mcp_list_results_gives_a_bad_run_its_error_and_lists_the_rest(tmp_path: Path) -> None:
    root = tmp_path / "results"
    _hostile_store(root)
    bad = eval_run(root, "desktop", "eval-20261201T030000Z-0bad", "m", ROWS)
    (bad / "answers.jsonl").write_text(nested(100_000) + "\n")
    tools = FleetTools(Inventory.load(LAB_INVENTORY), results_root=root)
    runs = {run["id"]: run for run in tools.list_results()["runs"]}
    assert set(runs) == {GOOD_A, GOOD_B, bad.name}
    assert runs[GOOD_A]["score"] == 0.5 and "error" not in runs[GOOD_A]
    assert "answers.jsonl:1: JSON nested deeper than 64 levels" in runs[bad.name]["error"]["untrusted"]
    assert tools.compare_runs(GOOD_A, GOOD_B)["overall"]["n"] == 20


# ----------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("hostile", ["[1]", "not json", nested(200_000), "an artifact's entry not an object"])
def test_one_hosts_unreadable_model_answer_leaves_the_others_listed(monkeypatch, hostile: str) -> None:
    from rigctl.fleet.models import list_artifacts

    inventory = Inventory.load(LAB_INVENTORY)
    if hostile.startswith("an artifact"):
        hostile = json.dumps({inventory.host("laptop").artifacts[0].name: 5})
    answers = {"desktop": "{}", "laptop": hostile}

    @contextlib.contextmanager
    def session(host: Host, client: object = None):
        yield _FakeHost(host.name, answers[host.name])

    monkeypatch.setattr("rigctl.ssh.session", session)
    outcome = list_artifacts(inventory)
    assert [s.artifact for s in outcome["desktop"]] and all(s.manifest is None for s in outcome["desktop"])
    assert isinstance(outcome["laptop"], RigctlError) and str(outcome["laptop"]).startswith("laptop: ")
    assert "\n" not in str(outcome["laptop"])
