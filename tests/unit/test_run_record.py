"""The run record without the lab: the typed shape and its stamp, old (version 1) run directories loading,
the host-side argv reader on a real process, and the store's confined paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rigctl.errors import ConfigError, RigctlError, TrustError
from rigctl.hostside import jobrun
from rigctl.hostside import stamp as host_stamp
from rigctl.hostside.masking import mask_argv
from rigctl.results.record import (
    RECORD_VERSION,
    RUN_FILE,
    Artifact,
    Gpu,
    LlamaCppBuild,
    Provenance,
    RunRecord,
    Server,
    Task,
    upgrade,
)
from rigctl.results.store import ResultsStore

ARGV = ["/etc/llama-server/smollm2.bin", "--model", "/var/lib/rigctl/models/smollm2.gguf", "--port", "8080",
        "-c", "4096", "--parallel", "2", "--api-key-file", "/etc/llama-server/api-key"]


def _write(root: Path, host: str, run_id: str, data: dict) -> Path:
    run_dir = root / host / run_id
    run_dir.mkdir(parents=True)
    (run_dir / RUN_FILE).write_text(json.dumps(data))
    return run_dir


# ----------------------------------------------------------------------------------------------- record


def test_a_record_begins_with_the_stamp_and_round_trips(tmp_path):
    stamp = Provenance(host="desktop", gpu=Gpu(name="RTX 3050", vram_mib=8192),
                       llama_cpp=LlamaCppBuild(commit="abc123", build_key="cuda-86"),
                       artifacts=[Artifact(name="smollm2", sha256="0" * 64, sha256_from="manifest")],
                       servers=[Server(name="smollm2", host="desktop", unit="llama-server@smollm2.service",
                                       argv=ARGV, argv_from="/proc/42/cmdline", pid=42)],
                       task=Task(name="gsm8k", dataset_sha256={"d": "1" * 64}), seed=7, concurrency=2,
                       rigctl_version="0.1")
    record = RunRecord.begin("eval", stamp, host="desktop", extra={"limit": 3})
    assert record.id.startswith("eval-") and record.status == "running" and record.version == RECORD_VERSION
    assert record.server is not None and record.server.ctx_size == 4096 and record.server.flag("--parallel") == "2"
    record.seal(tmp_path / "desktop" / record.id)
    loaded = RunRecord.load(tmp_path / "desktop" / record.id)
    assert loaded == record
    assert loaded.server.argv == ARGV and loaded.task.dataset_sha256 == {"d": "1" * 64}


@pytest.mark.parametrize(("argv", "ctx"), [
    (["llama-server", "-c", "2048"], 2048),
    (["llama-server", "--ctx-size=1024"], 1024),
    (["llama-server", "-c", "512", "--ctx-size", "8192"], 8192),  # the last one wins, as in llama.cpp
    (["llama-server"], None),
])
def test_ctx_size_is_read_from_the_deployed_argv(argv, ctx):
    assert Server(argv=argv).ctx_size == ctx


def test_records_of_an_unknown_version_or_with_unknown_keys_are_refused():
    good = RunRecord(id="bench-x", kind="bench", host="h", started="2026-12-01T00:00:00Z").to_dict()
    with pytest.raises(ConfigError, match="record version 99 is not one this rigctl reads"):
        RunRecord.from_dict({**good, "version": 99}, "r.json")
    with pytest.raises(ConfigError, match="r.json: unknown keys: server"):
        RunRecord.from_dict({**good, "server": {"name": "x"}}, "r.json")  # a v1 key in a v2 record
    with pytest.raises(ConfigError, match=r"r.json: servers.0.argv"):
        RunRecord.from_dict({**good, "servers": [{"argv": "not a list"}]}, "r.json")


# ----------------------------------------------------------------------------------------------- version 1

V1_BASE = {"ended": "2026-11-30T05:10:00Z", "status": "done", "commands": [], "rigctl_version": "0.1",
           "files": [], "matrix": None, "seed": None, "concurrency": None}


def test_an_old_eval_run_directory_loads_with_its_server_and_task(tmp_path):
    """The version 1 eval shape: ``server`` a dict with the inventory's flags, gpu/llama_cpp/task dicts."""
    _write(tmp_path, "desktop", "eval-20261130T050000Z-0a1b", {
        **V1_BASE, "id": "eval-20261130T050000Z-0a1b", "kind": "eval", "host": "desktop",
        "started": "2026-11-30T05:00:00Z", "seed": 1234, "concurrency": 2,
        "gpu": {"name": "RTX 3050", "vram_mib": 8192, "compute_capability": "8.6"},
        "llama_cpp": {"name": "b4000-cuda", "commit": "abc123", "version": "b4000", "build_key": "k", "cuda": True},
        "server": {"endpoint": "http://10.0.0.2:8080", "label": "desktop/smollm2", "build_info": "b4000-abc123",
                   "model_path": "/m.gguf", "total_slots": 1, "n_ctx": 4096, "name": "smollm2", "host": "desktop",
                   "profile": "chat", "flags": {"ctx_size": 4096, "parallel": 1}, "port": 8080, "artifact": "smollm2"},
        "artifacts": [{"name": "smollm2", "path": "/m.gguf", "sha256": "0" * 64, "manifest": {"sha256": "0" * 64}}],
        "task": {"name": "gsm8k", "scorer": "gsm8k", "file": "/t.yaml", "file_sha256": "a" * 64,
                 "dataset_sha256": {"/d.jsonl": "d" * 64}, "questions": 10},
        "extra": {"thinking": False, "limit": 10, "summary": {"overall": {"n": 10}}}})
    run = next(ResultsStore(tmp_path).runs())
    record = run.record
    assert record.version == RECORD_VERSION and record.gpu.vram_mib == 8192 and record.llama_cpp.label == "abc123"
    server = record.server
    assert server is not None and len(record.servers) == 1
    assert (server.name, server.endpoint, server.build_info, server.n_ctx) == (
        "smollm2", "http://10.0.0.2:8080", "b4000-abc123", 4096)
    assert server.argv == [] and server.argv_from is None  # version 1 never read what was deployed
    assert record.task == Task(name="gsm8k", scorer="gsm8k", file="/t.yaml", file_sha256="a" * 64,
                               dataset_sha256={"/d.jsonl": "d" * 64}, questions=10)
    assert record.extra["v1"] == {"server.0": {"flags": {"ctx_size": 4096, "parallel": 1}}}
    assert record.extra["summary"] == {"overall": {"n": 10}}


