"""Bad input at every boundary: one ``error:`` line naming the culprit, never a traceback, never a silent accept.

Each class of failure found by trying bad input as a new user would (issue 16) has a test here that failed
at 6c08aee; the lab faults (class 8) are in tests/test_faults_lab.py.

=====  ==========================================  ===========================================================
class  what went wrong                             test
=====  ==========================================  ===========================================================
1      CLI usage errors garbled (typer's click)    test_usage_errors_name_the_option_and_exit_2
2      values converted without validation         test_values_are_validated_where_the_typed_views_read_them
3      inventory check passed values that break    test_inventory_check_refuses_values_that_break_later
4      Ansible's parse failures passed on raw      test_yaml_syntax_error_is_one_line_with_file_and_line
5      one bad record poisons the store            test_bad_records_are_skipped_and_the_rest_keeps_working
6      degenerate input accepted with exit 0       test_degenerate_input_is_refused
7      loader gaps (field, UTF-8, BFCL name)       test_loaders_name_file_and_line
8      faults on the lab rigs                      tests/test_faults_lab.py:
       - tampered model, no pin: verify = drift    test_tampered_model_without_a_pin_fails_verify,
                                                   test_verify_and_the_exporter_use_one_rule_manifest_hash_when_no_pin
       - full disk mid-bench / mid-quantize        test_full_disk_mid_bench_fails_the_cell_and_seals_the_reason,
                                                   test_models_artifact_on_a_full_disk_says_the_disk_is_full,
                                                   test_a_cell_without_results_is_not_a_successful_cell
       - two provisions at once                    test_second_provision_is_refused_naming_the_holder
       - link dropped mid-provision                test_a_link_dropped_mid_provision_fails_that_host_within_the_ssh_\
                                                   timeouts
       - failed rollout vs disabled instances      test_failed_rollout_leaves_no_bad_flags_in_disabled_instances_\
                                                   of_its_profile
=====  ==========================================  ===========================================================

Property tests (hypothesis, bounded in examples and time) feed the inventory checker and the result-store
loader arbitrary JSON-shaped values: they report problems, never raise anything else. The last test greps
every CLI output these tests produced for "Traceback".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from handmade_runs import bench_record, bench_run, eval_run
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from inventory_support import edit_yaml

from rigctl.analysis.compare import compare_pair, compare_runs, load_answers
from rigctl.analysis.latest import ResultsReader
from rigctl.errors import ConfigError, EvalError, RigctlError
from rigctl.evals.tasks import load_task
from rigctl.inventory import Host, Inventory
from rigctl.inventory.check import check_host
from rigctl.inventory.schema import SCHEMA
from rigctl.results.record import RUN_FILE, RunRecord
from rigctl.results.store import ResultsStore

REPO = Path(__file__).resolve().parents[2]
#: The installed command, as users run it.
RIGCTL = str(Path(sys.executable).parent / "rigctl")
#: Every CLI run of this module: (argv, stdout + stderr), grepped for tracebacks by the last test.
OUTPUTS: list[tuple[list[str], str]] = []


def rigctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([RIGCTL, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    OUTPUTS.append((list(args), done.stdout + done.stderr))
    return done


def error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    """stderr's lines but the warnings (bad records skipped, say): one line each, never wrapped."""
    return [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("warning: ")]


