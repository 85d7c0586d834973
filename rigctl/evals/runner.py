"""The async eval runner: N requests in flight, one JSON line per answer, resumable runs.

``start`` makes the run directory and its record (:class:`rigctl.results.run.Run`) for one server or a
checked fan-out, every command's one way to begin an eval run; ``execute`` asks every question not yet in
``answers.jsonl`` (so a resumed run answers each question exactly once), appending and flushing one line
per answer as it completes, with the label of the server that gave it. Given several servers of one
artifact and build (a fan-out), the questions wait in one queue and each server's N workers take the
next one as they come free, so a faster server answers more; the run is still one run.
``resume_run`` reopens a stopped run after checking that the task file, the datasets and each server's
model and build are the ones it started with. A :class:`scorers.Tally` keeps the per-set and overall
scores as the answers come (those of a resumed run's earlier answers read once, a line at a time), so a
run's memory and its time per answer do not grow with its length.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import rigctl
from rigctl.errors import ConfigError, EvalError, RigctlError, ServerError, UnreadableAnswer
from rigctl.evals.fanout import FanOut
from rigctl.evals.target import Target
from rigctl.evals.tasks import LoadedTask, Question, load_task
from rigctl.fleet.servers import restart_retry
from rigctl.hostside import scorers
from rigctl.llama_http import DEFAULT_SEED, AsyncServerClient, Endpoint, Props, Retry, ServerClient, Timeouts
from rigctl.results.record import ANSWERS_FILE, Provenance, Server, Task
from rigctl.results.run import Run
from rigctl.results.stamp import with_props
from rigctl.results.store import ResultsStore, iter_jsonl
from rigctl.trust import redact_argv

if TYPE_CHECKING:
    from rigctl.inventory import Inventory
    from rigctl.results.store import StoredRun

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 8
_TAIL_BLOCK = 1 << 16

Endpoints = Endpoint | Sequence[Endpoint]


def endpoint_list(endpoint: Endpoints) -> list[Endpoint]:
    return [endpoint] if isinstance(endpoint, Endpoint) else list(endpoint)


@dataclass(frozen=True)
class Options:
    concurrency: int = DEFAULT_CONCURRENCY
    seed: int = DEFAULT_SEED
    thinking: bool = False
    timeout: float = 600.0  # one request, whole generation
    retry: Retry = field(default_factory=Retry)


# ----------------------------------------------------------------------------------------------- asking


class _Asker:
    """One scorer's way of asking a question; request bodies and records come from :mod:`scorers`, the
    same functions the host's eval job uses."""

    def __init__(self, task: LoadedTask, options: Options):
        self.task = task
        self.options = options

    async def prepare(self, client: AsyncServerClient) -> dict[str, Any]:
        """Anything resolved once per run against the server; recorded in the run record."""
        return {}

    async def ask(self, client: AsyncServerClient, question: Question) -> dict[str, Any]:
        body = scorers.chat_request(self.task.scorer, question.data, self.task.request, seed=self.options.seed,
                                    thinking=self.options.thinking)
        answer = await _answer(client, "/v1/chat/completions", body)
        record = scorers.gsm8k_record if self.task.scorer == "gsm8k" else scorers.bfcl_record
        return _scored(client, "POST /v1/chat/completions", record, question.data, answer)


