"""The eval perf scripts' workload: a GSM8K task file of distinct questions, made from the eval fixtures."""

from __future__ import annotations

import json
from pathlib import Path

from rigctl.evals.datasets import read_records
from rigctl.evals.tasks import LoadedTask, load_task

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = REPO / "tests" / "fixtures" / "evals" / "hf" / "gsm8k.jsonl"


def gsm8k_task(workdir: Path, name: str, requests: int, max_tokens: int) -> LoadedTask:
    """A task ``name`` of ``requests`` GSM8K questions, each made distinct (so no server's prompt cache
    shortens a repeat), its files written under ``workdir``."""
    base = read_records(QUESTIONS)
    data = workdir / "questions.jsonl"
    with data.open("w") as out:
        for i in range(requests):
            row = base[i % len(base)]
            out.write(json.dumps({"question": f"({i + 1}) {row['question']}", "answer": row["answer"]}) + "\n")
    task_file = workdir / f"{name}.yaml"
    task_file.write_text(f"name: {name}\nscorer: gsm8k\ndataset: {{path: {data.name}}}\nmax_tokens: {max_tokens}\n")
    return load_task(str(task_file))
