"""``rigctl eval run --remote``: the eval as a detached job on the host (:mod:`rigctl.jobs`).

The rigs have Python 3.11 and no rigctl, and may have no network, so the controller does what needs
rigctl's dependencies or the network — loading the task file, fetching and verifying its datasets,
building the questions — and ships the questions; :mod:`rigctl.hostside.eval_task` (carrying the
stdlib-only :mod:`rigctl.hostside.scorers` with it) then asks the local server (127.0.0.1) over urllib with the
same request bodies and scoring rules, and the job machinery pulls the run home (sha256-checked). The job
takes the host's ``gpu`` lock, so an eval never overlaps a bench.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rigctl import jobs
from rigctl.errors import ConfigError, EvalError
from rigctl.evals.runner import Options, task_stamp
from rigctl.evals.target import Target
from rigctl.evals.tasks import LoadedTask
from rigctl.results.record import ANSWERS_FILE
from rigctl.results.stamp import inventory_server, inventory_stamp
from rigctl.results.store import ResultsStore, StoredRun, iter_run_jsonl


def job_spec(task: LoadedTask, target: Target, options: Options, questions_file: Path,
             limit: int | None = None) -> jobs.JobSpec:
    if target.inventory_server is None:
        raise ConfigError("--remote needs an inventory server (--host and --server), not a bare --url")
    params: dict[str, Any] = {
        # The key never travels in the job: the job reads the one the llama_server role installed.
        "scorer": task.scorer, "task_name": task.name, "port": target.inventory_server.port,
        "api_key_file": target.inventory_server.key_file if target.endpoint.api_key else None,
        "concurrency": options.concurrency, "seed": options.seed, "thinking": options.thinking,
        "timeout_s": options.timeout, "retries": options.retry.attempts,
        "request": task.request, "n_probs": getattr(task.spec, "n_probs", None),
        "allow_template_without_tools": getattr(task.spec, "allow_template_without_tools", False),
    }
    host = target.inventory_host
    assert host is not None and target.name
    if target.artifact:
        params["artifact"] = {"name": target.artifact, "path": host.artifact(target.artifact).path}
    # The stamp as the inventory knows it: the job's runtime completes it on the host (the argv as deployed).
    stamp = inventory_stamp(host, [inventory_server(host, target.name)], task=task_stamp(task), seed=options.seed,
                            concurrency=options.concurrency)
    record = {**dataclasses.asdict(stamp),
              "extra": {"thinking": options.thinking, "limit": limit, "timeout_s": options.timeout, "remote": True,
                        **({"deviations": task.deviations} if task.deviations else {})}}
    return jobs.JobSpec(kind="eval", task="eval_task", params=params, lock="gpu", record=record,
                        files={"questions.jsonl": questions_file},
                        max_runtime_s=int(options.timeout * max(1, len(task.questions))),
                        artifacts=(params["artifact"]["path"],) if "artifact" in params else ())


def run_remote(task: LoadedTask, target: Target, options: Options, store: ResultsStore, *,
               limit: int | None = None, on_progress: Callable[[jobs.JobInfo], None] | None = None) -> StoredRun:
    """Start the job, follow it to the end, pull its run home; the stored run (failed jobs raise)."""
    host = target.inventory_host
    assert host is not None
    with tempfile.TemporaryDirectory(prefix="rigctl-eval-") as tmp:
        questions = Path(tmp) / "questions.jsonl"
        with questions.open("w", encoding="utf-8") as out:
            for question in task.questions:
                out.write(json.dumps({"id": question.id, "set": question.set, "data": question.data}) + "\n")
        info = jobs.start(host, job_spec(task, target, options, questions, limit))
    info = jobs.wait(host, info.id, on_progress=on_progress)
    pulled = jobs.pull(host, store)
    mine = [line for line in pulled.refused if f"run {info.id!r} " in line]
    if mine:
        raise EvalError(mine[0])
    if info.state != "done":
        raise EvalError(f"{host.name}: eval job {info.id} {info.state}: {info.error or info.message}")
    run = store.find(f"{host.name}/{info.id}")
    answered = sum(1 for _ in iter_run_jsonl(run, ANSWERS_FILE))
    if answered != len(task.questions):
        raise EvalError(f"{host.name}/{info.id}: {answered} answers for {len(task.questions)} questions")
    return run
