"""The eval task of an eval job, run on the host by :mod:`rigctl.hostside.jobrun`. Stdlib only.

The controller loads the task and its datasets (the hosts may have no network) and ships
``questions.jsonl`` (one ``{"id", "set", "data"}`` per line); the job carries :mod:`rigctl.hostside.scorers`
with this module: the request bodies, scoring rules and records are the same functions the controller's runner
uses. This module only speaks HTTP to the local llama-server with
urllib, ``concurrency`` requests at a time, and writes ``answers.jsonl`` in the run directory, one line
per answer, flushed as each completes (format: :mod:`rigctl.evals`).

Params: ``scorer``, ``task_name``, ``allow_template_without_tools``, ``port``, ``api_key_file`` (the
llama_server role's key file, or null), ``concurrency``, ``seed``, ``thinking``, ``timeout_s``, ``request``
(the chat request's settings), ``n_probs``, ``artifact`` {name, path} (hashed into the record), ``retries``.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rigctl.hostside import scorers
from rigctl.hostside.llama_server_http import (
    RETRY_ATTEMPTS,
    UnreadableJSON,
    decode_json,
    error_body,
    props_fields,
    retry_wait,
    retryable_status,
)

ANSWERS_FILE = "answers.jsonl"


class Server:
    """The local llama-server over urllib: JSON in, JSON out, retried as :mod:`rigctl.hostside.llama_server_http`
    says (connection errors and 5xx)."""

    def __init__(self, port: int, api_key: str | None, timeout: float, retries: int, error: type[Exception]):
        self.base = f"http://127.0.0.1:{port}"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.retries = retries
        self.error = error

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries):
            request = urllib.request.Request(self.base + path, data=data, headers=self.headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    body = response.read()
                try:
                    return decode_json(body)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise self.error(f"{method} {path}: not JSON: {body[:120]!r}") from None
            except urllib.error.HTTPError as exc:
                if not retryable_status(exc.code) or attempt == self.retries - 1:
                    body = error_body(exc.read())
                    reason = body.reason(200) if body.message.strip() else exc.reason
                    raise self.error(f"{method} {path}: HTTP {exc.code}: {reason}") from None
                from_error = f"HTTP {exc.code}"
            except (urllib.error.URLError, ConnectionError) as exc:
                if attempt == self.retries - 1:
                    raise self.error(f"{method} {path}: {exc} (after {self.retries} attempts)") from None
                from_error = str(exc)
            time.sleep(retry_wait(attempt))
            print(f"{method} {path}: {from_error}; retrying", flush=True)
        raise self.error(f"{method} {path}: no attempts")


def _api_key(path: str | None, error: type[Exception]) -> str | None:
    """The server's key from the llama_server role's key file (the key never travels in the job)."""
    if not path:
        return None
    try:
        return Path(path).read_text(encoding="utf-8").strip() or None
    except OSError as exc:
        raise error(f"API key file {path}: {exc.strerror or exc}") from None


def run(job: Any) -> None:
    params = job.params
    scorer = params["scorer"]
    questions = [json.loads(line) for line in (job.dir / "questions.jsonl").read_text().splitlines() if line]
    server = Server(int(params["port"]), _api_key(params.get("api_key_file"), job.TaskError),
                    float(params["timeout_s"]), int(params.get("retries", RETRY_ATTEMPTS)), job.TaskError)
    raw_props = server.call("GET", "/props")
    props = props_fields(raw_props)
    if scorer == "bfcl_simple":
        # As the controller's runner checks it: the served template must carry tools, or the task allow it.
        carries, how = scorers.tool_support(raw_props, lambda body: server.call("POST", "/apply-template", body))
        if not carries and not params.get("allow_template_without_tools"):
            raise job.TaskError(scorers.no_tools_problem(params["task_name"], how))
        job.record.extra["template_carries_tools"] = [carries]
    # The runtime put the server (its argv as deployed among it) in the record; /props adds the rest.
    served = job.record.servers[0]
    served.endpoint = server.base
    served.build_info, served.model_path = props["build_info"], props["model_path"]
    served.total_slots, served.n_ctx = props["total_slots"], props["n_ctx"]
    artifact = params.get("artifact")
    if artifact:
        job.record.artifacts = [job.artifact(artifact["name"], artifact["path"])]
    seed, thinking = int(params["seed"]), bool(params["thinking"])
    tokens: dict[str, dict[str, Any]] = {}
    if scorer == "choice":
        for label in sorted({label for q in questions for label in q["data"]["labels"]}):
            tokens[label] = scorers.label_token(label, server.call(
                "POST", "/tokenize", {"content": label, "add_special": False, "with_pieces": True}))
        for set_name in sorted({q["set"] for q in questions}):
            labels = next(q["data"]["labels"] for q in questions if q["set"] == set_name)
            clash = scorers.clashing_labels(labels, tokens)
            if clash:
                raise job.TaskError(f"set {set_name}: labels {clash[0]!r} and {clash[1]!r} share their first token")
        job.record.extra["label_tokens"] = tokens
    job.save_record()

    def answer(path: str, body: Any) -> Any:
        """As the controller's runner: a body Python cannot hold is a wrong answer with the reason."""
        try:
            return server.call("POST", path, body)
        except UnreadableJSON as exc:
            return scorers.Unreadable(str(exc))

    def ask(question: dict[str, Any]) -> dict[str, Any]:
        data = question["data"]
        try:
            if scorer == "choice":
                rendered = answer("/apply-template", scorers.template_request(data))
                if not isinstance(rendered, scorers.Unreadable):
                    if not isinstance(rendered, dict) or not isinstance(rendered.get("prompt"), str):
                        raise job.TaskError("POST /apply-template: no prompt in the answer")
                    rendered = answer("/completion", scorers.completion_request(
                        rendered["prompt"], n_probs=int(params["n_probs"]), seed=seed))
                record = scorers.choice_record(data, rendered, tokens)
            else:
                body = scorers.chat_request(scorer, data, params["request"], seed=seed, thinking=thinking)
                record = (scorers.gsm8k_record if scorer == "gsm8k" else scorers.bfcl_record)(
                    data, answer("/v1/chat/completions", body))
        except scorers.NoAnswer as exc:
            raise job.TaskError(f"question {question['id']}: {exc}") from None
        return {"id": question["id"], "set": question["set"], **record}

    job.run_dir.mkdir(parents=True, exist_ok=True)
    total, done = len(questions), 0
    tally = scorers.Tally(scorer)
    job.progress(0, total, f"{scorer}: asking")
    with (Path(job.run_dir) / ANSWERS_FILE).open("a", encoding="utf-8") as out, \
            concurrent.futures.ThreadPoolExecutor(max_workers=int(params["concurrency"])) as pool:
        futures = [pool.submit(ask, q) for q in questions]
        try:
            for future in concurrent.futures.as_completed(futures):
                row = future.result()
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                out.flush()
                tally.add(row)
                done += 1
                job.progress(done, total, f"score {tally.overall.mean():.3f}")
        finally:
            for future in futures:
                future.cancel()
    job.record.extra["summary"] = tally.summary()
