"""The eval perf scripts' workload: a GSM8K task file of distinct questions, made from the eval fixtures."""

from __future__ import annotations

import json
from pathlib import Path

from rigctl.evals.datasets import read_records
from rigctl.evals.tasks import LoadedTask, load_task

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = REPO / "tests" / "fixtures" / "evals" / "hf"
GSM8K = QUESTIONS / "gsm8k.jsonl"


def distinct(base: list[dict], count: int, field: str, *, shared_prefix: bool) -> list[dict]:
    """``count`` records made from ``base``, each made distinct by its number in ``field``. Numbered at the
    front (the default), no server's prompt cache shortens a repeat; with ``shared_prefix``, numbered at the
    end and the base records taken in runs (record i from base i * len(base) // count), so a server's prompt
    cache leaves it a few new tokens per question: for scripts that measure the client, not the server."""
    out = []
    for i in range(count):
        row = dict(base[i * len(base) // count if shared_prefix else i % len(base)])
        row[field] = f"{row[field]} ({i + 1})" if shared_prefix else f"({i + 1}) {row[field]}"
        out.append(row)
    return out


def gsm8k_task(workdir: Path, name: str, requests: int, max_tokens: int, *, shared_prefix: bool = False) -> LoadedTask:
    """A task ``name`` of ``requests`` GSM8K questions, each made distinct (:func:`distinct`), its files written
    under ``workdir``."""
    data = workdir / f"{name}.jsonl"
    with data.open("w") as out:
        for row in distinct(read_records(GSM8K), requests, "question", shared_prefix=shared_prefix):
            out.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    task_file = workdir / f"{name}.yaml"
    task_file.write_text(f"name: {name}\nscorer: gsm8k\ndataset: {{path: {data.name}}}\nmax_tokens: {max_tokens}\n")
    return load_task(str(task_file))