def test_old_spec_load_and_fanout_shapes_become_one_list_of_servers():
    spec = upgrade({**V1_BASE, "id": "spec-1", "kind": "spec", "host": "desktop", "started": "x", "extra": {},
                    "server": {"baseline": "smollm2", "contenders": [
                        {"name": "smollm2", "artifact": "a", "profile": "chat", "spec": None, "port": 8080,
                         "endpoint": "http://h:8080", "build_info": "b1", "model_path": "/m"},
                        {"name": "smollm2-draft", "artifact": "a", "profile": "draft", "spec": {"n_max": 8},
                         "port": 8081, "endpoint": "http://h:8081", "build_info": "b1", "model_path": "/m"}]},
                    "artifacts": [{"name": "a", "instance": "smollm2"}]})
    record = RunRecord.from_dict(spec)
    assert [s.name for s in record.servers] == ["smollm2", "smollm2-draft"] and record.extra["baseline"] == "smollm2"
    assert record.servers[1].draft == {"n_max": 8} and record.extra["v1"] == {"artifacts.0": {"instance": "smollm2"}}

    load = RunRecord.from_dict({**V1_BASE, "id": "load-1", "kind": "load", "host": "desktop", "started": "x",
                                "extra": {"levels": [1, 2]},
                                "server": {"name": "smollm2", "profile": "chat", "probe_port": 8280, "slots": 2,
                                           "slot_ctx": 256, "args": ["--parallel", "2", "-c", "512"],
                                           "build_info": "b1", "model_path": "/m", "n_ctx": 256}})
    assert load.server.argv == ["--parallel", "2", "-c", "512"] and load.server.ctx_size == 512
    assert load.server.port == 8280 and (load.extra["slots"], load.extra["slot_ctx"]) == (2, 256)

    fanout = RunRecord.from_dict({**V1_BASE, "id": "eval-1", "kind": "eval", "host": "desktop", "started": "x",
                                  "extra": {}, "server": {"name": "smollm2", "host": "desktop", "fanout": [
                                      {"name": "smollm2", "host": "desktop", "endpoint": "http://d:8080",
                                       "gpu": {"name": "RTX 3050"}},
                                      {"name": "smollm2", "host": "laptop", "endpoint": "http://l:8080",
                                       "gpu": {"name": "RTX 4060 Laptop"}}]}})
    assert [(s.host, s.gpu.name) for s in fanout.servers] == [("desktop", "RTX 3050"), ("laptop", "RTX 4060 Laptop")]

    url = RunRecord.from_dict({**V1_BASE, "id": "eval-2", "kind": "eval", "host": "url", "started": "x",
                               "extra": {}, "server": {"url": "http://127.0.0.1:9000"}})
    assert url.server.endpoint == "http://127.0.0.1:9000" and url.server.name is None


