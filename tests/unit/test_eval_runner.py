"""The eval runner against a loopback stand-in server that sends hostile bodies: a run survives any reply.

A lone surrogate, nesting past Python's recursion limit and an integer past its digit limit are wrong
answers with their reasons, and the run is sealed done; a 200 without ``choices`` stops the run (failed,
answers kept) and ``--resume`` from a relative task path finishes it, asking each question once.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rigctl.errors import EvalError
from rigctl.evals import runner
from rigctl.evals.tasks import load_task
from rigctl.hostside import scorers
from rigctl.llama_http import NO_RETRY, Endpoint
from rigctl.results.store import ResultsStore, read_jsonl

PROPS = {"build_info": "b1-abc", "model_path": "/m.gguf", "total_slots": 2,
         "default_generation_settings": {"n_ctx": 4096}}


def chat(content: str) -> bytes:
    return json.dumps({"choices": [{"message": {"content": content}, "finish_reason": "stop"}],
                       "usage": {"completion_tokens": 3}}).encode()


HOSTILE = {
    "q1": chat("48 + 24 = 72\n#### 72"),
    "q2": b'{"choices": [{"message": {"content": "\\ud800 #### 72"}, "finish_reason": "stop"}]}',
    "q3": b'{"choices": [{"message": {"content": "#### 72"}}], "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "q4": b'{"choices": [{"message": {"content": "#### 72"}}], "usage": {"completion_tokens": ' + b"9" * 5000 + b"}}",
    "q5": chat("#### 71"),
}


class StandIn:
    """GET /props (``props``); POST /v1/chat/completions answering each question (found by its prompt's first
    word) with ``body(q)``; POST /apply-template with ``template``. Keeps every request body it was sent."""

    def __init__(self, body: Callable[[str], bytes], props: dict | None = None, template: str = ""):
        self.body, self.props, self.template = body, PROPS if props is None else props, template
        self.asked: Counter[str] = Counter()
        self.requests: list[tuple[str, dict]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, data: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's names)
                self._send(json.dumps(stand_in.props).encode())

            def do_POST(self) -> None:  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.requests.append((self.path, request))
                if self.path == "/apply-template":
                    self._send(json.dumps({"prompt": stand_in.template}).encode())
                    return
                question = request["messages"][-1]["content"].split()[0]
                stand_in.asked[question] += 1
                self._send(stand_in.body(question))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.endpoint = Endpoint(f"http://127.0.0.1:{self.httpd.server_address[1]}")

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def task_dir(tmp_path, monkeypatch):
    """A GSM8K task with a local dataset, in ``tasks/``, loaded by a relative path from ``tmp_path``."""
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "data.jsonl").write_text("".join(
        json.dumps({"question": f"q{i} how many?", "answer": "48 + 24 = 72\n#### 72"}) + "\n" for i in range(1, 6)))
    (tmp_path / "tasks" / "mini.yaml").write_text(
        "name: mini\nscorer: gsm8k\ndataset: {path: data.jsonl}\nprompt: '{question}'\nmax_tokens: 64\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _start(stand_in: StandIn, store: ResultsStore) -> tuple[object, object]:
    task = load_task("tasks/mini.yaml")
    options = runner.Options(concurrency=2, retry=NO_RETRY)
    return task, runner.start_run(task, stand_in.endpoint, store, "stand-in", options=options)


def test_hostile_bodies_are_wrong_answers_with_reasons(task_dir):
    stand_in = StandIn(HOSTILE.__getitem__)
    store = ResultsStore(task_dir / "results")
    try:
        task, run = _start(stand_in, store)
        summary = runner.run(task, stand_in.endpoint, run, runner.Options(concurrency=2, retry=NO_RETRY))
    finally:
        stand_in.close()
    record = run.record
    rows = {row["id"].split("-")[-1]: row for row in read_jsonl(run.path / "answers.jsonl")}
    assert sorted(rows) == ["1", "2", "3", "4", "5"]
    assert rows["1"]["score"] == 1 and rows["5"]["score"] == 0
    assert rows["2"]["error"] == "unreadable answer: a string with a lone UTF-16 surrogate, which UTF-8 cannot carry"
    assert rows["3"]["error"] == "unreadable answer: JSON nested too deep to read"
    assert rows["4"]["error"].startswith("unreadable answer: a number too long to read (Exceeds the limit")
    assert all(rows[q]["score"] == 0 for q in "234")
    assert summary["overall"]["n"] == 5 and summary["overall"]["score"] == 0.2
    assert store.find(f"stand-in/{record.id}").record.status == "done"


def test_a_200_without_choices_stops_the_run_and_resume_finishes_it(task_dir):
    broken = StandIn(lambda q: b'{"error": {"message": "upstream gone"}}' if q == "q3" else chat("#### 72"))
    store = ResultsStore(task_dir / "results")
    try:
        task, run = _start(broken, store)
        with pytest.raises(EvalError) as info:
            runner.run(task, broken.endpoint, run, runner.Options(concurrency=1, retry=NO_RETRY))
    finally:
        broken.close()
    record, run_dir = run.record, run.path
    message = str(info.value)
    assert "no choices in the answer" in message and f"--resume stand-in/{record.id}" in message
    failed = store.find(f"stand-in/{record.id}").record
    assert failed.status == "failed" and failed.extra["error"] == message  # the reason, sealed with the run
    before = {row["id"] for row in read_jsonl(run_dir / "answers.jsonl")}
    assert "mini-3" not in before

    fixed = StandIn(lambda q: chat("#### 72"))
    try:
        resumed, task, options = runner.resume_run(store, f"stand-in/{record.id}", fixed.endpoint)
        assert resumed.record.status == "running" and "error" not in resumed.record.extra
        summary = runner.run(task, fixed.endpoint, resumed, options)
    finally:
        fixed.close()
    rows = read_jsonl(run_dir / "answers.jsonl")
    assert sorted(row["id"] for row in rows) == [f"mini-{i}" for i in range(1, 6)]
    assert set(fixed.asked) == {f"q{i}" for i in range(1, 6) if f"mini-{i}" not in before}
    assert all(n == 1 for n in fixed.asked.values())
    assert summary["overall"]["score"] == 1.0
    # Tallied as answers came, the earlier ones read once at resume: what the whole file says.
    assert summary == scorers.summarise(rows, "gsm8k")
    assert store.find(f"stand-in/{record.id}").record.status == "done"


# ----------------------------------------------------------------------------------------------- BFCL: tools


FIXTURES = Path(__file__).parents[1] / "fixtures" / "evals" / "hf"
CALL = json.dumps({"choices": [{"message": {"content": "", "tool_calls": [{"type": "function", "function": {
    "name": "calculate_triangle_area", "arguments": '{"base": 10, "height": 5}'}}]}, "finish_reason": "tool_calls"}]})


def _bfcl_task(tmp_path: Path, extra: str = "") -> object:
    (tmp_path / "bfcl.yaml").write_text(
        f"name: bfcl\nscorer: bfcl_simple\ndataset: {{path: {FIXTURES / 'bfcl_simple.json'}}}\n"
        f"answers: {{path: {FIXTURES / 'possible_answer' / 'bfcl_simple.json'}}}\nlimit: 3\n{extra}")
    return load_task(str(tmp_path / "bfcl.yaml"))


CAPS = {**PROPS, "chat_template_caps": {"supports_tools": True, "supports_tool_calls": True}}
NO_TOOLS = {**PROPS, "chat_template_caps": {"supports_tools": False, "supports_tool_calls": False}}


def test_bfcl_sends_bfcls_own_request(tmp_path):
    stand_in = StandIn(lambda q: CALL.encode(), props=CAPS)
    store = ResultsStore(tmp_path / "results")
    task = _bfcl_task(tmp_path)
    try:
        run = runner.start_run(task, stand_in.endpoint, store, "stand-in", options=runner.Options())
        runner.run(task, stand_in.endpoint, run, runner.Options(retry=NO_RETRY))
        record = run.record
    finally:
        stand_in.close()
    chats = [body for path, body in stand_in.requests if path == "/v1/chat/completions"]
    assert len(chats) == 3 and not any(path == "/apply-template" for path, _ in stand_in.requests)
    for body in chats:
        assert body["temperature"] == 0.001 and "max_tokens" not in body
        function = body["tools"][0]["function"]
        assert function["description"].endswith(" Note that the provided function is in Python 3 syntax.")
    floats = [prop for body in chats for prop in body["tools"][0]["function"]["parameters"]["properties"].values()
              if prop.get("format") == "float"]
    assert floats and all(p["type"] == "number" and p["description"].endswith(" This is a float type value.")
                          for p in floats)
    assert record.extra["template_carries_tools"] == [True] and "deviations" not in record.extra


@pytest.mark.parametrize(("props", "template", "how"), [
    (NO_TOOLS, "", "/props chat_template_caps.supports_tools is false"),
    (PROPS, "<|im_start|>user\nWhich tools do you have?<|im_end|>", "a tool sent to /apply-template does not appear"),
])
def test_a_template_without_tools_is_refused_in_one_line(tmp_path, props, template, how):
    stand_in = StandIn(lambda q: CALL.encode(), props=props, template=template)
    store = ResultsStore(tmp_path / "results")
    try:
        with pytest.raises(EvalError) as info:
            runner.start_run(_bfcl_task(tmp_path), stand_in.endpoint, store, "stand-in", options=runner.Options())
        message = str(info.value)
        assert "\n" not in message and how in message
        assert message.startswith(f"{stand_in.endpoint}: refusing bfcl: the model's chat template cannot carry tools")
        assert "allow_template_without_tools: true" in message
        assert not (tmp_path / "results").exists()  # refused before the run began
        assert not stand_in.asked
        # A task that measures exactly that runs, and its record says the template carried no tools.
        task = _bfcl_task(tmp_path, "allow_template_without_tools: true\n")
        run = runner.start_run(task, stand_in.endpoint, store, "stand-in", options=runner.Options())
        assert run.record.extra["template_carries_tools"] == [False]
    finally:
        stand_in.close()


def test_a_probe_that_shows_the_tool_lets_the_run_start(tmp_path):
    stand_in = StandIn(lambda q: CALL.encode(), template="<tools>rigctl_probe_tool</tools>")
    try:
        run = runner.start_run(_bfcl_task(tmp_path), stand_in.endpoint, ResultsStore(tmp_path / "r"),
                               "stand-in", options=runner.Options())
    finally:
        stand_in.close()
    assert run.record.extra["template_carries_tools"] == [True]
    (probe,) = [body for path, body in stand_in.requests if path == "/apply-template"]
    assert probe["tools"][0]["function"]["name"] == "rigctl_probe_tool"


# ----------------------------------------------------------------------------------------------- the rig's job


class _Job:
    """What rigctl.hostside.jobrun hands an eval task: its directory, params, record and run directory."""

    class TaskError(Exception):
        pass

    def __init__(self, tmp_path: Path, params: dict, questions: list[dict]):
        self.dir = tmp_path / "job"
        self.dir.mkdir(parents=True)
        (self.dir / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
        self.params = params
        from rigctl.hostside.runrecord import Provenance, RunRecord, Server

        self.record = RunRecord.begin("eval", Provenance(host="desktop", servers=[Server(name="smollm2")]))
        self.run_dir = tmp_path / "run"

    def save_record(self) -> None:
        pass

    def progress(self, *args: object) -> None:
        pass


def _job(tmp_path: Path, stand_in: StandIn, task, **params) -> _Job:
    port = int(stand_in.endpoint.url.rsplit(":", 1)[1])
    questions = [{"id": q.id, "set": q.set, "data": q.data} for q in task.questions]
    return _Job(tmp_path, {"scorer": task.scorer, "task_name": task.name, "port": port, "api_key_file": None,
                           "concurrency": 2, "seed": 1, "thinking": False, "timeout_s": 30, "retries": 1,
                           "request": task.request, "n_probs": None, **params}, questions)


def test_the_rigs_job_scores_hostile_bodies_as_the_controller_does(task_dir):
    from rigctl.hostside import eval_task

    stand_in = StandIn(HOSTILE.__getitem__)
    try:
        job = _job(task_dir, stand_in, load_task("tasks/mini.yaml"))
        eval_task.run(job)
    finally:
        stand_in.close()
    rows = {row["id"].split("-")[-1]: row for row in read_jsonl(job.run_dir / "answers.jsonl")}
    assert sorted(rows) == ["1", "2", "3", "4", "5"] and rows["1"]["score"] == 1
    assert rows["3"]["error"] == "unreadable answer: JSON nested too deep to read"
    assert rows["2"]["error"].startswith("unreadable answer: a string with a lone UTF-16 surrogate")


def test_the_rigs_job_refuses_a_template_without_tools_and_stops_on_a_200_without_choices(tmp_path):
    from rigctl.hostside import eval_task

    task = _bfcl_task(tmp_path)
    stand_in = StandIn(lambda q: b'{"error": {"message": "gone"}}', props=NO_TOOLS)
    try:
        with pytest.raises(_Job.TaskError, match="refusing bfcl: the model's chat template cannot carry tools "
                                                 r"\(/props chat_template_caps.supports_tools is false\)"):
            eval_task.run(_job(tmp_path / "strict", stand_in, task))
        assert not stand_in.asked
        with pytest.raises(_Job.TaskError, match=r"question simple_\d: no choices in the answer"):
            eval_task.run(_job(tmp_path / "allowed", stand_in, task, allow_template_without_tools=True))
    finally:
        stand_in.close()
    bodies = [body for path, body in stand_in.requests if path == "/v1/chat/completions"]
    assert bodies and all(b["temperature"] == 0.001 and "max_tokens" not in b for b in bodies)
