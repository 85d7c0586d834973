"""Evals against the lab's real llama-server (SmolLM2 on the desktop rig, instance ``smollm2``), through the
CLI as users run it: the fixture tasks (questions we wrote, served in the Hugging Face layout from
loopback), scores recomputed here from the raw replies, label tokens checked against the server's
``/tokenize``, and a run whose server is stopped midway finished by ``--resume`` with every question
answered once. ``--remote`` runs the same task as a job on the rig and pulls it home."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from benchlab import REPO, RIGCTL, assert_deployed, cli_env, served_inventory
from hf_server import eval_fixtures_hub

from rigctl.forward import server_endpoint
from rigctl.hostside import bfcl
from rigctl.results.record import RunRecord
from rigctl.results.store import ResultsStore, read_jsonl
from rigctl.ssh import SshClient, SshTarget

pytestmark = pytest.mark.lab

FIXTURES = REPO / "tests" / "fixtures" / "evals"
TASKS = FIXTURES / "tasks"
HOST, SERVER = "desktop", "smollm2"
UNIT = f"llama-server@{SERVER}.service"


@pytest.fixture(scope="module")
def lab(request):
    return served_inventory(request)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with eval_fixtures_hub(tmp_path_factory.mktemp("hub")) as server:
        yield server


@pytest.fixture(scope="module")
def env(hub, tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    return results, {**cli_env(results), "HF_ENDPOINT": hub.endpoint,
                     "RIGCTL_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}


def rigctl(env, *args: str, timeout: float = 800) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RIGCTL, *args], capture_output=True, text=True, timeout=timeout, env=env[1], cwd=REPO,
                          check=False)


def run_dir(env, before: set[Path] = frozenset()) -> Path:
    runs = {p for p in (env[0] / HOST).glob("eval-*") if p.is_dir()} - set(before)
    assert len(runs) == 1, runs
    return runs.pop()


def base_url(lab) -> str:
    host = lab.host(HOST)
    port = next(s.port for s in host.servers if s.name == SERVER)
    return f"http://{host.address}:{port}"


def auth(lab) -> dict[str, str]:
    """The lab servers' bearer header (the lab inventory carries a key)."""
    return server_endpoint(lab.host(HOST), lab.host(HOST).server(SERVER)).headers()


def check_record(path: Path, task_file: Path, lab) -> RunRecord:
    record = RunRecord.load(path)
    props = httpx.get(f"{base_url(lab)}/props", headers=auth(lab), timeout=30).json()
    assert (record.kind, record.status, record.concurrency, record.seed) == ("eval", "done", 8, 1234)
    assert record.server.build_info == props["build_info"] and record.server.model_path == props["model_path"]
    assert_deployed(record.server, lab, HOST, SERVER)
    assert record.server.flag("--parallel", "-np") == "1" and record.server.n_ctx
    assert record.task.file_sha256 == hashlib.sha256(task_file.read_bytes()).hexdigest()
    for key, digest in record.task.dataset_sha256.items():
        local = FIXTURES / "hf" / key.split("@", 1)[1].split("/", 1)[1]
        assert digest == hashlib.sha256(local.read_bytes()).hexdigest(), key
    assert record.artifacts and re.fullmatch(r"[0-9a-f]{64}", record.artifacts[0].sha256 or "")
    assert record.llama_cpp.commit and record.gpu.name
    store = ResultsStore(path.parent.parent)
    assert store.verify(store.find(str(path))) == []
    return record