def test_an_old_bench_run_written_on_a_host_loads(tmp_path):
    """What the version 1 job runtime wrote: ``server`` null, gpu and llama_cpp from the host."""
    _write(tmp_path, "desktop", "bench-20261130T040000Z-0a1b", {
        **V1_BASE, "id": "bench-20261130T040000Z-0a1b", "kind": "bench", "host": "desktop", "started": "x",
        "server": None, "gpu": {"name": "g", "driver": "550", "vram_mib": 8192, "compute_capability": "8.6",
                                "bandwidth_gbs": 224.0},
        "llama_cpp": {"name": "n", "dir": "/opt/llama.cpp/n", "commit": "abc", "version": "b1", "build_key": "k",
                      "build_number": 1, "cuda": True, "binaries": {"llama-bench": "0" * 64}},
        "artifacts": [{"name": "m", "path": "/m.gguf", "sha256": "0" * 64, "sha256_from": "hashed now", "bytes": 1,
                       "manifest": None, "gguf": {"architecture": "llama"}}],
        "matrix": {"p": [512], "rounds": 1}, "extra": {"servers_stopped": [], "host_facts": {"cpus": 4}}})
    record = RunRecord.load(tmp_path / "desktop" / "bench-20261130T040000Z-0a1b")
    assert record.servers == [] and record.gpu.bandwidth_gbs == 224.0 and record.artifacts[0].gguf == {
        "architecture": "llama"}
    assert "v1" not in record.extra


def test_the_job_runtime_builds_the_one_record_and_the_controller_reads_it(tmp_path):
    """The host builds the record with the very classes the controller reads (stdlib only): a job's first
    fields (its stamp as the inventory knows it) become typed, and what it saves loads as a version-2 record."""
    (tmp_path / "spec.json").write_text(json.dumps({
        "id": "eval-20261201T000000Z-0000", "kind": "eval", "host": "desktop", "unit": "rigctl-x", "task": "t",
        "params": {}, "results_dir": str(tmp_path / "results"), "job_dir": str(tmp_path), "rigctl_version": "9",
        "record": {"servers": [{"name": "smollm2", "host": "desktop", "port": 8080}], "seed": 3,
                   "gpu": {"name": "RTX 3050", "bandwidth_gbs": 224.0}, "task": {"name": "gsm8k"}}}))
    job = jobrun.Job(tmp_path)
    assert isinstance(job.record.servers[0], Server) and job.record.task == Task(name="gsm8k")
    assert job.record.gpu.bandwidth_gbs == 224.0 and job.record.rigctl_version == "9"
    job.record.extra["summary"] = {"n": 1}
    job.save_record()
    loaded = RunRecord.load(job.run_dir)
    assert loaded.version == RECORD_VERSION and loaded.to_dict() == job.record.to_dict()
    job.seal("failed", "the server went away")
    sealed = RunRecord.load(job.run_dir)
    assert (sealed.status, sealed.extra["error"]) == ("failed", "the server went away") and sealed.ended


