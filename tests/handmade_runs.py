"""Hand-made run directories (a run record plus raw files), written the way the eval and bench
jobs write them, for tests of compare and report that need no lab."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rigctl.results import ANSWERS_FILE, RunRecord

TASK_FILE = "a" * 64
DATASET = "d" * 64


def eval_run(root: Path, host: str, run_id: str, artifact: str, rows: list[dict[str, Any]], *,
             task: str = "suite", file_sha256: str = TASK_FILE, dataset_sha256: str = DATASET,
             commit: str = "7182ef71e", started: str = "2026-11-30T05:00:00.000000Z") -> Path:
    run_dir = root / host / run_id
    run_dir.mkdir(parents=True)
    (run_dir / ANSWERS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = RunRecord(id=run_id, kind="eval", host=host, started=started,
                       llama_cpp={"commit": commit, "version": "b0"},
                       artifacts=[{"name": artifact, "sha256": "0" * 64}],
                       task={"name": task, "file_sha256": file_sha256, "dataset_sha256": dataset_sha256})
    record.seal(run_dir)
    return run_dir


def bench_record(model: str, test: tuple[int, int], samples: list[float], *, fa: int = 1,
                 commit: str = "7182ef71e") -> dict[str, Any]:
    """One llama-bench ``-o json`` result object with the fields rigctl reads."""
    n_prompt, n_gen = test
    mean = sum(samples) / len(samples)
    return {"build_commit": commit, "model_filename": f"/var/lib/rigctl/models/{model}.gguf", "n_prompt": n_prompt,
            "n_gen": n_gen, "n_depth": 0, "flash_attn": fa, "n_gpu_layers": 99, "n_threads": 6, "type_k": "f16",
            "type_v": "f16", "n_batch": 2048, "n_ubatch": 512, "avg_ts": mean, "stddev_ts": 0.0,
            "samples_ts": samples, "samples_ns": [int(1e9 * (n_prompt + n_gen) / s) for s in samples]}


def bench_run(root: Path, host: str, run_id: str, cells: list[list[dict[str, Any]]], *, artifacts: list[str],
              commit: str = "7182ef71e", started: str = "2026-11-30T04:00:00.000000Z") -> Path:
    """A bench run with one raw llama-bench JSON file per cell."""
    run_dir = root / host / run_id
    (run_dir / "raw").mkdir(parents=True)
    for number, records in enumerate(cells):
        (run_dir / "raw" / f"cell-{number:02d}.json").write_text(json.dumps(records, indent=1))
    record = RunRecord(id=run_id, kind="bench", host=host, started=started,
                       llama_cpp={"commit": commit}, artifacts=[{"name": a} for a in artifacts],
                       matrix={"p": [512], "n": [128], "r": 5})
    record.seal(run_dir)
    return run_dir