class _Choice(_Asker):
    def __init__(self, task: LoadedTask, options: Options):
        super().__init__(task, options)
        self.label_tokens: dict[str, dict[str, Any]] = {}

    async def prepare(self, client: AsyncServerClient) -> dict[str, Any]:
        """Each label's first token, from the server's own tokenizer; labels of one set must differ in it."""
        for label in sorted({label for q in self.task.questions for label in q.data["labels"]}):
            answer = await client.post_json("/tokenize", {"content": label, "add_special": False,
                                                          "with_pieces": True})
            try:
                self.label_tokens[label] = scorers.label_token(label, answer)
            except (ValueError, KeyError, TypeError) as exc:
                raise EvalError(f"{client.endpoint}: POST /tokenize: {exc}") from None
        for set_name, labels in _set_labels(self.task.questions).items():
            clash = scorers.clashing_labels(labels, self.label_tokens)
            if clash:
                piece = self.label_tokens[clash[0]]["piece"]
                raise EvalError(f"set {set_name}: labels {clash[0]!r} and {clash[1]!r} start with the same token "
                                f"{piece!r}; pick labels that differ in their first token")
        return {"label_tokens": self.label_tokens}

    async def ask(self, client: AsyncServerClient, question: Question) -> dict[str, Any]:
        rendered = await _answer(client, "/apply-template", scorers.template_request(question.data))
        if isinstance(rendered, scorers.Unreadable):
            answer: Any = rendered
        elif not isinstance(rendered, dict) or not isinstance(rendered.get("prompt"), str):
            raise ServerError(str(client.endpoint), "POST /apply-template", "no prompt in the answer")
        else:
            body = scorers.completion_request(rendered["prompt"], n_probs=self.task.spec.n_probs,
                                              seed=self.options.seed)
            answer = await _answer(client, "/completion", body)
        return _scored(client, "POST /completion", lambda d, a: scorers.choice_record(d, a, self.label_tokens),
                       question.data, answer)


async def _answer(client: AsyncServerClient, path: str, body: Any) -> Any:
    """The server's answer, or :class:`scorers.Unreadable` when its body is JSON that Python cannot hold (the
    question is then a wrong answer with the reason, and the run goes on)."""
    try:
        return await client.post_json(path, body)
    except UnreadableAnswer as exc:
        return scorers.Unreadable(exc.reason)


def _scored(client: AsyncServerClient, what: str, record: Callable[[Any, Any], dict[str, Any]],
            data: Mapping[str, Any], answer: Any) -> dict[str, Any]:
    try:
        return record(data, answer)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ServerError(str(client.endpoint), what, f"unexpected answer: {exc}") from None


def _set_labels(questions: Sequence[Question]) -> dict[str, list[str]]:
    labels: dict[str, list[str]] = {}
    for question in questions:
        labels.setdefault(question.set, list(question.data["labels"]))
    return labels


ASKERS: dict[str, type[_Asker]] = {"gsm8k": _Asker, "bfcl_simple": _Asker, "choice": _Choice}


# ----------------------------------------------------------------------------------------------- runs


def answered(path: Path, tally: scorers.Tally | None = None) -> set[tuple[str, str]]:
    """(set, id) of every answer already written, read a line at a time, each answer also added to ``tally``
    when one is given (a resumed run's summary then counts them without reading the file again); a torn last
    line (a run killed mid-write) is cut off so appending continues on a line boundary."""
    if not path.is_file():
        return set()
    _cut_torn_tail(path)
    done = set()
    for row in iter_jsonl(path):
        done.add((str(row["set"]), str(row["id"])))
        if tally is not None:
            tally.add(row)
    return done