@pytest.mark.parametrize(("name", "n"), [("fixture-gsm8k", 6), ("fixture-bfcl", 8)])
def test_scores_follow_from_the_raw_replies(lab, env, name, n):
    before = set((env[0] / HOST).glob("eval-*"))
    done = rigctl(env, "eval", "run", "--host", HOST, "--server", SERVER, "--task", str(TASKS / f"{name}.yaml"),
                  "--limit", str(n))
    assert done.returncode == 0, done.stderr
    assert "score" in done.stdout and "cut-offs" in done.stdout
    path = run_dir(env, before)
    record = check_record(path, TASKS / f"{name}.yaml", lab)
    rows = read_jsonl(path / "answers.jsonl")
    assert len(rows) == n and len({r["id"] for r in rows}) == n
    for row in rows:
        assert row["cutoff"] == (row["finish_reason"] == "length")
        if name == "fixture-gsm8k":
            # An independent reading of "the last number": commas between digits group them, and a minus is
            # a sign only where no letter or digit stands before it.
            numbers = re.findall(r"(?:(?<!\w)-)?\d+(?:,\d+)*(?:\.\d+)?", row["reply"].replace("$", ""))
            last = numbers[-1].replace(",", "") if numbers else None
            expected = last is not None and float(last) == float(row["gold"])
            assert row["score"] == int(expected), row
            assert row["lmeval_strict_match"] in (0, 1) and row["lmeval_flexible_extract"] in (0, 1), row
        else:
            calls = [(c["name"], c["arguments"]) for c in row["tool_calls"]]
            question = next(json.loads(line) for line in (FIXTURES / "hf" / "bfcl_simple.json").open()
                            if json.loads(line)["id"] == row["id"])
            truth = next(json.loads(line) for line in (FIXTURES / "hf" / "possible_answer" / "bfcl_simple.json")
                         .open() if json.loads(line)["id"] == row["id"])["ground_truth"][0]
            assert row["score"] == int(bfcl.check_simple_call(question["function"][0], calls, truth).valid)
            assert row["toolless"] == (not calls)
            assert row["missed_call"] == (not calls and bfcl.looks_like_missed_call(row["reply"]))
            if not calls:
                assert row["score"] == 0
    if name == "fixture-bfcl":
        # SmolLM2's template carries no tools, which the task allows; its token limit is a stated deviation.
        assert record.extra["template_carries_tools"] == [False]
        assert record.extra["deviations"]["settings"] == ["max_tokens 24 (BFCL: no limit)"]
    overall = record.extra["summary"]["overall"]
    assert overall["n"] == n
    assert overall["score"] == pytest.approx(sum(r["score"] for r in rows) / n)
    assert overall["cutoffs"] == sum(r["cutoff"] for r in rows)


