"""The run lifecycle and the server lifecycle without the lab: a run's directory made at once and sealed
however the block ends, every controller-driven kind through it, and the one rule for starting units."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from rigctl.errors import ServerError
from rigctl.fleet.servers import last_own_messages, operator_start
from rigctl.hostside import units
from rigctl.results.record import RUN_ID, RUN_KINDS, Provenance, RunRecord, Server, new_run_id
from rigctl.results.run import INTERRUPTED, Run, RunResult, open_run
from rigctl.results.store import ResultsStore

REPO = Path(__file__).resolve().parents[2]


def _stamp() -> Provenance:
    return Provenance(host="desktop", servers=[Server(name="smollm2", host="desktop", port=8080)], concurrency=4)


def test_a_run_exists_as_soon_as_it_opens_and_is_sealed_done_with_its_files(tmp_path):
    store = ResultsStore(tmp_path)
    with open_run("load", _stamp(), store, extra={"levels": [1, 2]}) as run:
        on_disk = RunRecord.load(run.path)
        assert on_disk.status == "running" and on_disk.extra == {"levels": [1, 2]} and on_disk.ended is None
        assert run.path == tmp_path / "desktop" / run.record.id and RUN_ID.match(run.record.id)
        run.write_jsonl("levels.jsonl", [{"b": 1, "a": 2}])
        run.write_json("metrics.json", {"x": 1})
    [stored] = list(store.runs())
    assert stored.record.status == "done" and stored.record.ended and "error" not in stored.record.extra
    assert [f.path for f in stored.record.files] == ["levels.jsonl", "metrics.json"] and store.verify(stored) == []
    assert (run.path / "levels.jsonl").read_text() == '{"a": 2, "b": 1}\n'


def test_a_commands_result_names_its_run_as_the_run_does(tmp_path):
    from rigctl.bench.drafting import RaceResult
    from rigctl.bench.load import LoadResult
    from rigctl.bench.server import ServerBenchResult

    results = [LoadResult(host="desktop", instance="smollm2"), ServerBenchResult(host="desktop", instance="smollm2"),
               RaceResult(host="desktop", baseline="smollm2", contenders=[], requests=[])]
    assert all(isinstance(r, RunResult) and r.ref == "desktop/?" for r in results)  # no run opened yet
    with open_run("load", _stamp(), ResultsStore(tmp_path)) as run:
        for result in results:
            result.run_dir = run.path
    assert {r.ref for r in results} == {run.ref} and run.ref == f"desktop/{run.record.id}"


def test_a_run_that_fails_is_sealed_failed_with_the_error_and_the_error_goes_on(tmp_path):
    store = ResultsStore(tmp_path)
    with pytest.raises(ServerError), open_run("server-speed", _stamp(), store) as run:
        run.write_jsonl("sweep.jsonl", [{"prompt_tokens": 16}])
        raise ServerError("desktop/smollm2", "start", "llama-server@smollm2.service is inactive (dead)")
    [stored] = list(store.runs())
    assert stored.record.status == "failed"
    assert stored.record.extra["error"] == "desktop/smollm2: start: llama-server@smollm2.service is inactive (dead)"
    assert [f.path for f in stored.record.files] == ["sweep.jsonl"]  # what it finished stays with it


def test_any_exception_and_an_interrupt_are_sealed_too(tmp_path):
    store = ResultsStore(tmp_path)
    with pytest.raises(ZeroDivisionError), open_run("spec", _stamp(), store) as failed:
        1 / 0  # noqa: B018
    with pytest.raises(KeyboardInterrupt), open_run("spec", _stamp(), store) as stopped:
        raise KeyboardInterrupt
    assert RunRecord.load(failed.path).extra["error"] == "ZeroDivisionError: division by zero"
    record = RunRecord.load(stopped.path)
    assert (record.status, record.extra["error"]) == ("stopped", INTERRUPTED)


def test_a_stopped_run_reopens_running_without_its_old_error(tmp_path):
    store = ResultsStore(tmp_path)
    with pytest.raises(RuntimeError), open_run("eval", _stamp(), store):
        raise RuntimeError("gone")
    reopened = Run.reopen(store.find(next(store.runs()).id))
    record = RunRecord.load(reopened.path)
    assert record.status == "running" and "error" not in record.extra and len(record.extra["resumed"]) == 1


def test_the_host_stamp_arrives_after_the_run_began(tmp_path):
    """A run begins with what the inventory says; the host's completed stamp replaces the provenance, not the
    results directory's host."""
    with open_run("load", _stamp(), ResultsStore(tmp_path)) as run:
        run.record.restamp(Provenance(host="elsewhere", servers=[Server(name="smollm2", argv=["llama-server"])],
                                      concurrency=4))
        run.save()
    record = RunRecord.load(run.path)
    assert record.host == "desktop" and record.server.argv == ["llama-server"] and record.concurrency == 4


def test_every_kind_has_run_ids_and_the_controller_driven_kinds_all_open_through_open_run():
    """One line adds a kind (RUN_KINDS); the controller's run modules make no run directory themselves."""
    for kind in RUN_KINDS:
        assert RUN_ID.match(new_run_id(kind))
    assert not RUN_ID.match("rollback-20261130T051200Z-3f9a")
    for module in ("bench/server.py", "bench/load.py", "bench/drafting.py", "evals/runner.py", "upgrade/upgrade.py",
                   "upgrade/bisect.py", "upgrade/paired.py"):
        tree = ast.parse((REPO / "rigctl" / module).read_text())
        calls = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute)}
        assert not calls & {"begin", "run_dir", "seal"}, module


# ----------------------------------------------------------------------------------------------- servers


def test_every_start_clears_the_failure_counter_first_on_both_sides():
    assert units.commands("start", ["a.service"]) == [["systemctl", "reset-failed", "a.service"],
                                                     ["systemctl", "start", "a.service"]]
    assert units.commands("stop", ["a.service"]) == [["systemctl", "stop", "a.service"]]
    assert operator_start(["a.service"], "restart") == "systemctl reset-failed a.service; systemctl restart a.service"


def test_a_units_last_words_are_its_own_from_its_last_run_with_the_cause_first():
    systemd = {"SYSLOG_IDENTIFIER": "systemd", "_PID": "1"}

    def said(message: str, run: str = "b") -> dict:
        return {"SYSLOG_IDENTIFIER": "llama-server", "_SYSTEMD_INVOCATION_ID": run, "MESSAGE": message}

    lines = [said("0.01.000.000 E srv an older run's error", run="a"),
             {**systemd, "MESSAGE": "Started rigctl-loadprobe-smollm2.service - /etc/llama-server/x.bin"},
             said("warning: no usable GPU found"), said("0.00.015.844 E srv start: couldn't bind\x1b[2J"),
             said("0.00.015.845 I srv operator(): cleaning up"), said("0.00.023.360 E srv exiting due to HTTP error"),
             {**systemd, "MESSAGE": "rigctl-loadprobe-smollm2.service: Failed with result 'exit-code'."}]
    text = "\n".join(json.dumps(line) for line in lines) + "\nnot json\n"
    assert last_own_messages(text) == ("0.00.015.844 E srv start: couldn't bind[2J / "
                                       "0.00.023.360 E srv exiting due to HTTP error")
    refused = [said("some output"), said("error: invalid argument: --bogus")]
    assert last_own_messages("\n".join(json.dumps(line) for line in refused)) == "error: invalid argument: --bogus"
    assert last_own_messages(json.dumps({"MESSAGE": list(b"bad \xff byte")})) == "bad \ufffd byte"
    assert last_own_messages("") == ""
