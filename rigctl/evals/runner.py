"""The async eval runner: N requests in flight, one JSON line per answer, resumable runs.

``start_run`` makes the run directory and its record; ``execute`` asks every question not yet in
``answers.jsonl`` (so a resumed run answers each question exactly once), appending and flushing one line
per answer as it completes; ``resume_run`` reopens a stopped run after checking that the task file, the
datasets and the server's model and build are the ones it started with. ``summarise`` turns the answer
lines into per-set and overall scores.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigctl.errors import EvalError, RigctlError, ServerError
from rigctl.evals import scorers
from rigctl.evals.tasks import LoadedTask, Question, load_task
from rigctl.results import ANSWERS_FILE, ResultsStore, RunRecord, new_run_id, read_jsonl, utc_now
from rigctl.server import DEFAULT_SEED, AsyncServerClient, Endpoint, Props, Retry, ServerClient, Timeouts

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 8


@dataclass(frozen=True)
class Options:
    concurrency: int = DEFAULT_CONCURRENCY
    seed: int = DEFAULT_SEED
    thinking: bool = False
    timeout: float = 600.0  # one request, whole generation
    retry: Retry = field(default_factory=Retry)


# ----------------------------------------------------------------------------------------------- asking


def _messages(system: str | None, user: Sequence[Mapping[str, Any]] | str) -> list[dict[str, Any]]:
    turns = [{"role": "user", "content": user}] if isinstance(user, str) else [dict(m) for m in user]
    return ([{"role": "system", "content": system}] if system else []) + turns


class _Asker:
    """One scorer's way of asking a question and scoring the reply."""

    def __init__(self, task: LoadedTask, options: Options):
        self.task = task
        self.options = options

    async def prepare(self, client: AsyncServerClient) -> dict[str, Any]:
        """Anything resolved once per run against the server; recorded in the run record."""
        return {}

    async def ask(self, client: AsyncServerClient, question: Question) -> dict[str, Any]:
        raise NotImplementedError

    def _generation(self, reply: Any) -> dict[str, Any]:
        extra: dict[str, Any] = {"reply": reply.content, "finish_reason": reply.finish_reason,
                                 "tokens": reply.usage.get("completion_tokens")}
        if reply.reasoning_content:
            extra["reasoning"] = reply.reasoning_content
        return extra


class _Gsm8k(_Asker):
    async def ask(self, client: AsyncServerClient, question: Question) -> dict[str, Any]:
        data = question.data
        reply = await client.chat(_messages(data["system"], data["prompt"]), max_tokens=self.task.spec.max_tokens,
                                  seed=self.options.seed, thinking=self.options.thinking)
        return {**self._generation(reply), **scorers.score_gsm8k(reply.content, data["gold"], reply.finish_reason)}


class _Bfcl(_Asker):
    async def ask(self, client: AsyncServerClient, question: Question) -> dict[str, Any]:
        data = question.data
        reply = await client.chat(_messages(data["system"], data["messages"]), max_tokens=self.task.spec.max_tokens,
                                  seed=self.options.seed, thinking=self.options.thinking,
                                  tools=scorers.bfcl_tools([data["function"]]))
        calls = [(c.name, c.parsed_arguments() if c.parsed_arguments() is not None else c.arguments)
                 for c in reply.tool_calls]
        check = scorers.check_simple_call(data["function"], calls, data["possible_answer"])
        toolless = not reply.tool_calls
        return {**self._generation(reply), "tool_calls": [{"name": n, "arguments": a} for n, a in calls],
                "score": int(check.valid), "error": check.error, "error_type": check.error_type,
                "toolless": toolless, "missed_call": toolless and scorers.looks_like_missed_call(reply.content),
                "cutoff": reply.finish_reason == "length"}