def one_error(done: subprocess.CompletedProcess[str], rc: int, *needles: str) -> str:
    """The run printed exactly one non-blank stderr line, ``error: ...`` with every needle, and exited ``rc``."""
    lines = error_lines(done)
    assert done.returncode == rc, (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------------------------- 1


def test_usage_errors_name_the_option_and_exit_2() -> None:
    line = one_error(rigctl("eval", "run", "--concurrency", "0"), 2, "'--concurrency'", "rigctl eval run --help")
    # The bound, in the words of the click typer parses with (its own copy in newer typers; the click package at
    # typer's floor).
    assert "greater than or equal to 1" in line or "x>=1" in line, line
    one_error(rigctl("eval", "run", "--no-such-option"), 2, "--no-such-option")
    missing = one_error(rigctl("servers", "restart", "desktop"), 2)
    assert "missing argument 'server'" in missing.lower(), missing  # typer's floor names it in capitals
    one_error(rigctl("no-such-command"), 2, "no-such-command")


# ----------------------------------------------------------------------------------------------- 2


def test_values_are_validated_where_the_typed_views_read_them(rigs: Path) -> None:
    edit_yaml(rigs / "host_vars/desktop-3050.yml", lambda d: d.update(ansible_port="twenty-two"))
    check_run = rigctl("-i", str(rigs), "inventory", "check")
    assert check_run.returncode == 2
    assert "host desktop-3050: ansible_port: Input should be a valid integer, unable to parse string as an " \
           "integer (got 'twenty-two')" in check_run.stderr, check_run.stderr
    one_error(rigctl("-i", str(rigs), "hosts"), 2, "host desktop-3050: ansible_port:", "'twenty-two'")

    edit_yaml(rigs / "host_vars/desktop-3050.yml", lambda d: d.pop("ansible_port"))
    edit_yaml(rigs / "host_vars/laptop-1650ti.yml",
         lambda d: d.update(llama_server_instances={"broken": {"artifact": "qwen3.5-2b-q4_0", "profile": "laptop"}}))
    one_error(rigctl("-i", str(rigs), "hosts"), 2, "host laptop-1650ti: llama_server_instances.broken.port: "
                                                   "required but not set")
    one_error(rigctl("-i", str(rigs), "servers"), 2, "llama_server_instances.broken.port")
    edit_yaml(rigs / "host_vars/laptop-1650ti.yml", lambda d: d.update(gpu_host_gpu="GTX 1650 Ti"))
    with pytest.raises(ConfigError, match="host laptop-1650ti: gpu_host_gpu: "):
        _ = Inventory.load(rigs).host("laptop-1650ti").gpu


# ----------------------------------------------------------------------------------------------- 3


def test_inventory_check_refuses_values_that_break_later(rigs: Path) -> None:
    def desktop(d):
        d["gpu_host_gpu"]["vram_mib"] = 8192 * 1024 * 1024  # bytes where MiB were meant
        d["llama_cpp_cuda_architectures"] = "85"  # no such architecture
        d["ansible_port"] = 70000

    def laptop(d):
        d["llama_cpp_cuda_architectures"] = "89"  # the GTX 1650 Ti is compute capability 7.5
        d.setdefault("llama_server_instances", {})["bad name;rm"] = {"artifact": "qwen3.5-2b-q4_0", "profile": "laptop",
                                                      "port": 8099}

    edit_yaml(rigs / "host_vars/desktop-3050.yml", desktop)
    edit_yaml(rigs / "host_vars/laptop-1650ti.yml", laptop)
    (rigs / "host_vars/desktop-3060.yml").write_text("ansible_host: 192.0.2.9\n")  # no such host
    done = rigctl("-i", str(rigs), "inventory", "check")
    assert done.returncode == 2
    out = done.stderr
    assert "host desktop-3050: gpu_host_gpu.vram_mib: Input should be less than or equal to 524288" in out, out
    assert "host desktop-3050: llama_cpp_cuda_architectures: '85' in '85' is not a CUDA architecture" in out, out
    assert "host desktop-3050: ansible_port: Input should be less than or equal to 65535 (got 70000)" in out, out
    assert ("host laptop-1650ti: llama_cpp_cuda_architectures: '89' does not run on the GPU's compute "
            "capability 7.5") in out, out
    assert "host laptop-1650ti: llama_server_instances.bad name;rm: 'bad name;rm' is not usable as a systemd " \
           "unit" in out, out
    assert f"file {rigs}/host_vars/desktop-3060.yml: -: no host 'desktop-3060' in the inventory (did you mean " \
           "desktop-3050?)" in out, out
    assert "Traceback" not in out


# ----------------------------------------------------------------------------------------------- 4


def test_yaml_syntax_error_is_one_line_with_file_and_line(rigs: Path) -> None:
    hosts = rigs / "hosts.yml"
    lines = hosts.read_text().splitlines(keepends=True)
    number = next(i for i, line in enumerate(lines) if line.startswith("    "))
    lines[number] = "\t" + lines[number].lstrip(" ")
    hosts.write_text("".join(lines))
    for command in (["inventory", "check"], ["hosts"]):
        done = rigctl("-i", str(rigs), *command)
        one_error(done, 2, f"inventory {hosts}:{number + 1}:1:", "'\\t'", "never tabs")
        assert "WARNING" not in done.stdout + done.stderr


# ----------------------------------------------------------------------------------------------- 5


def _good_store(root: Path) -> None:
    rows = [{"id": f"q{i}", "set": "s", "score": i % 2} for i in range(20)]
    eval_run(root, "desktop", "eval-a", "m-a", rows)
    eval_run(root, "desktop", "eval-b", "m-b", [{**r, "score": 1} for r in rows])
    bench_run(root, "desktop", "bench-good", [("m-a", [bench_record((512, 0), [100.0, 101.0])])])


def test_bad_records_are_skipped_and_the_rest_keeps_working(tmp_path: Path, caplog) -> None:
    root = tmp_path / "results"
    _good_store(root)
    array_run = root / "desktop" / "eval-array"
    array_run.mkdir()
    (array_run / RUN_FILE).write_text(json.dumps([{"id": "eval-array"}]))
    bad_cells = bench_run(root, "desktop", "bench-bad", [("m-a", [bench_record((512, 0), [90.0, 91.0])])])
    (bad_cells / "cells.jsonl").write_text('"not a cell"\n{"rc": 0}\n')
    bad_answers = eval_run(root, "laptop", "eval-bad", "m-a", [{"id": "q0", "set": "s", "score": 1}])
    (bad_answers / "answers.jsonl").write_text('["a", "list"]\n{"id": "q1", "set": "s", "score": 1}\n')

    store = ResultsStore(root)
    with caplog.at_level(logging.WARNING):
        ids = [run.id for run in store.runs()]
    assert "eval-array" not in ids and {"eval-a", "eval-b", "bench-good"} <= set(ids)
    assert any(f"skipping {array_run}" in r.getMessage() and "a run record is a JSON object, not list" in r.getMessage()
               for r in caplog.records), caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        bench, evals = ResultsReader(store).latest()
    assert [(b.run_id, b.tokens_per_second) for b in bench] == [("bench-good", 100.5)]
    assert sorted(e.run_id for e in evals) == ["eval-a", "eval-b"]
    assert "skipping bench run desktop/bench-bad" in caplog.text and "cells.jsonl:1: a str" in caplog.text
    assert "skipping eval run laptop/eval-bad" in caplog.text and "answers.jsonl:1: a list" in caplog.text

    results = ["--results", str(root)]
    done = rigctl("compare", "desktop/eval-a", "desktop/eval-b", *results)
    assert done.returncode == 0, done.stderr
    assert "overall" in done.stdout
    assert rigctl("bench", "summary", "desktop/bench-good", *results).returncode == 0
    one_error(rigctl("bench", "summary", "desktop/bench-bad", *results), 2, "bench-bad", "cells.jsonl:1")


# ----------------------------------------------------------------------------------------------- 6


def test_degenerate_input_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    task = tmp_path / "t.yaml"
    task.write_text("name: t\nscorer: gsm8k\ndataset: {path: empty.jsonl}\n")
    with pytest.raises(EvalError, match=r"t.yaml: no questions: the datasets \(.*empty.jsonl\) have no records"):
        load_task(str(task))

    root = tmp_path / "results"
    eval_run(root, "desktop", "eval-a", "m", [{"id": f"a{i}", "set": "s", "score": 1} for i in range(5)])
    eval_run(root, "desktop", "eval-b", "m", [{"id": f"b{i}", "set": "s", "score": 0} for i in range(5)])
    store = ResultsStore(root)
    a, b = store.find("desktop/eval-a"), store.find("desktop/eval-b")
    with pytest.raises(ConfigError, match="share no question: nothing to pair"):
        compare_pair(a, b)
    eval_run(root, "desktop", "eval-c", "m", [{"id": f"a{i}", "set": "s", "score": 0} for i in range(5)])
    with pytest.raises(ConfigError, match=r"exclude 'civl': no such set in these runs \(sets: s\)"):
        compare_runs([a, store.find("desktop/eval-c")], exclude=["civl"])
    one_error(rigctl("compare", "desktop/eval-a", "desktop/eval-c", "--exclude", "civl", "--results", str(root)),
              2, "--exclude 'civl': no such set")

    # Every host unreachable (a closed port on loopback): the listing says so and fails.
    inventory = tmp_path / "rigs"
    shutil.copytree(REPO / "inventory" / "rigs", inventory)
    for name in ("desktop-3050", "laptop-1650ti"):
        edit_yaml(inventory / "host_vars" / f"{name}.yml", lambda d: d.update(ansible_host="127.0.0.1", ansible_port=9))
    done = rigctl("-i", str(inventory), "models", "list")
    assert done.returncode == 1, done.stdout + done.stderr
    failures = [line for line in error_lines(done) if line.startswith("error: ")]
    assert len(failures) == 2 and all("cannot connect" in line for line in failures), done.stderr


# ----------------------------------------------------------------------------------------------- 7


def test_loaders_name_file_and_line(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 2"}\n')
    task = tmp_path / "t.yaml"
    task.write_text("name: t\nscorer: gsm8k\ndataset: {path: d.jsonl}\n")
    with pytest.raises(EvalError, match=r"d.jsonl:2: not UTF-8 text"):
        load_task(str(task))

    data.write_text('{"question": "q", "answer": "#### 1"}\n')
    task.write_text("name: t\nscorer: gsm8k\ndataset: {path: d.jsonl}\nprompt: '{question.text}'\n")
    with pytest.raises(EvalError, match=r"d.jsonl:1: prompt template '\{question.text\}': 'str' object has no "
                                        r"attribute 'text'"):
        load_task(str(task))
    task.write_bytes(b"name: t\nscorer: gsm8k\n# \xff\ndataset: {path: d.jsonl}\n")
    with pytest.raises(EvalError, match=r"t.yaml:3: not UTF-8 text"):
        load_task(str(task))
    task.write_text("name: t\nscorer: gsm8k\ndataset: {path: d.jsonl\n")
    with pytest.raises(EvalError, match=r"t.yaml: not YAML: line 4, column 1: "):
        load_task(str(task))

    functions = tmp_path / "bfcl.jsonl"
    functions.write_text(json.dumps({"id": "s0", "question": [[{"role": "user", "content": "hi"}]],
                                     "function": [{"description": "no name", "parameters": {}}]}) + "\n")
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"id": "s0", "ground_truth": [{"f": {}}]}) + "\n")
    task.write_text("name: b\nscorer: bfcl_simple\ndataset: {path: bfcl.jsonl}\nanswers: {path: answers.jsonl}\n")
    with pytest.raises(EvalError, match=r"bfcl.jsonl: s0: function: needs a name"):
        load_task(str(task))

    campaign = tmp_path / "c.yml"
    campaign.write_bytes(b"name: c\n\xfe\n")
    one_error(rigctl("report", str(campaign)), 2, f"campaign {campaign}:2: not UTF-8 text")
    # A sensitivity set that the campaign's tasks lack (the study's summeval-consistency; the shipped suite has
    # boolq, multinli and civil_comments): refused before any host, store or report is touched.
    campaign.write_text("name: c\ntitle: t\nhosts: [desktop]\nevals: [{name: suite, task: suite, runs: "
                        "[{host: desktop, server: s, artifact: a}]}]\n"
                        "sensitivity: {exclude: [civil_comments, summeval-consistency]}\n")
    for command in (["report", str(campaign), "--out", str(tmp_path / "out")], ["campaign", "run", str(campaign)]):
        one_error(rigctl(*command, "--results", str(tmp_path / "results")), 2,
                  f"error: campaign {campaign}: sensitivity.exclude: 'summeval-consistency': no such set in the "
                  "tasks suite (sets: boolq, civil_comments, multinli)")
    assert not (tmp_path / "out").exists() and not (tmp_path / "results").exists()