# ----------------------------------------------------------------------------------------------- host side


def test_the_host_reads_a_running_processs_argv_from_proc_with_secrets_masked():
    argv = [sys.executable, "-c", "import time; time.sleep(30)", "--api-key", "sk-secret", "--hf-token=hf_x", "-c",
            "4096"]
    child = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 10
        while True:  # until the interpreter has its final argv
            read = host_stamp.parse_cmdline(Path(f"/proc/{child.pid}/cmdline").read_bytes())
            if read == argv or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    assert read == argv
    assert mask_argv(read)[3:7] == ["--api-key", "***", "--hf-token=***", "-c"]
    assert mask_argv(["--api-key-file", "/etc/k"]) == ["--api-key-file", "/etc/k"]


def test_a_unit_that_is_not_running_has_no_argv():
    found = host_stamp.deployed("rigctl-test-no-such-unit-7f3a.service")
    assert found["argv"] == [] and found["pid"] == 0 and found["error"]


class _LocalSsh:
    """An SSH client whose host is this machine: the shipped command runs here, in a shell; ``answer``
    replaces what the host prints (a hostile host)."""

    host = "local"

    def __init__(self, answer: str | None = None):
        self.answer = answer

    def run(self, command: str, *, timeout: float, check: bool = False):
        from types import SimpleNamespace

        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout, check=False)
        assert done.returncode == 0, done.stderr
        return SimpleNamespace(stdout=self.answer if self.answer is not None else done.stdout, rc=0, ok=True)


def test_the_controllers_stamp_is_the_hosts_builder_shipped(tmp_path, caplog):
    """One builder: the controller ships rigctl.hostside.stamp and takes what the host read (the manifest's
    sha256 here); what the host cannot read (no systemd unit, no nvidia-smi) is noted and the inventory's word
    stays."""
    from rigctl.results.stamp import complete_on_host

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    (tmp_path / "m.gguf.manifest.json").write_text(json.dumps({"sha256": "ab" * 32, "bytes": 4, "artifact": "m"}))
    partial = Provenance(host="desktop", gpu=Gpu(name="RTX 3050", bandwidth_gbs=224.0), seed=5,
                         servers=[Server(name="smollm2", host="desktop", port=8080)],
                         artifacts=[Artifact(name="m", path=str(model)), Artifact(name="gone", path="/nonexistent")])
    stamp = complete_on_host(_LocalSsh(), partial)
    assert stamp.artifacts[0].sha256 == "ab" * 32 and stamp.artifacts[0].sha256_from == "manifest"
    assert stamp.artifacts[0].manifest == {"sha256": "ab" * 32, "bytes": 4, "artifact": "m"}
    assert stamp.artifacts[1].sha256 is None and "no manifest beside /nonexistent" in caplog.text
    assert stamp.gpu == Gpu(name="RTX 3050", bandwidth_gbs=224.0) and stamp.seed == 5  # no nvidia-smi here
    server = stamp.servers[0]
    assert (server.name, server.unit, server.port, server.argv) == ("smollm2", "llama-server@smollm2.service", 8080,
                                                                   [])
    assert "no deployed argv for llama-server@smollm2.service" in caplog.text