class _Choice(_Asker):
    def __init__(self, task: LoadedTask, options: Options):
        super().__init__(task, options)
        self.label_tokens: dict[str, dict[str, Any]] = {}

    async def prepare(self, client: AsyncServerClient) -> dict[str, Any]:
        """Each label's first token, from the server's own tokenizer; labels of one set must differ in it."""
        labels = sorted({label for q in self.task.questions for label in q.data["labels"]})
        for label in labels:
            tokens = await client.tokenize(label)
            if not tokens:
                raise EvalError(f"label {label!r}: the server's tokenizer gives no tokens")
            self.label_tokens[label] = {"id": tokens[0].id, "piece": tokens[0].piece, "n_tokens": len(tokens)}
        for set_name in sorted({q.set for q in self.task.questions}):
            set_labels = next(q.data["labels"] for q in self.task.questions if q.set == set_name)
            ids: dict[int, str] = {}
            for label in set_labels:
                first = self.label_tokens[label]["id"]
                if first in ids:
                    piece = self.label_tokens[label]["piece"]
                    raise EvalError(f"set {set_name}: labels {ids[first]!r} and {label!r} start with the same token "
                                    f"{piece!r}; pick labels that differ in their first token")
                ids[first] = label
        return {"label_tokens": self.label_tokens}

    async def ask(self, client: AsyncServerClient, question: Question) -> dict[str, Any]:
        data = question.data
        prompt = await client.apply_template(_messages(data["system"], data["prompt"]), enable_thinking=False)
        done = await client.complete(prompt, n_predict=1, n_probs=self.task.spec.n_probs, seed=self.options.seed)
        if not done.probs:
            raise ServerError(str(client.endpoint), "POST /completion", "no completion_probabilities in the answer")
        top = done.probs[0]
        label_probs = {label: top.top_ids.get(self.label_tokens[label]["id"]) for label in data["labels"]}
        best = max(top.top.items(), key=lambda kv: kv[1])[0] if top.top else top.token
        return {**scorers.score_choice(label_probs, data["gold"]), "top_token": best}


ASKERS: dict[str, type[_Asker]] = {"gsm8k": _Gsm8k, "bfcl_simple": _Bfcl, "choice": _Choice}


# ----------------------------------------------------------------------------------------------- runs


def answered(path: Path) -> set[tuple[str, str]]:
    """(set, id) of every answer already written; a torn last line (a run killed mid-write) is cut off so
    appending continues on a line boundary."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        log.warning("%s: cutting a torn last line (%d bytes)", path, len(data) - cut)
        with path.open("r+b") as handle:
            handle.truncate(cut)
    return {(str(row["set"]), str(row["id"])) for row in read_jsonl(path)}


def server_provenance(props: Props, endpoint: Endpoint) -> dict[str, Any]:
    return {"endpoint": endpoint.url, "label": endpoint.label, "build_info": props.build_info,
            "model_path": props.model_path, "total_slots": props.total_slots, "n_ctx": props.n_ctx}


def start_run(task: LoadedTask, endpoint: Endpoint, store: ResultsStore, host: str, *, options: Options,
              limit: int | None = None, server: Mapping[str, Any] | None = None,
              artifacts: Sequence[Mapping[str, Any]] = (), extra: Mapping[str, Any] | None = None,
              gpu: Mapping[str, Any] | None = None,
              llama_cpp: Mapping[str, Any] | None = None) -> tuple[Path, RunRecord]:
    """A new run directory with its record (status running). ``server`` adds inventory facts (name, profile,
    flags) to what the server's ``/props`` says."""
    with ServerClient(endpoint, timeouts=Timeouts(read=30.0), retry=options.retry) as client:
        props = client.props()
    record = RunRecord(
        id=new_run_id("eval"), kind="eval", host=host, started=utc_now(),
        gpu=dict(gpu or {}), llama_cpp=dict(llama_cpp or {}),
        server={**server_provenance(props, endpoint), **dict(server or {})},
        artifacts=[dict(a) for a in artifacts],
        task={"name": task.name, "scorer": task.scorer, "file": str(task.path.resolve()),
              "file_sha256": task.file_sha256, "dataset_sha256": task.dataset_sha256,
              "questions": len(task.questions)},
        seed=options.seed, concurrency=options.concurrency, commands=[" ".join(sys.argv)],
        rigctl_version=_version(),
        extra={"thinking": options.thinking, "limit": limit, "timeout_s": options.timeout, **dict(extra or {})})
    run_dir = store.run_dir(host, record.id)
    run_dir.mkdir(parents=True, exist_ok=False)
    record.save(run_dir)
    return run_dir, record