# ----------------------------------------------------------------------------------------------- properties

_json = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                     | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4),
                     max_leaves=12)
_HOST_KEYS = sorted(SCHEMA)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_HOST_KEYS), _json, max_size=6))
@example({"llama_server_instances": {"0\n": None}})  # a key ending in a newline once broke the one line
def test_inventory_checker_reports_never_raises(variables: dict) -> None:
    host = Host(name="h", address="192.0.2.1", user="root", groups=("all",), vars=variables)
    problems = check_host(host, set(SCHEMA))
    assert all(p.where == "host h" and p.key and p.message for p in problems)
    for view in ("port", "gpu", "servers", "llama_cpp"):
        try:
            getattr(host, view)
        except ConfigError as exc:
            assert str(exc).startswith("host h: ") and "\n" not in str(exc)


@pytest.mark.timeout(120)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(record=_json, cells=st.lists(_json, max_size=3), answers=st.lists(_json, max_size=3),
       raw=st.binary(max_size=40))
def test_result_store_loader_skips_never_raises(tmp_path_factory, record, cells, answers, raw) -> None:
    root = tmp_path_factory.mktemp("store")
    good = RunRecord(id="bench-x", kind="bench", host="h", started="2026-12-01T00:00:00Z", status="done").to_dict()
    for name, data in (("fuzz-record", record), ("fuzz-merged", {**good, **record} if isinstance(record, dict)
                                                 else good)):
        run_dir = root / "h" / name
        run_dir.mkdir(parents=True)
        (run_dir / RUN_FILE).write_text(json.dumps(data))
        (run_dir / "cells.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cells))
        (run_dir / "answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
        (run_dir / "llama-bench").mkdir()
        (run_dir / "llama-bench" / "raw.json").write_bytes(raw)
    store = ResultsStore(root)
    runs = list(store.runs())  # bad records are skipped with a warning
    for run in runs:
        assert isinstance(run.record, RunRecord)
        try:
            load_answers(run)
        except RigctlError as exc:
            assert "\n" not in str(exc)
    ResultsReader(store).latest()  # never raises: a bad run is left out


# ----------------------------------------------------------------------------------------------- last


def test_no_cli_output_of_these_tests_has_a_traceback() -> None:
    assert OUTPUTS, "run the whole module: the CLI tests above fill OUTPUTS"
    with_traceback = [" ".join(argv) for argv, output in OUTPUTS if "Traceback" in output]
    assert not with_traceback, with_traceback