def test_a_hosts_stamp_sets_only_what_the_host_was_asked_to_read():
    from rigctl.results.stamp import complete_on_host

    partial = Provenance(host="desktop", servers=[Server(name="smollm2", host="desktop", unit="u")],
                         artifacts=[Artifact(name="m", path="/m.gguf")])
    hostile = {"host": "elsewhere", "seed": 99, "servers": [
        {"name": "other", "unit": "x", "argv": ["llama-server", "--api-key", "k3y-secret"], "pid": 7,
         "argv_from": "/proc/7/cmdline"}, {"name": "extra"}],
        "artifacts": [{"name": "n", "path": "/etc/shadow", "sha256": "cd" * 32}]}
    stamp = complete_on_host(_LocalSsh(json.dumps({"stamp": hostile, "notes": []})), partial)
    assert stamp.host == "desktop" and stamp.seed is None and len(stamp.servers) == 1
    assert (stamp.servers[0].name, stamp.servers[0].unit, stamp.servers[0].pid) == ("smollm2", "u", 7)
    assert stamp.servers[0].argv == ["llama-server", "--api-key", "***"]  # redacted here too
    assert (stamp.artifacts[0].name, stamp.artifacts[0].path, stamp.artifacts[0].sha256) == ("m", "/m.gguf", "cd" * 32)
    with pytest.raises(ConfigError, match=r"local: its provenance stamp: servers.0.pid"):
        complete_on_host(_LocalSsh(json.dumps({"stamp": {"host": "h", "servers": [{"pid": "seven"}]}})), partial)
    with pytest.raises(RigctlError, match="not an object with a stamp"):
        complete_on_host(_LocalSsh("[]"), partial)


# ----------------------------------------------------------------------------------------------- store


@pytest.mark.parametrize(("host", "run_id"), [("..", "eval-1"), ("desktop", "../../etc"), ("a/b", "x"),
                                              ("desktop", ""), ("desktop", "a\\b")])
def test_the_store_places_no_run_outside_its_root(tmp_path, host, run_id):
    with pytest.raises(TrustError, match="not a plain name"):
        ResultsStore(tmp_path).run_dir(host, run_id)


def test_the_loader_skips_what_it_cannot_read_and_keeps_the_rest(tmp_path, caplog):
    good = RunRecord(id="eval-20261130T050000Z-0a1b", kind="eval", host="desktop", started="x")
    good.save(tmp_path / "desktop" / good.id)
    _write(tmp_path, "desktop", "eval-20261130T060000Z-0a1b", {"id": "x", "kind": "eval", "version": 7})
    runs = list(ResultsStore(tmp_path).runs())
    assert [r.id for r in runs] == [good.id]
    assert "record version 7" in caplog.text


def test_find_reads_the_run_its_name_says_and_no_other(tmp_path, caplog):
    wanted = RunRecord(id="eval-20261130T050000Z-0a1b", kind="eval", host="laptop", started="x")
    wanted.save(tmp_path / "laptop" / wanted.id)
    # Another run whose record cannot be read: finding the wanted one by name never opens it.
    _write(tmp_path, "desktop", "eval-20261130T060000Z-0a1b", {"id": "x", "kind": "eval", "version": 7})
    store = ResultsStore(tmp_path)
    for ref in (wanted.id, f"laptop/{wanted.id}", str(tmp_path / "laptop" / wanted.id)):
        found = store.find(ref)
        assert (found.host, found.id, found.path) == ("laptop", wanted.id, tmp_path / "laptop" / wanted.id)
    assert "record version 7" not in caplog.text
    # A directory not named by its record's id (renamed by hand) is still found, by the scan.
    moved = RunRecord(id="eval-20261130T070000Z-0c0d", kind="eval", host="laptop", started="x")
    moved.save(tmp_path / "laptop" / "renamed")
    assert store.find(moved.id).path == tmp_path / "laptop" / "renamed"
    # The same id on two hosts is ambiguous; an unknown one is not found; neither leaves the root.
    wanted.save(tmp_path / "desktop" / wanted.id)
    with pytest.raises(ConfigError, match=f"run '{wanted.id}' is ambiguous: desktop/{wanted.id}, laptop/"):
        store.find(wanted.id)
    for ref in ("eval-20261130T080000Z-ffff", "../laptop/" + wanted.id, "laptop/.."):
        with pytest.raises(ConfigError, match="not found under"):
            store.find(ref)