def test_lmevals_own_request_is_served_and_scored_as_lmeval(lab, env):
    """``request: lm-eval``: five examples as chat turns, lm-eval's stop sequences and 256 tokens reach the real
    llama-server, whose replies stop where lm-eval's would; the record names the request and the release."""
    task = TASKS / "fixture-gsm8k-lmeval.yaml"
    before = set((env[0] / HOST).glob("eval-*"))
    done = rigctl(env, "eval", "run", "--host", HOST, "--server", SERVER, "--task", str(task), "--limit", "3")
    assert done.returncode == 0, done.stderr
    path = run_dir(env, before)
    record = check_record(path, task, lab)
    assert record.task.request["reproduces"] == "lm-eval 0.4.13 gsm8k" and record.task.request["num_fewshot"] == 5
    assert record.task.instruments == {"lm-eval": "0.4.13"} and len(record.task.dataset_sha256) == 2
    rows = read_jsonl(path / "answers.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert row["finish_reason"] in ("stop", "length") and (row["tokens"] or 0) <= 256, row
        # The server stopped at lm-eval's stop sequences: none is left in a reply.
        assert not any(stop in row["reply"] for stop in ("Question:", "</s>", "<|im_end|>")), row["reply"]
        assert row["lmeval_strict_match"] in (0, 1) and row["lmeval_flexible_extract"] in (0, 1), row


def test_bfcl_on_a_template_without_tools_is_refused_in_one_line(lab, env, tmp_path):
    """SmolLM2's template renders no tools: its /props says so, and a BFCL task that does not allow that is
    refused before a run begins, in one line naming how the server told."""
    props = httpx.get(f"{base_url(lab)}/props", headers=auth(lab), timeout=30).json()
    assert props["chat_template_caps"]["supports_tools"] is False
    task = tmp_path / "bfcl-strict.yaml"
    task.write_text((TASKS / "fixture-bfcl.yaml").read_text().replace("allow_template_without_tools: true", ""))
    before = set((env[0] / HOST).glob("eval-*"))
    done = rigctl(env, "eval", "run", "--host", HOST, "--server", SERVER, "--task", str(task), timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    assert "refusing fixture-bfcl: the model's chat template cannot carry tools (/props " \
           "chat_template_caps.supports_tools is false)" in errors[0]
    assert set((env[0] / HOST).glob("eval-*")) == before


def test_choice_labels_come_from_the_servers_tokenizer(lab, env):
    before = set((env[0] / HOST).glob("eval-*"))
    done = rigctl(env, "eval", "run", "--host", HOST, "--server", SERVER, "--task", str(TASKS / "fixture-suite.yaml"))
    assert done.returncode == 0, done.stderr
    path = run_dir(env, before)
    record = check_record(path, TASKS / "fixture-suite.yaml", lab)
    url = base_url(lab)
    for label, token in record.extra["label_tokens"].items():
        pieces = httpx.post(f"{url}/tokenize", json={"content": label, "with_pieces": True}, headers=auth(lab),
                            timeout=30).json()
        assert token["id"] == pieces["tokens"][0]["id"] and token["piece"] == pieces["tokens"][0]["piece"]
    rows = read_jsonl(path / "answers.jsonl")
    assert Counter(r["set"] for r in rows) == {"boolq": 8, "multinli": 6, "civil_comments": 6}
    for row in rows:
        seen = {k: v for k, v in row["label_probs"].items() if v is not None}
        assert row["pred"] == (max(seen, key=seen.get) if seen else None)
        assert row["score"] == int(row["pred"] == row["gold"])
        assert all(0.0 < p <= 1.0 for p in seen.values())
    # One question asked again by hand: the recorded distribution is the server's.
    first = rows[0]
    data = httpx.post(f"{url}/apply-template", json={"messages": [{"role": "user", "content": _prompt(first)}],
                                                      "chat_template_kwargs": {"enable_thinking": False}},
                      headers=auth(lab), timeout=60).json()
    again = httpx.post(f"{url}/completion", json={"prompt": data["prompt"], "n_predict": 1, "n_probs": 50,
                                                   "temperature": 0}, headers=auth(lab), timeout=120).json()
    top = {e["id"]: e["logprob"] for e in again["completion_probabilities"][0]["top_logprobs"]}
    for label, p in first["label_probs"].items():
        token = record.extra["label_tokens"][label]["id"]
        if p is not None:
            assert p == pytest.approx(2.718281828 ** top[token], rel=1e-3)
    summary = record.extra["summary"]
    assert set(summary["sets"]) == {"boolq", "multinli", "civil_comments"}
    assert summary["overall"]["macro"] == pytest.approx(sum(s["score"] for s in summary["sets"].values()) / 3)


def _prompt(row) -> str:
    if row["set"] != "boolq":
        raise AssertionError("the first answer checked by hand is a boolq one")
    line = int(row["id"].rsplit("-", 1)[1])
    record = json.loads((FIXTURES / "hf" / "boolq.jsonl").read_text().splitlines()[line - 1])
    return f"{record['passage']}\nQuestion: {record['question']}?\nAnswer with yes or no."


def test_server_stopped_midway_then_resume_answers_each_question_once(lab, env):
    host = lab.host(HOST)
    before = set((env[0] / HOST).glob("eval-*"))
    running = _start_gsm8k(env)
    with SshClient(SshTarget.from_host(host)) as ssh:
        try:
            _wait_for_answers(env, before, 2)
            ssh.run(f"systemctl stop {UNIT}", timeout=60, check=True)
            _, stderr = running.communicate(timeout=300)
        finally:
            ssh.run(f"systemctl start {UNIT}", timeout=60, check=True)
    assert running.returncode != 0
    assert "--resume desktop/eval-" in stderr and "error:" in stderr
    path = run_dir(env, before)
    stopped = RunRecord.load(path)
    partial = read_jsonl(path / "answers.jsonl")
    assert stopped.status == "failed" and 2 <= len(partial) < 10
    deadline = time.monotonic() + 120
    while not _healthy(lab):
        assert time.monotonic() < deadline, "llama-server did not come back"
        time.sleep(0.5)
    # The run alone: its server is found in the inventory, with its key, as a fresh run finds it.
    resumed = rigctl(env, "eval", "run", "--resume", f"{HOST}/{stopped.id}")
    assert resumed.returncode == 0, resumed.stderr
    rows = read_jsonl(path / "answers.jsonl")
    assert sorted(r["id"] for r in rows) == sorted(f"fixture-gsm8k-{i}" for i in range(1, 11))
    assert rows[: len(partial)] == partial
    record = RunRecord.load(path)
    assert record.status == "done" and len(record.extra["resumed"]) == 1
    assert record.extra["summary"]["overall"]["n"] == 10


def test_a_server_killed_midway_restarts_and_the_run_rides_through(lab, env):
    """``systemctl kill -s KILL`` of the server during a run: systemd restarts it, the run's requests wait for it
    (a retry budget from the unit's restart delay and the model's load time measured at deploy) and the run
    finishes with every question answered once, no resume needed."""
    host = lab.host(HOST)
    before = set((env[0] / HOST).glob("eval-*"))
    running = _start_gsm8k(env)
    with SshClient(SshTarget.from_host(host)) as ssh:
        fact = json.loads(ssh.run("cat /etc/ansible/facts.d/llama_server.fact", timeout=60, check=True).stdout)
        pid = ssh.run(f"systemctl show -p MainPID --value {UNIT}", timeout=60, check=True).stdout.strip()
        _wait_for_answers(env, before, 2)
        killed = time.monotonic()
        ssh.run(f"systemctl kill -s KILL {UNIT}", timeout=60, check=True)
        while not _healthy(lab):
            assert time.monotonic() - killed < 120, "llama-server did not come back"
            time.sleep(0.2)
        back = time.monotonic() - killed
        assert ssh.run(f"systemctl show -p MainPID --value {UNIT}", timeout=60, check=True).stdout.strip() != pid
    stdout, stderr = running.communicate(timeout=600)
    assert running.returncode == 0, stdout + stderr
    path = run_dir(env, before)
    record = RunRecord.load(path)
    rows = read_jsonl(path / "answers.jsonl")
    assert sorted(r["id"] for r in rows) == sorted(f"fixture-gsm8k-{i}" for i in range(1, 11))
    assert record.status == "done" and "resumed" not in record.extra
    load_s = fact["instances"][SERVER]["load_s"]
    print(f"server back {back:.1f} s after SIGKILL (RestartSec {fact['restart_sec']} s, load measured at deploy "
          f"{load_s} s); the run retried up to {record.extra['retry_attempts']} times per request")
    assert record.extra["retry_attempts"] > 4  # more than the default budget (about 3.5 s of waiting)


def _start_gsm8k(env) -> subprocess.Popen[str]:
    """``eval run`` of the fixture GSM8K task (10 questions, 2 at a time) on the desktop's server, running."""
    args = ["eval", "run", "--host", HOST, "--server", SERVER, "--task", str(TASKS / "fixture-gsm8k.yaml"),
            "--concurrency", "2"]
    return subprocess.Popen([*RIGCTL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env[1],
                            cwd=REPO)


def _wait_for_answers(env, before: set[Path], count: int, timeout: float = 600) -> None:
    """Until the run started after ``before`` has ``count`` answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in (env[0] / HOST).glob("eval-*") if p not in before]
        answers = found[0] / "answers.jsonl" if found else None
        if answers and answers.is_file() and len(answers.read_text().splitlines()) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {count} answers within {timeout:g} s")


def _healthy(lab) -> bool:
    try:
        return httpx.get(f"{base_url(lab)}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_remote_run_is_a_job_on_the_rig_pulled_home(lab, env):
    before = set((env[0] / HOST).glob("eval-*"))
    done = rigctl(env, "eval", "run", "--host", HOST, "--server", SERVER, "--task", str(TASKS / "fixture-bfcl.yaml"),
                  "--limit", "4", "--remote")
    assert done.returncode == 0, done.stderr
    # The pull brings home every finished run on the rig; this one is the run the command names.
    run_id = re.search(rf"{HOST}/(eval-\S+): pulled to", done.stdout).group(1)
    path = env[0] / HOST / run_id
    assert path in set((env[0] / HOST).glob("eval-*")) - before
    record = RunRecord.load(path)
    assert record.status == "done" and record.extra["remote"] is True
    assert record.server.build_info and record.server.endpoint == "http://127.0.0.1:8080"
    assert_deployed(record.server, lab, HOST, SERVER)  # read on the rig by the job, before it asked
    assert re.fullmatch(r"[0-9a-f]{64}", record.artifacts[0].sha256 or "")
    rows = read_jsonl(path / "answers.jsonl")
    assert sorted(r["id"] for r in rows) == ["simple_0", "simple_1", "simple_2", "simple_3"]
    assert record.extra["summary"]["overall"]["n"] == 4
    # The job checked the template on the rig as the controller would, and the record names the deviation.
    assert record.extra["template_carries_tools"] == [False]
    assert record.extra["deviations"]["settings"] == ["max_tokens 24 (BFCL: no limit)"]
    store = ResultsStore(env[0])
    assert store.verify(store.find(str(path))) == []


def test_remote_bfcl_on_a_template_without_tools_is_refused_on_the_rig(lab, env, tmp_path):
    task = tmp_path / "bfcl-strict.yaml"
    task.write_text((TASKS / "fixture-bfcl.yaml").read_text().replace("allow_template_without_tools: true", ""))
    done = rigctl(env, "eval", "run", "--host", HOST, "--server", SERVER, "--task", str(task), "--limit", "1",
                  "--remote")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "refusing fixture-bfcl: the model's chat template cannot carry tools" in errors[0]
