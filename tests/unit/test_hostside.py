"""rigctl.hostside: the code that runs on the hosts, run here as a host runs it (the system python3,
no site-packages, no rigctl installed), and the one copy of each parser both sides use."""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import shlex
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import role_modules

from rigctl import jobs
from rigctl.errors import BuildError, ConfigError, TransferError
from rigctl.fleet import build
from rigctl.hostside import gguf, jobfiles, jobhost, llama_cpp_fact, llama_server_http, model_files, ship
from rigctl.llama_http import client as server

HOSTSIDE = Path(ship.__file__).parent
REPO = HOSTSIDE.parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"
# Controller-only: it reads the package's files to ship them.
CONTROLLER_ONLY = {"ship"}
# sdist_fetch runs on the controller (the llama_cpp role delegates it to localhost under the playbook's
# Python) and reads pip's configuration with pip; the roles' fetching modules get their AnsibleModule from it;
# the rest of it is standard library like the others.
CONTROLLER_IMPORTS = {"sdist_fetch": {"pip", "ansible"}}


def _hostside_modules() -> list[Path]:
    return sorted(p for p in HOSTSIDE.glob("*.py") if p.stem not in CONTROLLER_ONLY)


def _run_on_host(command: str, *, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """A ``python3 -c`` command line of :mod:`rigctl.hostside.ship`, run by the system python3 in isolated
    mode without site-packages: what a host with no rigctl runs."""
    argv = shlex.split(command)
    assert argv[:2] == ["python3", "-c"]
    return subprocess.run([SYSTEM_PYTHON, "-I", "-S", *argv[1:]], input=stdin, capture_output=True, text=True,
                          timeout=60, check=False, cwd=cwd)


pytestmark = pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="needs the system python3")