def _cut_torn_tail(path: Path) -> None:
    """Cut ``path`` after its last newline, reading back from its end only as far as that newline."""
    with path.open("r+b") as handle:
        end = handle.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            start = max(0, position - _TAIL_BLOCK)
            handle.seek(start)
            block = handle.read(position - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                position = start + newline + 1
                break
            position = start
        if position < end:
            log.warning("%s: cutting a torn last line (%d bytes)", path, end - position)
            handle.truncate(position)


def _props(endpoint: Endpoint, retry: Retry | None = None) -> Props:
    with ServerClient(endpoint, timeouts=Timeouts(read=30.0), retry=retry or Retry()) as client:
        return client.props()


def task_stamp(task: LoadedTask) -> Task:
    return Task(name=task.name, scorer=task.scorer, file=str(task.path.resolve()), file_sha256=task.file_sha256,
                dataset_sha256=dict(task.dataset_sha256), questions=len(task.questions),
                request=task.request_stamp, instruments=task.instruments)


def target_stamp(targets: Sequence[Target]) -> Provenance:
    """The stamp of a run against ``targets`` (one, or a fan-out's): each target's own
    (:meth:`rigctl.evals.target.Target.provenance`, read from its host once). A fan-out's first target gives
    the host, GPU, build and artifacts; each server keeps its own GPU."""
    stamps = [copy.deepcopy(target.provenance()) for target in targets]
    for note in (note for target in targets for note in target.notes):
        log.warning("%s", note)
    first = stamps[0]
    if len(stamps) > 1:
        for stamp in stamps:
            stamp.servers[0].gpu = stamp.gpu
        first.servers = [s for stamp in stamps for s in stamp.servers]
    return first


def start(task: LoadedTask, targets: Sequence[Target], store: ResultsStore, *, options: Options,
          limit: int | None = None, artifact: str | None = None, extra: Mapping[str, Any] | None = None) -> Run:
    """A new eval run of ``task`` against ``targets``: one server, or several serving the same artifact file
    with the same build (a fan-out, checked: :class:`rigctl.evals.fanout.FanOut`), each of them serving
    ``artifact`` when given. The run files under the first target's host."""
    fanout = FanOut.of(targets)
    if artifact is not None:
        for target in fanout.targets:
            if target.artifact != artifact:
                raise ConfigError(f"{target.label} serves {target.artifact}, not {artifact}")
    return start_run(task, fanout.endpoints, store, fanout.first.host, options=options, limit=limit,
                     stamp=target_stamp(fanout.targets), extra=extra)


def start_run(task: LoadedTask, endpoint: Endpoints, store: ResultsStore, host: str, *, options: Options,
              limit: int | None = None, stamp: Provenance | None = None,
              extra: Mapping[str, Any] | None = None) -> Run:
    """A new run directory with its record (status running, :meth:`rigctl.results.run.Run.create`). ``stamp``
    (:func:`target_stamp`) holds one server per endpoint, in order; each gets what its ``/props`` says.
    Servers whose ``/props`` report different builds are refused (a fan-out is one build)."""
    endpoints = endpoint_list(endpoint)
    props = [_props(e, options.retry) for e in endpoints]
    for other, other_props in zip(endpoints[1:], props[1:], strict=True):
        if other_props.build_info != props[0].build_info:
            raise EvalError(f"refusing a fan-out over different builds: {endpoints[0]} runs "
                            f"{props[0].build_info!r}, {other} runs {other_props.build_info!r}")
    tools = [_check_tools(task, e, p, options.retry) for e, p in zip(endpoints, props, strict=True)] \
        if task.scorer == "bfcl_simple" else []
    stamp = stamp or Provenance(host=host)
    servers = list(stamp.servers) + [Server() for _ in endpoints[len(stamp.servers):]]
    stamp.servers = [with_props(s, p, e) for s, p, e in zip(servers, props, endpoints, strict=False)]
    stamp.task = task_stamp(task)
    stamp.seed, stamp.concurrency, stamp.rigctl_version = options.seed, options.concurrency, rigctl.__version__
    stamp.rigctl_commit = rigctl.__commit__
    return Run.create(
        "eval", stamp, store, host=host, commands=[" ".join(redact_argv(sys.argv))],
        extra={"thinking": options.thinking, "limit": limit, "timeout_s": options.timeout,
               "retry_attempts": options.retry.attempts,
               **({"deviations": task.deviations} if task.deviations else {}),
               **({"template_carries_tools": tools} if tools else {}), **dict(extra or {})})


def _check_tools(task: LoadedTask, endpoint: Endpoint, props: Props, retry: Retry) -> bool:
    """Whether ``endpoint``'s chat template carries tools: its ``/props`` says, else a probe through
    ``/apply-template`` shows. EvalError (one line) when it cannot and the task does not allow that."""
    with ServerClient(endpoint, timeouts=Timeouts(read=30.0), retry=retry) as client:
        carries, how = scorers.tool_support(props.raw, lambda body: client.post_json("/apply-template", body))
    if not carries and not getattr(task.spec, "allow_template_without_tools", False):
        raise EvalError(f"{endpoint}: {scorers.no_tools_problem(task.name, how)}")
    return carries


def retry_for(targets: Sequence[Target]) -> Retry:
    """The retries of a run against ``targets``: enough to ride through a restart of the slowest of the
    inventory servers among them (:func:`rigctl.fleet.servers.restart_retry`, from what their deploy measured), else
    the default."""
    known = [retry for t in targets if t.inventory_host is not None and t.name
             and (retry := restart_retry(t.inventory_host, t.name)) is not None]
    return max(known, key=lambda r: r.attempts) if known else Retry()


def recorded_targets(run: StoredRun, inventory: Callable[[], Inventory], api_key: str | None = None) -> list[Target]:
    """The servers a stopped run started with, to resume it against: each inventory server from the
    inventory (loaded only then) where it still has it, its key and address from there as a fresh run
    finds them; else its recorded endpoint."""
    from rigctl.evals.target import inventory_target, url_target

    targets = []
    loaded = None
    entries = run.record.servers
    if not entries:
        raise ConfigError(f"run {run.host}/{run.id}: no server endpoint recorded; give --url or --host/--server")
    for entry in entries:
        if not entry.endpoint:
            raise ConfigError(f"run {run.host}/{run.id}: no server endpoint recorded; give --url or --host/--server")
        if entry.host and entry.name:
            loaded = loaded or inventory()
            if entry.host in loaded.hosts:
                targets.append(inventory_target(loaded.host(entry.host), str(entry.name), api_key=api_key,
                                                facts=False))
                continue
        targets.append(url_target(str(entry.endpoint), api_key=api_key, host=run.host))
    return targets


def resume_run(store: ResultsStore, ref: str, endpoint: Endpoints) -> tuple[Run, LoadedTask, Options]:
    """Reopen a stopped run: same task file, same datasets, same model and build on every server, and
    (for a fan-out) only servers the run started with."""
    run = store.find(ref)
    record = run.record
    if record.kind != "eval" or not record.task:
        raise EvalError(f"run {ref}: not an eval run")
    limit = record.extra.get("limit")
    if not record.task.file:
        raise EvalError(f"run {run.id}: its record names no task file")
    task = load_task(record.task.file, limit=limit)
    if task.file_sha256 != record.task.file_sha256:
        raise EvalError(f"run {run.id}: task file {task.path} changed since the run started (sha256 differs)")
    # By content: the keys name local files by the path they were read under, relative or not.
    if sorted(task.dataset_sha256.values()) != sorted(record.task.dataset_sha256.values()):
        raise EvalError(f"run {run.id}: the task's datasets differ from the ones the run started with")
    started_with = record.servers or [Server()]
    for current in endpoint_list(endpoint):
        # By URL and label: two hosts' loopback servers share a URL (http://127.0.0.1:8080), never a label.
        before = next((s for s in started_with if s.endpoint == current.url and s.label in (None, current.label)),
                      None)
        if before is None:
            if len(started_with) > 1:
                known = ", ".join(str(s.endpoint) for s in started_with)
                raise EvalError(f"run {run.id}: {current} is not one of the servers it started with ({known})")
            before = started_with[0]
        props = _props(current)
        for key, was, now in (("model_path", before.model_path, props.model_path),
                              ("build_info", before.build_info, props.build_info)):
            if was and was != now:
                raise EvalError(f"run {run.id}: {current}'s {key} is now {now!r}, the run started with {was!r}")
    attempts = record.extra.get("retry_attempts")
    options = Options(concurrency=record.concurrency or DEFAULT_CONCURRENCY, seed=record.seed or DEFAULT_SEED,
                      thinking=bool(record.extra.get("thinking")), timeout=float(record.extra.get("timeout_s", 600)),
                      retry=Retry(attempts=attempts) if isinstance(attempts, int) and attempts > 0 else Retry())
    return Run.reopen(run), task, options


OnAnswer = Callable[[dict[str, Any], int, int], None]


async def execute(task: LoadedTask, endpoint: Endpoints, run: Run, options: Options,
                  on_answer: OnAnswer | None = None) -> dict[str, Any]:
    """Ask every question not yet answered in ``run``'s directory (``options.concurrency`` at a time per
    server; several servers share one queue); seal the run and return its summary.

    A request that still fails after its retries stops the run (status failed with the reason, answers kept
    for ``resume``); so does Ctrl-C (status stopped)."""
    record = run.record
    answers_path = run.path / ANSWERS_FILE
    # The summary is tallied as answers are written, in file order, so the run never reads its answers back.
    tally = scorers.Tally(task.scorer)
    done = answered(answers_path, tally)
    pending = [q for q in task.questions if (q.set, q.id) not in done]
    total = len(task.questions)
    count = len(done)
    asker = ASKERS[task.scorer](task, options)
    queue: asyncio.Queue[Question] = asyncio.Queue()
    for question in pending:
        queue.put_nowait(question)
    endpoints = endpoint_list(endpoint)
    with run.sealing():
        try:
            async with contextlib.AsyncExitStack() as stack:
                clients = [await stack.enter_async_context(
                    AsyncServerClient(e, timeouts=Timeouts(read=options.timeout), retry=options.retry,
                                      max_connections=options.concurrency)) for e in endpoints]
                prepared = await _prepare(asker, clients)
                if prepared:
                    record.extra.update(prepared)
                    run.save()
                with answers_path.open("a", encoding="utf-8") as out:

                    async def worker(client: AsyncServerClient) -> None:
                        nonlocal count
                        while True:
                            try:
                                question = queue.get_nowait()
                            except asyncio.QueueEmpty:
                                return
                            answer = await asker.ask(client, question)
                            row = {"id": question.id, "set": question.set, "server": client.endpoint.label,
                                   **answer}
                            out.write(json.dumps(row, ensure_ascii=False) + "\n")
                            out.flush()
                            tally.add(row)
                            count += 1
                            if on_answer:
                                on_answer(row, count, total)

                    per_server = max(1, min(options.concurrency, len(pending)))
                    workers = [asyncio.create_task(worker(c)) for c in clients for _ in range(per_server)]
                    try:
                        await asyncio.gather(*workers)
                    finally:
                        for pending_worker in workers:
                            pending_worker.cancel()
                        await asyncio.gather(*workers, return_exceptions=True)
                        os.fsync(out.fileno())
        except RigctlError as exc:
            raise EvalError(f"run {record.id} stopped after {count} of {total} answers: {exc} "
                            f"(continue with --resume {run.ref})") from None
        finally:
            record.extra["summary"] = tally.summary()
        if count != total:
            raise EvalError(f"run {record.id}: {count} answers for {total} questions")
    return record.extra["summary"]


async def _prepare(asker: _Asker, clients: Sequence[AsyncServerClient]) -> dict[str, Any]:
    """The asker's per-run facts from every server; a fan-out's servers must agree on them (the choice
    labels' tokens), since one run scores every answer by the same rules."""
    # Copied as they come: an asker may keep (and refill) what it prepared on itself.
    prepared = [copy.deepcopy(await asker.prepare(client)) for client in clients]
    for client, other in zip(clients[1:], prepared[1:], strict=True):
        if other != prepared[0]:
            raise EvalError(f"refusing a fan-out: {client.endpoint} tokenizes the labels differently from "
                            f"{clients[0].endpoint} ({other} vs {prepared[0]})")
    return prepared[0]


def run(task: LoadedTask, endpoint: Endpoints, run: Run, options: Options,
        on_answer: OnAnswer | None = None) -> dict[str, Any]:
    """``execute`` from synchronous code."""
    return asyncio.run(execute(task, endpoint, run, options, on_answer))