def test_the_last_runs_are_read_from_the_end(tmp_path, caplog):
    store = ResultsStore(tmp_path)
    for host, kinds in (("desktop", ["eval", "bench", "eval", "load"]), ("laptop", ["bench", "eval", "eval"])):
        for n, kind in enumerate(kinds):
            run_id = f"{kind}-20261130T0{n}0000Z-0a1b"
            RunRecord(id=run_id, kind=kind, host=host, started=str(n)).save(tmp_path / host / run_id)
    # The oldest of the desktop's runs cannot be read: the last runs never open it.
    _write(tmp_path, "desktop", "bench-20261129T000000Z-0000", {"id": "x", "kind": "bench", "version": 7})
    for host in (None, "desktop", "laptop"):
        for kind in (None, "eval", "bench", "load", "kld"):
            for limit in (1, 2, 3, 10):
                expected = [(r.host, r.id) for r in list(store.runs(host, kind))[-limit:]]
                caplog.clear()
                assert [(r.host, r.id) for r in store.last(limit, host, kind)] == expected
                if len(expected) == limit:  # found before reaching the oldest
                    assert "record version 7" not in caplog.text
    with pytest.raises(ValueError, match="at least 1"):
        store.last(0)


def test_long_digit_runs_take_the_checked_parse(tmp_path):
    from rigctl.results.record import parse_json

    # Nineteen digits in a string or a fraction: read as they are; in an integer past 64 bits: refused.
    assert parse_json('{"sha": "x1234567890123456789012345", "f": 0.12345678901234567890, "n": 18446744073709551615}',
                      "x") == {"sha": "x1234567890123456789012345", "f": 0.12345678901234567890,
                               "n": 18446744073709551615}
    for text in ('{"n": 18446744073709551616}', '{"n": -9223372036854775809}', '[123456789012345678901234]'):
        with pytest.raises(ConfigError, match="^x: an integer of"):
            parse_json(text, "x")
    assert parse_json('{"n": -9223372036854775808, "m": 999999999999999999}', "x")["m"] == 999999999999999999


def test_the_store_lists_no_linked_directory_and_reads_no_linked_record(tmp_path):
    """A link in the store (a host or run directory, or run.json itself) leads out of it: not listed, not read;
    the record is checked on the open file, never through a link."""
    from rigctl.hostside.runrecord import RunRecord as HostRecord

    store = ResultsStore(tmp_path / "results")
    mine = "eval-20261203T100000Z-0001"
    HostRecord(id=mine, kind="eval", host="desktop", started="2026-12-03T10:00:00.0Z", status="done").save(
        store.root / "desktop" / mine)
    elsewhere = tmp_path / "elsewhere"
    theirs = "eval-20261203T100000Z-0002"
    HostRecord(id=theirs, kind="eval", host="laptop", started="2026-12-03T10:00:00.0Z", status="done").save(
        elsewhere / theirs)
    (store.root / "laptop").symlink_to(elsewhere)
    (store.root / "desktop" / theirs).symlink_to(elsewhere / theirs)
    assert [r.id for r in store.runs()] == [mine] and [r.id for r in store.last(5)] == [mine]
    with pytest.raises(ConfigError, match="not found"):
        store.find(theirs)
    linked = store.root / "desktop" / "eval-20261203T100000Z-0003"
    linked.mkdir()
    (linked / "run.json").symlink_to(elsewhere / theirs / "run.json")
    with pytest.raises(ConfigError, match="cannot read"):
        RunRecord.load(linked)
    fifo = store.root / "desktop" / "eval-20261203T100000Z-0004"
    fifo.mkdir()
    os.mkfifo(fifo / "run.json")
    with pytest.raises(ConfigError, match="not a regular file"):
        RunRecord.load(fifo)


