"""Dataset fetching against a local server in the Hugging Face URL layout: sha256, cache, lock file,
offline use; and the fixture task files loaded through it. Loopback only."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from hf_server import HfRepo, HfServer

from rigctl.errors import EvalError
from rigctl.evals import datasets
from rigctl.evals.tasks import load_task

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "evals"
REPO = "rigctl/eval-fixtures"
REVISION = "5f3c9a1e0b2d4c6e8f7a9b1c3d5e7f9a0b2c4d6e"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("RIGCTL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RIGCTL_DATASET_LOCK", raising=False)
    monkeypatch.delenv("RIGCTL_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path


@pytest.fixture
def hub(env, monkeypatch):
    root = env / "repo"
    shutil.copytree(FIXTURES / "hf", root)
    repo = HfRepo(f"datasets/{REPO}", REVISION, root)
    with HfServer(repo) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


def test_hf_url_layout(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/")
    assert datasets.hf_url("openai/gsm8k", "abc", "main/test file.jsonl") == \
        "http://127.0.0.1:9/datasets/openai/gsm8k/resolve/abc/main/test%20file.jsonl"


def test_first_download_records_hash_and_later_uses_come_from_cache(hub, env):
    file = datasets.fetch_hf(REPO, REVISION, "gsm8k.jsonl")
    expected = sha(FIXTURES / "hf" / "gsm8k.jsonl")
    assert file.sha256 == expected and sha(file.path) == expected
    assert file.path.is_relative_to(env / "cache" / "datasets")
    assert f"/datasets/{REPO}/resolve/{REVISION}/gsm8k.jsonl" in hub.requests
    lock = json.loads((env / "cache" / "datasets" / "lock.json").read_text())
    assert lock == {f"hf:{REPO}@{REVISION}/gsm8k.jsonl": expected}
    requests = len(hub.requests)
    again = datasets.fetch_hf(REPO, REVISION, "gsm8k.jsonl")
    assert again.path == file.path and len(hub.requests) == requests
    assert not list(file.path.parent.glob(".*.part"))


def test_later_download_must_match_the_lock(hub, env):
    first = datasets.fetch_hf(REPO, REVISION, "boolq.jsonl")
    first.path.unlink()
    hub.repo.truncate.add("boolq.jsonl")
    with pytest.raises(EvalError, match=r"does not match .* from the lock file"):
        datasets.fetch_hf(REPO, REVISION, "boolq.jsonl")
    assert not first.path.exists()
    assert not list(first.path.parent.glob(".*.part"))


def test_pinned_sha256_mismatch_leaves_nothing(hub):
    with pytest.raises(EvalError, match=r"hf:rigctl/eval-fixtures@.*/nli.jsonl: downloaded sha256 .* task file"):
        datasets.fetch_hf(REPO, REVISION, "nli.jsonl", sha256="0" * 64)
    assert not list((datasets.cache_root() / "hf").rglob("nli.jsonl"))


def test_pin_and_lock_disagree(hub):
    datasets.fetch_hf(REPO, REVISION, "toxic.jsonl")
    with pytest.raises(EvalError, match="the task pins sha256 1111.* but the lock file"):
        datasets.fetch_hf(REPO, REVISION, "toxic.jsonl", sha256="1" * 64)


def test_tampered_cache_is_fetched_again_online_and_refused_offline(hub, monkeypatch):
    file = datasets.fetch_hf(REPO, REVISION, "gsm8k.jsonl")
    file.path.write_text("tampered\n")
    monkeypatch.setenv("RIGCTL_OFFLINE", "1")
    with pytest.raises(EvalError, match="offline: not re-fetched"):
        datasets.fetch_hf(REPO, REVISION, "gsm8k.jsonl")
    monkeypatch.delenv("RIGCTL_OFFLINE")
    fixed = datasets.fetch_hf(REPO, REVISION, "gsm8k.jsonl")
    assert sha(fixed.path) == sha(FIXTURES / "hf" / "gsm8k.jsonl")


def test_offline_uses_the_cache_and_nothing_else(hub, monkeypatch):
    datasets.fetch_hf(REPO, REVISION, "gsm8k.jsonl")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert datasets.fetch_hf(REPO, REVISION, "gsm8k.jsonl").sha256 == sha(FIXTURES / "hf" / "gsm8k.jsonl")
    with pytest.raises(EvalError, match="not in the cache .* and offline"):
        datasets.fetch_hf(REPO, REVISION, "boolq.jsonl")


def test_missing_file_and_unreachable_server(hub, monkeypatch):
    with pytest.raises(EvalError, match="HTTP 404"):
        datasets.fetch_hf(REPO, REVISION, "nope.jsonl")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(EvalError, match="ConnectError"):
        datasets.fetch_hf(REPO, REVISION, "boolq.jsonl")


def test_url_source_with_sha256(hub):
    url = f"{hub.endpoint}/datasets/{REPO}/resolve/{REVISION}/toxic.jsonl"
    good = datasets.fetch_url(url, sha256=sha(FIXTURES / "hf" / "toxic.jsonl"))
    assert good.path.read_bytes() == (FIXTURES / "hf" / "toxic.jsonl").read_bytes()
    with pytest.raises(EvalError, match="only http and https"):
        datasets.fetch_url("ftp://127.0.0.1/x.jsonl")


def test_local_file_and_formats(env):
    lines = env / "rows.jsonl"
    lines.write_text('{"a": 1}\n\n{"a": 2}\n')
    array = env / "rows.json"
    array.write_text('[{"a": 1}, {"a": 2}]')
    assert datasets.read_records(lines) == datasets.read_records(array) == [{"a": 1}, {"a": 2}]
    assert datasets.local_file(lines).sha256 == sha(lines)
    with pytest.raises(EvalError, match="does not match the task's"):
        datasets.local_file(lines, sha256="2" * 64)
    bad = env / "bad.jsonl"
    bad.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(EvalError, match=r"bad.jsonl:2: not a JSON line"):
        datasets.read_records(bad)


def test_fixture_tasks_load_through_the_hub(hub):
    gsm8k = load_task(str(FIXTURES / "tasks" / "fixture-gsm8k.yaml"))
    assert len(gsm8k.questions) == 10 and gsm8k.questions[4].data["gold"] == "750"
    assert gsm8k.questions[5].data["gold"] == "-7" and gsm8k.questions[9].data["gold"] == "37.5"
    bfcl = load_task(str(FIXTURES / "tasks" / "fixture-bfcl.yaml"), limit=3)
    assert [q.id for q in bfcl.questions] == ["simple_0", "simple_1", "simple_2"]
    assert bfcl.questions[1].data["possible_answer"] == {"weather.get_current": {"city": ["Paris", "Paris, France"],
                                                                                 "unit": ["celsius", ""]}}
    assert len(bfcl.dataset_sha256) == 2
    suite = load_task(str(FIXTURES / "tasks" / "fixture-suite.yaml"))
    assert [len([q for q in suite.questions if q.set == s]) for s in ("boolq", "multinli", "civil_comments")] == \
        [8, 6, 6]
    assert suite.questions[0].data["gold"] == "yes" and suite.questions[0].data["labels"] == ["no", "yes"]


def test_task_with_unknown_prompt_field(env, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q", "answer": "#### 1"}\n')
    task = tmp_path / "t.yaml"
    task.write_text("name: t\nscorer: gsm8k\ndataset: {path: d.jsonl}\nprompt: '{problem}'\n")
    with pytest.raises(EvalError, match=r"d.jsonl:1: prompt names field 'problem'"):
        load_task(str(task))
    with pytest.raises(EvalError, match="no such task file or shipped task"):
        load_task("no-such-task")