# ----------------------------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("path", _hostside_modules(), ids=lambda p: p.stem)
def test_host_side_modules_import_only_the_standard_library_and_each_other(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [str(node.module)]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            allowed = sys.stdlib_module_names | CONTROLLER_IMPORTS.get(path.stem, set()) | {"__future__"}
            assert top in allowed or name.startswith("rigctl.hostside"), \
                f"{path.name} imports {name}"


def test_no_host_side_module_shadows_one_of_ansibles_module_utils() -> None:
    # ansible.cfg puts rigctl/hostside first on the module_utils path: a gguf.py there is
    # ansible.module_utils.gguf, and a basic.py would replace Ansible's own for every module.
    import ansible.module_utils

    builtin = {p.stem for p in Path(ansible.module_utils.__file__).parent.iterdir() if p.name != "__init__.py"}
    assert not builtin & {p.stem for p in HOSTSIDE.glob("*.py")}


def test_the_roles_modules_use_the_one_gguf_reader_and_model_file_helpers() -> None:
    vram = role_modules.load(REPO / "roles/llama_server/library/llama_server_vram.py", "llama_server_vram")
    artifact = role_modules.load(REPO / "roles/models/library/models_artifact.py", "models_artifact")
    assert vram.read_header is artifact.read_header is gguf.read_header
    assert artifact.file_sha256 is model_files.file_sha256
    assert vram.manifest_path is artifact.manifest_path is model_files.manifest_path
    for module in (vram, artifact):
        assert not hasattr(module, "GGML_TYPES") and not hasattr(module, "_SCALARS")


def test_the_import_closure_is_what_a_module_imports(tmp_path: Path) -> None:
    assert ship.closure(["fleet_state"]) == ["model_files", "sandbox", "server_drift", "fleet_state"]
    assert set(ship.closure(["jobrun", "eval_task"])) == {"jobrun", "eval_task", "jobfiles", "model_files",
                                                         "hash_cache", "llama_cpp_fact", "llama_server_http", "stamp",
                                                         "masking", "runrecord", "units", "scorers", "bfcl",
                                                         "commands", "nvidia_smi", "sandbox"}
    with pytest.raises(ConfigError, match="no rigctl/hostside/nope.py"):
        ship.closure(["nope"])


# ----------------------------------------------------------------------------------------------- one-shot commands


def test_model_files_inspect_and_hash_run_as_shipped(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + os.urandom(5000))
    Path(model_files.manifest_path(str(model))).write_text('{"sha256": "x"}')
    paths = {"m": str(model), "gone": str(tmp_path / "gone.gguf")}
    done = _run_on_host(ship.python_command("model_files", "inspect", json.dumps(paths), "1"))
    assert done.returncode == 0, done.stderr
    expected = hashlib.sha256(model.read_bytes()).hexdigest()
    assert json.loads(done.stdout) == {"m": {"manifest": '{"sha256": "x"}', "sha256": expected}, "gone": {}}
    assert json.loads(_run_on_host(ship.python_command("model_files", "inspect", json.dumps(paths), "0")).stdout) \
        == {"m": {"manifest": '{"sha256": "x"}'}, "gone": {}}

    # A file that changed after the probe saw it is not reported with a hash of what it is now.
    seen = model_files.identity(model)
    stale = [*seen[:4], seen[4] - 1]
    answer = _run_on_host(ship.python_command("model_files", "hash", json.dumps({str(model): seen,
                                                                               str(tmp_path / "x"): seen,
                                                                               f"{model}.stale": stale})))
    assert json.loads(answer.stdout) == {str(model): expected}


def test_fleet_state_runs_as_shipped(tmp_path: Path) -> None:
    fact = tmp_path / "llama_cpp.fact"
    fact.write_text("[current]\nname = b1-abc\n")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    args = {"fact": str(fact), "gpu_fields": "index,name", "timeout": 5, "unit_pattern": "rigctl-none-*.service",
            "unit_properties": "Id", "units": [], "models": {"m": str(model), "gone": str(tmp_path / "gone")}}
    env_path = f"{tmp_path}:/usr/bin:/bin"  # no nvidia-smi on this PATH
    argv = shlex.split(ship.python_command("fleet_state", json.dumps(args)))
    done = subprocess.run([SYSTEM_PYTHON, "-I", "-S", *argv[1:]], capture_output=True, text=True, timeout=60,
                          env={"PATH": env_path}, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["fact"] == "[current]\nname = b1-abc\n"
    assert out["nvidia_smi"]["rc"] == 127 and "not found" in out["nvidia_smi"]["err"]
    assert out["models"]["m"] == {"path": str(model), "stat": model_files.identity(model), "manifest": None}
    assert out["models"]["gone"]["stat"] is None


def test_jobhost_lists_run_records_as_shipped(tmp_path: Path) -> None:
    (tmp_path / "bench-1").mkdir()
    (tmp_path / "bench-1" / "run.json").write_text('{"id": "bench-1", "status": "done"}')
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "run.json").write_text("not json")
    done = _run_on_host(ship.python_command("jobhost", "runs", str(tmp_path), jobs.UNIT_PREFIX, "0"))
    assert json.loads(done.stdout) == {"bench-1": {"record": {"id": "bench-1", "status": "done"}, "active": False}}
    assert json.loads(_run_on_host(ship.python_command("jobhost", "runs", str(tmp_path / "none"), "x", "0")).stdout) \
        == {}
    assert _run_on_host(ship.python_command("jobhost", "frobnicate")).returncode == 2


def _sealed_run(root: Path, run_id: str, files: dict[str, bytes], *, listed: tuple[str, ...] = (),
                status: str = "done") -> dict:
    run = root / run_id
    run.mkdir(parents=True)
    for rel, data in files.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(data)
    record = {"id": run_id, "status": status, "files": [{"path": rel, "sha256": hashlib.sha256(data).hexdigest(),
                                                         "bytes": len(data)} for rel, data in files.items()]
              + [{"path": rel, "sha256": "0" * 64, "bytes": 1} for rel in listed]}
    (run / "run.json").write_text(json.dumps(record))
    return record


def test_jobhost_sends_small_run_files_inline_and_only_from_inside_the_run(tmp_path: Path) -> None:
    root = tmp_path / "results"
    (tmp_path / "secret").write_bytes(b"not the run's")
    _sealed_run(root, "bench-1", {"cells.jsonl": b"{}\n", "llama-bench/cell-001.json": b"[]\n"},
                listed=("../../secret", "/etc/hostname", "missing.log"))
    _sealed_run(root, "bench-2", {"big.json": b"x" * 5000})
    _sealed_run(root, "bench-3", {"cells.jsonl": b"{}\n"}, status="running")
    answer = json.loads(_run_on_host(ship.python_command("jobhost", "runs", str(root), jobs.UNIT_PREFIX,
                                                         "4000")).stdout)
    inline = {run: {rel: base64.b64decode(text) for rel, text in entry.get("inline", {}).items()}
              for run, entry in answer.items()}
    run_json = (root / "bench-1" / "run.json").read_bytes()
    # bench-1 whole, but nothing outside it; bench-2's file over what is left of the budget (SFTP takes it);
    # a running run none.
    assert inline["bench-1"] == {"run.json": run_json, "cells.jsonl": b"{}\n", "llama-bench/cell-001.json": b"[]\n"}
    assert inline["bench-2"] == {"run.json": (root / "bench-2" / "run.json").read_bytes()}
    assert inline["bench-3"] == {}
    # Named runs only.
    only = json.loads(_run_on_host(ship.python_command("jobhost", "runs", str(root), jobs.UNIT_PREFIX, "0",
                                                       "bench-2")).stdout)
    assert list(only) == ["bench-2"] and "inline" not in only["bench-2"]


def test_an_inline_run_file_lands_only_when_it_is_the_recorded_bytes(tmp_path: Path) -> None:
    data = b'{"index": 1}\n'
    good, bad = tmp_path / "good", tmp_path / "bad"
    os.umask(0o077)
    try:
        jobs._write_inline("h", "/r/cells.jsonl", good, base64.b64encode(data).decode(),
                           hashlib.sha256(data).hexdigest())
    finally:
        os.umask(0o022)
    assert good.read_bytes() == data and stat.S_IMODE(good.stat().st_mode) == jobs.FILE_MODE
    for text, message in ((base64.b64encode(b"other").decode(), "sha256 is"), ("not base64!", "not base64")):
        with pytest.raises(TransferError, match=message):
            jobs._write_inline("h", "/r/cells.jsonl", bad, text, hashlib.sha256(data).hexdigest())
        assert not bad.exists()


def test_jobhost_progress_key_is_the_controllers() -> None:
    info = jobs.JobInfo(host="h", id="bench-1", kind="bench", unit="u", state="running", done=2, total=4,
                        message="cell 3/4")
    state = {"state": "running", "done": 2, "total": 4, "message": "cell 3/4", "updated": "later"}
    assert jobs._progress_key(info) == jobhost.progress_key(state)
    assert jobs._progress_key(None) == jobhost.progress_key(None) == ""


def test_a_job_file_cannot_land_outside_the_job_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not inside"):
        jobhost.write_job_dir(str(tmp_path / "job"), {"../escape.py": "x"})
    assert not (tmp_path / "escape.py").exists()


# ----------------------------------------------------------------------------------------------- job directories


def test_a_job_directory_imports_its_modules_without_rigctl_installed(tmp_path: Path) -> None:
    files = {"jobrun.py": ship.source("jobrun"), "eval_task.py": ship.source("eval_task"),
             **ship.package_files(["jobrun", "eval_task"])}
    assert "rigctl/hostside/llama_server_http.py" in files and "rigctl/hostside/model_files.py" in files
    jobhost.write_job_dir(str(tmp_path), files)
    probe = ("import jobrun, eval_task, rigctl.hostside.model_files as m; "
             "print(m.__file__, jobrun.cached_sha256.__globals__['model_files'] is m)")
    done = subprocess.run([SYSTEM_PYTHON, "-S", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {probe}"],
                          capture_output=True, text=True, timeout=60, cwd="/", check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / "rigctl/hostside/model_files.py"), "True"]


# ----------------------------------------------------------------------------------------------- shared parsers

FACT = """[current]
name = b11434-aaaaaaaaaaaa
dir = /opt/llama.cpp/b11434-aaaaaaaaaaaa
key = aaaaaaaaaaaa
version = b11434
commit = 0123abcd
build_number = 11434
cuda = true
cmake_flags = -DGGML_CUDA=ON
    -DGGML_NATIVE=ON

[current_binaries]
llama-server = 00ff

[previous]
name = b11000-bbbbbbbbbbbb
"""


def test_one_fact_reader_for_the_controller_and_the_job_record() -> None:
    builds = build.parse_fact(FACT, "desktop")
    assert builds.current is not None and builds.previous is not None
    assert builds.current.cmake_flags == ("-DGGML_CUDA=ON", "-DGGML_NATIVE=ON")
    assert builds.current.binaries == {"llama-server": "00ff"} and builds.current.cuda
    assert builds.previous.build_number == 0 and builds.previous.binaries == {}
    current = llama_cpp_fact.parse_builds(FACT)["current"]
    assert current is not None
    assert llama_cpp_fact.record_fields(current) == {
        "name": "b11434-aaaaaaaaaaaa", "dir": "/opt/llama.cpp/b11434-aaaaaaaaaaaa", "commit": "0123abcd",
        "version": "b11434", "build_key": "aaaaaaaaaaaa", "build_number": 11434, "cuda": True,
        "binaries": {"llama-server": "00ff"}}
    assert build.parse_fact("", "desktop").current is None
    for bad in ("not ini", "[current]\nbuild_number = many\n"):
        with pytest.raises(BuildError, match="desktop: .*llama_cpp.fact is not the llama_cpp role's fact"):
            build.parse_fact(bad, "desktop")


def test_props_and_retry_are_the_same_on_both_sides() -> None:
    props = {"build_info": "b1-abc", "model_path": "/m.gguf", "total_slots": 2,
             "default_generation_settings": {"n_ctx": 4096}, "chat_template": "t"}
    parsed = server.parse_props(props)
    assert llama_server_http.props_fields(props) == {
        "build_info": parsed.build_info, "model_path": parsed.model_path, "total_slots": parsed.total_slots,
        "n_ctx": parsed.n_ctx, "chat_template": parsed.chat_template}
    assert server.parse_props({}).n_ctx is None and server.parse_props({}).total_slots == 1
    retry = server.Retry()
    assert (retry.attempts, retry.backoff, retry.max_wait) == (llama_server_http.RETRY_ATTEMPTS,
                                                               llama_server_http.RETRY_BACKOFF,
                                                               llama_server_http.RETRY_MAX_WAIT)
    for attempt in range(6):
        wait = retry.wait(attempt)
        assert 0.75 * min(8.0, 0.5 * 2**attempt) <= wait <= 1.25 * min(8.0, 0.5 * 2**attempt)
    assert llama_server_http.retryable_status(503) and not llama_server_http.retryable_status(404)


def test_gguf_reader_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    for name, data, message in (("magic.gguf", b"GGML" + bytes(20), "bad magic"),
                                ("v1.gguf", b"GGUF" + (1).to_bytes(4, "little") + bytes(16), "version 1"),
                                ("cut.gguf", b"GGUF" + (3).to_bytes(4, "little") + bytes(4), "truncated")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(gguf.GGUFError, match=message):
            gguf.read_header(str(tmp_path / name))


def _gguf_with_vocabulary(tokens: list[str]) -> bytes:
    """A GGUF v3 header: a string-array key (a vocabulary), then a scalar key; no tensors."""
    def string(text: str) -> bytes:
        data = text.encode()
        return len(data).to_bytes(8, "little") + data

    body = string("tokenizer.ggml.tokens") + (9).to_bytes(4, "little") + (8).to_bytes(4, "little") \
        + len(tokens).to_bytes(8, "little") + b"".join(string(t) for t in tokens)
    body += string("llama.block_count") + (4).to_bytes(4, "little") + (30).to_bytes(4, "little")
    return b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (2).to_bytes(8, "little") + body


def test_gguf_reader_skips_a_long_string_array_and_reads_on(tmp_path: Path) -> None:
    data = _gguf_with_vocabulary([f"tok{i}" * (i % 7) for i in range(gguf.MAX_ARRAY + 1000)])
    (tmp_path / "m.gguf").write_bytes(data)
    meta = gguf.read_header(str(tmp_path / "m.gguf"), tensors=False)["meta"]
    assert meta == {"tokenizer.ggml.tokens": {"length": gguf.MAX_ARRAY + 1000}, "llama.block_count": 30}
    # Cut inside the array, or with the last string running past the end: refused, not read past.
    for cut in (len(data) // 2, len(data) - len("llama.block_count") - 30):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(gguf.GGUFError, match="truncated|past the end"):
            gguf.read_header(str(tmp_path / "cut.gguf"), tensors=False)


# ----------------------------------------------------------------------------------------------- the job tree


def _job_tree(tmp_path: Path, **spec: object) -> tuple[Path, dict]:
    """A job directory as jobhost start leaves it (the shipped bench job, its spec) and its run directory."""
    job_dir = tmp_path / "jobs" / "bench-1"
    full = {"id": "bench-1", "kind": "bench", "host": "desktop", "unit": "rigctl-bench-1", "job_dir": str(job_dir),
            "results_dir": str(tmp_path / "results"), "lock_file": str(tmp_path / "jobs" / "locks" / "gpu.json"),
            "unit_properties": ["User=llama"], **spec}
    jobhost.write_job_dir(str(job_dir), {**jobs.task_sources("bench_task"), "spec.json": json.dumps(full)})
    Path(jobfiles.run_dir(full)).mkdir(parents=True)
    return job_dir, full


def test_a_job_shows_its_final_state_only_once_roots_last_step_is_done(tmp_path: Path) -> None:
    job_dir, spec = _job_tree(tmp_path)
    assert jobhost.job_state(str(job_dir), spec, None)["state"] == "starting"
    done = {"state": "done", "done": 2, "total": 2, "message": "done"}
    Path(jobfiles.state_path(spec)).write_text(json.dumps(done))
    state = jobfiles.read_state(str(job_dir), spec)
    assert state == done and jobfiles.state_path(spec).startswith(jobfiles.run_dir(spec) + "/")
    # Done, but the servers it stopped are not started again yet: finishing, which wait does not end on.
    finishing = jobhost.job_state(str(job_dir), spec, state)
    assert finishing["state"] == "finishing" and not jobs.parse_job("desktop", {
        "spec": spec, "state": finishing, "active": True}).finished
    (job_dir / jobfiles.FINISHED_FILE).write_text("{}")
    assert jobhost.job_state(str(job_dir), spec, state) == done
    # The host's wait answers as soon as root's step is done, not after its hold.
    (job_dir / jobfiles.FINISHED_FILE).unlink()
    timer = threading.Timer(0.3, lambda: (job_dir / jobfiles.FINISHED_FILE).write_text("{}"))
    timer.start()
    began = time.monotonic()
    jobhost.wait_for_change(str(job_dir), jobhost.progress_key(finishing), 20, 0.05)
    assert 0.25 < time.monotonic() - began < 5
    # A job started before the tree was root's: its state in its job directory, final as it says.
    old = {k: v for k, v in spec.items() if k != "unit_properties"}
    Path(jobfiles.state_path(spec)).unlink()
    (job_dir / jobfiles.OLD_STATE_FILE).write_text(json.dumps(done))
    (job_dir / jobfiles.FINISHED_FILE).unlink()
    assert jobhost.job_state(str(job_dir), old, jobfiles.read_state(str(job_dir), old)) == done


def test_root_reads_what_a_job_wrote_without_following_links_or_waiting(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text('{"root": "only"}')
    (tmp_path / "link").symlink_to(tmp_path / "secret")
    os.mkfifo(tmp_path / "fifo")  # opened plainly, this would block the listing forever
    (tmp_path / "big").write_text(json.dumps({"x": "y" * 100}))
    assert jobfiles.read_json(str(tmp_path / "secret")) == {"root": "only"}
    assert jobfiles.read_json(str(tmp_path / "link")) is None
    assert jobfiles.read_json(str(tmp_path / "fifo")) is None
    assert jobfiles.read_json(str(tmp_path / "big"), limit=50) is None
    (tmp_path / "deep").write_text("[" * 100000 + "]" * 100000)
    assert jobfiles.read_json(str(tmp_path / "deep")) is None


FAKE_SYSTEMCTL = """#!/bin/sh
echo "$*" >> "$SYSTEMCTL_LOG"
case "$1 $2" in
    "start llama-server@broken.service") echo "Job failed" >&2; exit 1 ;;
    "stop llama-server@wedged.service") echo "Timed out" >&2; exit 1 ;;
esac
"""


def test_roots_steps_hash_stop_and_start_only_what_the_spec_names(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(4096))
    units = ["llama-server@a.service", "llama-server@broken.service"]
    job_dir, spec = _job_tree(tmp_path, artifacts=[str(model), str(tmp_path / "gone.gguf")], stop_units=units)
    locks = tmp_path / "jobs" / "locks"
    locks.mkdir()
    (locks / "gpu.json").write_text(json.dumps({"job": "bench-1", "unit": "rigctl-bench-1"}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(FAKE_SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    log = tmp_path / "systemctl.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SYSTEMCTL_LOG": str(log)}

    def step(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([*jobhost.PYTHON, str(job_dir / "jobrun.py"), name, str(job_dir)], env=env,
                              capture_output=True, text=True, timeout=60, check=False, cwd=job_dir)

    prepared = step("--prepare")
    assert prepared.returncode == 0, prepared.stderr
    cache = json.loads((tmp_path / "sha256-cache.json").read_text())
    assert list(cache) == [str(model)] and cache[str(model)]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert log.read_text().splitlines() == [f"stop {u}" for u in units]
    assert not (job_dir / jobfiles.FINISHED_FILE).exists()

    log.unlink()
    finished = step("--finish")
    assert finished.returncode == 0, finished.stderr
    assert log.read_text().splitlines() == [line for u in units for line in (f"reset-failed {u}", f"start {u}")]
    assert json.loads((job_dir / jobfiles.FINISHED_FILE).read_text())["restore_problems"] == [
        "llama-server@broken.service: Job failed"]
    assert not (locks / "gpu.json").exists()
    # Another job's lock stays.
    (locks / "gpu.json").write_text(json.dumps({"job": "bench-2", "unit": "rigctl-bench-2"}))
    assert step("--finish").returncode == 0 and (locks / "gpu.json").exists()

    # A server that will not stop keeps the job from running: it fails, saying why, once root's last step ran.
    spec["stop_units"] = ["llama-server@wedged.service", "llama-server@a.service"]
    (job_dir / "spec.json").write_text(json.dumps(spec))
    log.unlink()
    assert step("--prepare").returncode == 1
    assert log.read_text().splitlines() == ["stop llama-server@wedged.service"]
    assert jobhost.job_state(str(job_dir), spec, None)["state"] == "failed"  # finished.json is there
    (job_dir / jobfiles.FINISHED_FILE).unlink()
    assert jobhost.job_state(str(job_dir), spec, None)["state"] == "starting"
    assert step("--finish").returncode == 0
    failed = jobhost.job_state(str(job_dir), spec, None)
    assert (failed["state"], failed["error"]) == ("failed", "cannot stop llama-server@wedged.service: Timed out")


# ----------------------------------------------------------------------------------------------- links in a run


def _run_with_links(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A jobs root whose run holds a raw file, then links a job could leave: a file link, a directory link and
    a FIFO, all pointing at or standing for a secret outside the run."""
    from rigctl.hostside.runrecord import RunRecord

    secret = tmp_path / "secret"
    secret.write_text("root's eyes only\n")
    root = tmp_path / "results" / "desktop"
    run_dir = root / "eval-20261203T100000Z-0001"
    (run_dir / "raw").mkdir(parents=True)
    (run_dir / "raw" / "answers.jsonl").write_text('{"id": 1}\n')
    (run_dir / "linked.txt").symlink_to(secret)
    (run_dir / "outside").symlink_to(tmp_path)
    os.mkfifo(run_dir / "pipe")
    record = RunRecord(id=run_dir.name, kind="eval", host="desktop", started="2026-12-03T10:00:00.0Z")
    record.seal(run_dir)
    return root, run_dir, record.to_dict()


def test_sealing_a_run_lists_and_reads_no_link_and_no_fifo(tmp_path: Path):
    _, _, record = _run_with_links(tmp_path)
    assert [f["path"] for f in record["files"]] == ["raw/answers.jsonl"]  # no link, no FIFO (it would block)


def test_the_root_run_listing_reads_no_file_through_a_link_and_none_past_its_recorded_size(tmp_path: Path):
    root, run_dir, record = _run_with_links(tmp_path)
    # The record names files through the links, as a job that rewrote its run.json could.
    record["files"] += [{"path": "linked.txt", "sha256": "0" * 64, "bytes": 100},
                        {"path": "outside/secret", "sha256": "0" * 64, "bytes": 100},
                        {"path": "pipe", "sha256": "0" * 64, "bytes": 100},
                        {"path": "../desktop/eval-20261203T100000Z-0001/run.json", "sha256": "0" * 64, "bytes": 100}]
    (run_dir / "run.json").write_text(json.dumps(record))
    inline, _ = jobhost.inline_files(str(run_dir), record, 1 << 20)
    assert sorted(inline) == ["raw/answers.jsonl", "run.json"]
    assert all(b"root's eyes" not in base64.b64decode(v) for v in inline.values())
    # A raw file grown past the size its record names is not read past it: it is left to SFTP, which refuses it.
    (run_dir / "raw" / "answers.jsonl").write_text('{"id": 1}\n' * 1000)
    inline, _ = jobhost.inline_files(str(run_dir), record, 1 << 20)
    assert sorted(inline) == ["run.json"]
    # A run directory that is itself a link is not read by the listing.
    (root / "eval-20261203T100000Z-0002").symlink_to(run_dir)
    listed = jobhost.list_runs(str(root), "rigctl-job-", 1 << 20)
    assert sorted(listed) == ["eval-20261203T100000Z-0001"]