def _stored_eval_run(store: ResultsStore, run_id: str, answers: bytes):
    """An eval run in ``store`` whose record lists ``answers.jsonl`` with its sha256, as listed by the store."""
    import hashlib

    from rigctl.hostside.runrecord import RunRecord as HostRecord

    run_dir = store.root / "desktop" / run_id
    HostRecord(id=run_id, kind="eval", host="desktop", started="2026-12-03T10:00:00.0Z",
               status="done").save(run_dir)
    (run_dir / "answers.jsonl").write_bytes(answers)
    data = json.loads((run_dir / RUN_FILE).read_text())
    data["files"] = [{"path": "answers.jsonl", "sha256": hashlib.sha256(answers).hexdigest(), "bytes": len(answers)}]
    (run_dir / RUN_FILE).write_text(json.dumps(data))
    [run] = [r for r in store.runs() if r.id == run_id]
    return run


def test_a_run_directory_swapped_for_a_link_after_listing_is_not_read_through(tmp_path):
    """The store reads raw files from its own directory fds: a run directory replaced by a link out of the
    store after it was listed is refused, not followed (a path check, then a read, would read the other tree)."""
    from rigctl.results.store import read_rows

    store = ResultsStore(tmp_path / "results")
    answers = b'{"id": "1", "set": "a", "score": 1}\n'
    run = _stored_eval_run(store, "eval-20261203T100000Z-0001", answers)
    assert store.verify(run) == []
    elsewhere = tmp_path / "elsewhere"
    run.path.rename(elsewhere)
    run.path.symlink_to(elsewhere)
    problems = store.verify(run)
    assert len(problems) == 1 and "link" in problems[0], problems
    with pytest.raises(ConfigError):
        read_rows(run, "eval", "answers.jsonl", dict)


def test_a_raw_file_replaced_by_a_link_is_refused(tmp_path):
    """A raw file that became a link (to a file outside the store with the right hash, or to a device) is
    not read: O_NOFOLLOW on the run directory's fd, a regular file checked on the open file."""
    from rigctl.results.store import read_rows

    store = ResultsStore(tmp_path / "results")
    answers = b'{"id": "1", "set": "a", "score": 1}\n'
    run = _stored_eval_run(store, "eval-20261203T100000Z-0001", answers)
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(answers)
    (run.path / "answers.jsonl").unlink()
    (run.path / "answers.jsonl").symlink_to(outside)
    problems = store.verify(run)
    assert len(problems) == 1 and "link" in problems[0], problems
    with pytest.raises(ConfigError, match="no answers.jsonl"):
        read_rows(run, "eval", "answers.jsonl", dict)
    (run.path / "answers.jsonl").unlink()
    (run.path / "answers.jsonl").symlink_to("/dev/zero")
    assert "link" in store.verify(run)[0]


def test_a_run_reached_through_a_linked_host_directory_after_listing_is_refused(tmp_path):
    """The host directory, too, is opened O_DIRECTORY|O_NOFOLLOW from the store's fd when a raw file is read."""
    from rigctl.evals.remote import ANSWERS_FILE
    from rigctl.results.store import read_run_jsonl

    store = ResultsStore(tmp_path / "results")
    answers = b'{"id": "1", "set": "a", "score": 1}\n'
    run = _stored_eval_run(store, "eval-20261203T100000Z-0001", answers)
    assert read_run_jsonl(run, ANSWERS_FILE) == [{"id": "1", "set": "a", "score": 1}]
    (store.root / "desktop").rename(tmp_path / "moved")
    (store.root / "desktop").symlink_to(tmp_path / "moved")
    with pytest.raises(ConfigError, match="link"):
        read_run_jsonl(run, ANSWERS_FILE)
    assert list(store.runs()) == []