def _version() -> str:
    try:
        return importlib.metadata.version("rigctl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def resume_run(store: ResultsStore, ref: str, endpoint: Endpoint) -> tuple[Path, RunRecord, LoadedTask, Options]:
    """Reopen a stopped run: same task file, same datasets, same model and build on the server."""
    run = store.find(ref)
    record = run.record
    if record.kind != "eval" or not record.task:
        raise EvalError(f"run {ref}: not an eval run")
    limit = record.extra.get("limit")
    task = load_task(record.task["file"], limit=limit)
    if task.file_sha256 != record.task["file_sha256"]:
        raise EvalError(f"run {run.id}: task file {task.path} changed since the run started (sha256 differs)")
    if task.dataset_sha256 != record.task["dataset_sha256"]:
        raise EvalError(f"run {run.id}: the task's datasets differ from the ones the run started with")
    with ServerClient(endpoint, timeouts=Timeouts(read=30.0)) as client:
        props = client.props()
    before = record.server or {}
    for key, now in (("model_path", props.model_path), ("build_info", props.build_info)):
        if before.get(key) and before[key] != now:
            raise EvalError(f"run {run.id}: the server's {key} is now {now!r}, the run started with {before[key]!r}")
    options = Options(concurrency=record.concurrency or DEFAULT_CONCURRENCY, seed=record.seed or DEFAULT_SEED,
                      thinking=bool(record.extra.get("thinking")), timeout=float(record.extra.get("timeout_s", 600)))
    record.status = "running"
    record.ended = None
    record.extra.setdefault("resumed", []).append(utc_now())
    record.save(run.path)
    return run.path, record, task, options


OnAnswer = Callable[[dict[str, Any], int, int], None]


async def execute(task: LoadedTask, endpoint: Endpoint, run_dir: Path, record: RunRecord, options: Options,
                  on_answer: OnAnswer | None = None) -> dict[str, Any]:
    """Ask every question not yet answered in ``run_dir``; seal the run and return its summary.

    A request that still fails after its retries stops the run (status failed, answers kept for
    ``resume``); so does Ctrl-C (status stopped)."""
    answers_path = run_dir / ANSWERS_FILE
    done = answered(answers_path)
    pending = [q for q in task.questions if (q.set, q.id) not in done]
    total = len(task.questions)
    count = len(done)
    asker = ASKERS[task.scorer](task, options)
    queue: asyncio.Queue[Question] = asyncio.Queue()
    for question in pending:
        queue.put_nowait(question)
    status = "failed"
    try:
        async with AsyncServerClient(endpoint, timeouts=Timeouts(read=options.timeout), retry=options.retry,
                                     max_connections=options.concurrency) as client:
            prepared = await asker.prepare(client)
            if prepared:
                record.extra.update(prepared)
                record.save(run_dir)
            with answers_path.open("a", encoding="utf-8") as out:

                async def worker() -> None:
                    nonlocal count
                    while True:
                        try:
                            question = queue.get_nowait()
                        except asyncio.QueueEmpty:
                            return
                        row = {"id": question.id, "set": question.set, **await asker.ask(client, question)}
                        out.write(json.dumps(row, ensure_ascii=False) + "\n")
                        out.flush()
                        count += 1
                        if on_answer:
                            on_answer(row, count, total)

                workers = [asyncio.create_task(worker()) for _ in range(max(1, min(options.concurrency, len(pending))))]
                try:
                    await asyncio.gather(*workers)
                finally:
                    for pending_worker in workers:
                        pending_worker.cancel()
                    await asyncio.gather(*workers, return_exceptions=True)
                    os.fsync(out.fileno())
        status = "done"
    except (KeyboardInterrupt, asyncio.CancelledError):
        status = "stopped"
        raise
    except RigctlError as exc:
        raise EvalError(f"run {record.id} stopped after {count} of {total} answers: {exc} "
                        f"(continue with --resume {record.host}/{record.id})") from None
    finally:
        rows = read_jsonl(answers_path) if answers_path.is_file() else []
        summary = summarise(rows, task.scorer)
        record.extra["summary"] = summary
        record.seal(run_dir, status=status if status == "done" and count == total else
                    ("failed" if status == "done" else status))
    return summary


def run(task: LoadedTask, endpoint: Endpoint, run_dir: Path, record: RunRecord, options: Options,
        on_answer: OnAnswer | None = None) -> dict[str, Any]:
    """``execute`` from synchronous code."""
    return asyncio.run(execute(task, endpoint, run_dir, record, options, on_answer))


# ----------------------------------------------------------------------------------------------- summary


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def summarise(rows: Sequence[Mapping[str, Any]], scorer: str) -> dict[str, Any]:
    """Per set and overall: n, score (mean), cut-offs; tool-less and missed calls for bfcl_simple;
    strict score for gsm8k. ``overall.score`` averages questions, ``overall.macro`` averages sets."""

    def block(items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"n": len(items), "score": _mean(float(r["score"]) for r in items),
                               "cutoffs": sum(1 for r in items if r.get("cutoff"))}
        if scorer == "gsm8k":
            out["strict_score"] = _mean(float(r.get("strict_score", 0)) for r in items)
        if scorer == "bfcl_simple":
            out["toolless"] = sum(1 for r in items if r.get("toolless"))
            out["missed_calls"] = sum(1 for r in items if r.get("missed_call"))
        return out

    sets: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        sets.setdefault(str(row["set"]), []).append(row)
    per_set = {name: block(items) for name, items in sorted(sets.items())}
    overall = block(rows)
    overall["macro"] = _mean(s["score"] for s in per_set.values() if s["score"] is not None)
    return {"sets": per_set, "overall": overall}
