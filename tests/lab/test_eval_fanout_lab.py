"""Lab: one eval fanned out over both rigs' SmolLM2 servers (same artifact, same build), through the CLI as
users run it: each question answered exactly once with the server that answered it, a server stopped
midway and the run finished by ``--resume`` (from the record alone), a fan-out over different artifacts
refused before anything starts, and ``compare`` of the fan-out run against a one-server run of the same
artifact."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from benchlab import REPO, RIGCTL, cli_env, served_inventory
from hf_server import eval_fixtures_hub

from rigctl.results.record import RunRecord
from rigctl.results.store import ResultsStore, read_jsonl
from rigctl.ssh import SshClient, SshTarget

pytestmark = pytest.mark.lab

FIXTURES = REPO / "tests" / "fixtures" / "evals"
TASK = FIXTURES / "tasks" / "fixture-gsm8k.yaml"
IDS = sorted(f"fixture-gsm8k-{i}" for i in range(1, 11))
SERVERS = {"desktop/smollm2", "laptop/smollm2"}
FANOUT = ["--host", "desktop", "--server", "smollm2", "--host", "laptop", "--server", "smollm2"]


@pytest.fixture(scope="module")
def lab(request):
    return served_inventory(request)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    with eval_fixtures_hub(tmp_path_factory.mktemp("hub")) as hub:
        yield results, {**cli_env(results), "HF_ENDPOINT": hub.endpoint,
                        "RIGCTL_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}


def rigctl(env, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RIGCTL, *args], capture_output=True, text=True, timeout=timeout, env=env[1], cwd=REPO,
                          check=False)


def new_runs(env, before: set[Path]) -> list[Path]:
    return sorted(set(env[0].glob("*/eval-*")) - before)


def healthy(lab, host: str) -> bool:
    address = lab.host(host).address
    try:
        return httpx.get(f"http://{address}:8080/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_fan_out_answers_each_question_once_and_records_the_server(lab, env):
    before = set(env[0].glob("*/eval-*"))
    done = rigctl(env, "eval", "run", *FANOUT, "--task", str(TASK), "--concurrency", "1")
    assert done.returncode == 0, done.stderr
    (path,) = new_runs(env, before)
    assert path.parent.name == "desktop"  # the first server names the run's host
    rows = read_jsonl(path / "answers.jsonl")
    assert sorted(r["id"] for r in rows) == IDS
    servers = Counter(r["server"] for r in rows)
    assert set(servers) == SERVERS, servers  # both rigs took questions
    assert "answers per server:" in done.stdout
    record = RunRecord.load(path)
    assert record.status == "done" and record.extra["summary"]["overall"]["n"] == 10
    fanout = record.servers
    assert {f"{s.host}/{s.name}" for s in fanout} == SERVERS
    assert len({s.build_info for s in fanout}) == 1 and all(s.build_info for s in fanout)
    assert all(s.argv and s.argv_from and s.gpu and s.gpu.name for s in fanout)  # each rig's own, as deployed
    assert record.artifacts[0].sha256 and record.llama_cpp.build_key
    store = ResultsStore(env[0])
    assert store.verify(store.find(str(path))) == []


def test_fan_out_stopped_midway_resumes_from_the_record(lab, env):
    before = set(env[0].glob("*/eval-*"))
    running = subprocess.Popen([*RIGCTL, "eval", "run", *FANOUT, "--task", str(TASK), "--concurrency", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env[1], cwd=REPO)
    laptop = lab.host("laptop")
    with SshClient(SshTarget.from_host(laptop)) as ssh:
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                found = new_runs(env, before)
                answers = found[0] / "answers.jsonl" if found else None
                if answers and answers.is_file() and len(answers.read_text().splitlines()) >= 2:
                    break
                time.sleep(0.2)
            ssh.run("systemctl stop llama-server@smollm2.service", timeout=60, check=True)
            _, stderr = running.communicate(timeout=600)
        finally:
            ssh.run("systemctl start llama-server@smollm2.service", timeout=60, check=True)
    assert running.returncode != 0 and "--resume desktop/eval-" in stderr, stderr
    (path,) = new_runs(env, before)
    partial = read_jsonl(path / "answers.jsonl")
    assert RunRecord.load(path).status == "failed" and 2 <= len(partial) < 10
    deadline = time.monotonic() + 180
    while not healthy(lab, "laptop"):
        assert time.monotonic() < deadline, "laptop's llama-server did not come back"
        time.sleep(0.5)
    # No --host/--server: the servers come from the run record.
    resumed = rigctl(env, "eval", "run", "--resume", f"desktop/{path.name}")
    assert resumed.returncode == 0, resumed.stderr
    assert "desktop/smollm2, laptop/smollm2" in resumed.stdout
    rows = read_jsonl(path / "answers.jsonl")
    assert sorted(r["id"] for r in rows) == IDS
    assert rows[: len(partial)] == partial and {r["server"] for r in rows} <= SERVERS
    record = RunRecord.load(path)
    assert record.status == "done" and len(record.extra["resumed"]) == 1


def test_fan_out_over_different_artifacts_is_refused(lab, env):
    before = set(env[0].glob("*/eval-*"))
    refused = rigctl(env, "eval", "run", "--host", "desktop", "--server", "smollm2", "--host", "laptop",
                     "--server", "smollm2-q4_0", "--task", str(TASK))
    assert refused.returncode != 0
    assert refused.stderr.startswith("error: ") and "fan-out" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert new_runs(env, before) == []


def test_compare_fan_out_against_one_server(lab, env):
    from rigctl.analysis.compare import compare_runs

    store = ResultsStore(env[0])
    before = set(env[0].glob("*/eval-*"))
    single = rigctl(env, "eval", "run", "--host", "desktop", "--server", "smollm2", "--task", str(TASK))
    assert single.returncode == 0, single.stderr
    (single_path,) = new_runs(env, before)
    fanned = next(r for r in store.runs(kind="eval") if len(r.record.servers) > 1 and r.record.status == "done")
    done = rigctl(env, "compare", f"desktop/{single_path.name}", f"{fanned.host}/{fanned.id}", "--flips",
                  "--equivalence-margin", "50", "--plan")
    assert done.returncode == 0, done.stderr
    assert "b / c" in done.stdout and "flips," in done.stdout and "smallest gap detectable" in done.stdout
    pair = compare_runs([store.find(f"desktop/{single_path.name}"), fanned], margin=50).pairs[0]
    overall = pair.recorded.overall
    assert pair.forced is None and overall.n == 10 and overall.test.method == "mcnemar-exact"
    assert len(pair.flips) == overall.test.b + overall.test.c
    # The same questions on both sides. Greedy replies of one file and build mostly agree, but not always
    # to the byte: llama-server reuses cached prompt prefixes, which moves logits in the last bits.
    replies = {r["id"]: r["reply"] for r in read_jsonl(single_path / "answers.jsonl")}
    fanned_rows = read_jsonl(fanned.path / "answers.jsonl")
    assert sorted(replies) == sorted(r["id"] for r in fanned_rows)
    same = sum(replies[r["id"]] == r["reply"] for r in fanned_rows)
    print(json.dumps({"identical_replies": same, "of": len(fanned_rows)}))
    assert same >= len(fanned_rows) // 2, same
