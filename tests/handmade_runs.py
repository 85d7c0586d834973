"""Hand-made run directories (a run record plus raw files), written the way the eval and bench
jobs write them, for tests of compare and report that need no lab."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rigctl.bench.matrix import Matrix
from rigctl.results.record import ANSWERS_FILE, Artifact, Gpu, LlamaCppBuild, RunRecord, Server, Task

TASK_FILE = "a" * 64
DATASET = "d" * 64


def eval_run(root: Path, host: str, run_id: str, artifact: str, rows: list[dict[str, Any]], *,
             task: str = "suite", file_sha256: str = TASK_FILE, dataset_sha256: str = DATASET,
             commit: str = "7182ef71e", started: str = "2026-11-30T05:00:00.000000Z") -> Path:
    run_dir = root / host / run_id
    run_dir.mkdir(parents=True)
    (run_dir / ANSWERS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = RunRecord(id=run_id, kind="eval", host=host, started=started,
                       llama_cpp=LlamaCppBuild(commit=commit, version="b0"),
                       artifacts=[Artifact(name=artifact, sha256="0" * 64)],
                       task=Task(name=task, file_sha256=file_sha256, dataset_sha256={"data": dataset_sha256}))
    record.seal(run_dir)
    return run_dir


def bench_record(test: tuple[int, int], samples: list[float], *, fa: int = 1, depth: int = 0, ngl: int = 99,
                 commit: str = "7182ef71e") -> dict[str, Any]:
    """One llama-bench ``-o json`` test object with the fields rigctl reads."""
    n_prompt, n_gen = test
    mean = sum(samples) / len(samples)
    return {"build_commit": commit, "model_filename": "/var/lib/rigctl/models/m.gguf", "n_prompt": n_prompt,
            "n_gen": n_gen, "n_depth": depth, "flash_attn": fa, "n_gpu_layers": ngl, "n_threads": 6, "type_k": "f16",
            "type_v": "f16", "avg_ts": mean, "stddev_ts": 0.0, "samples_ts": samples,
            "samples_ns": [int(1e9 * (n_prompt + n_gen) / s) for s in samples]}


def bench_run(root: Path, host: str, run_id: str, cells: list[tuple[str, list[dict[str, Any]]]], *,
              commit: str = "7182ef71e", started: str = "2026-11-30T04:00:00.000000Z",
              matrix: dict[str, Any] | None = None, gpu: dict[str, Any] | None = None,
              artifacts: dict[str, dict[str, Any]] | None = None,
              throttled: dict[int, list[str]] | None = None, builds: dict[int, str] | None = None) -> Path:
    """A bench run as rigctl.hostside.bench_task writes it: cells.jsonl plus one llama-bench JSON per
    cell (``cells``: artifact and its test objects, in the order they ran). ``artifacts``: more of each
    artifact's record entry (manifest, gguf shape); ``throttled``: cell index -> why it was throttled;
    ``builds``: cell index -> the build a cell of an alternating-builds bench ran."""
    run_dir = root / host / run_id
    (run_dir / "llama-bench").mkdir(parents=True)
    lines = []
    for index, (artifact, records) in enumerate(cells, 1):
        raw = f"llama-bench/cell-{index:03d}-{artifact}.json"
        (run_dir / raw).write_text(json.dumps(records, indent=1))
        why = (throttled or {}).get(index)
        lines.append({"index": index, "round": (index + 1) // 2, "artifact": artifact, "rc": 0, "raw": raw,
                      "temp_start_c": 38.0, "temp_end_c": 55.0,
                      "throttle": {"throttled": why is not None, "why": why or []},
                      **({"build": builds[index]} if builds and index in builds else {})})
    (run_dir / "cells.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    names = list(dict.fromkeys(a for a, _ in cells))
    record = RunRecord(id=run_id, kind="bench", host=host, started=started, llama_cpp=LlamaCppBuild(commit=commit),
                       gpu=Gpu(**(gpu or {})),
                       artifacts=[Artifact(name=a, **(artifacts or {}).get(a, {})) for a in names],
                       matrix={**(matrix or Matrix().flags()), "rounds": len(cells) // max(1, len(names))})
    record.seal(run_dir)
    return run_dir


def spec_run(root: Path, host: str, run_id: str, requests: list[dict[str, Any]], *, baseline: str,
             contenders: list[str], repeats: int, max_tokens: int = 256,
             temperatures: tuple[float, ...] = (0.0, 0.8)) -> Path:
    """A drafter race as rigctl.bench.drafting.run_race writes it: requests.jsonl and the run record."""
    run_dir = root / host / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "requests.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in requests))
    record = RunRecord(id=run_id, kind="spec", host=host, started="2026-11-30T06:00:00.000000Z",
                       servers=[Server(name=c) for c in contenders],
                       extra={"baseline": baseline, "repeats": repeats, "max_tokens": max_tokens,
                              "temperatures": list(temperatures)})
    record.seal(run_dir)
    return run_dir


def load_run(root: Path, host: str, run_id: str, levels: dict[int, list[dict[str, Any]]], *, server: str,
             artifact: str, args: list[str] | None = None, max_tokens: int = 16, slot_ctx: int = 256,
             started: str = "2026-11-30T07:00:00.000000Z", machine: Any = None) -> Path:
    """A load curve as rigctl.bench.load.run_load writes it with its defaults (a warm-up request per client,
    ±10 %): ``levels``: concurrency -> its requests (LoadRequest fields but level and index), each level's wall
    time the latest request's end; ``machine``: every level's MachineLoad."""
    from dataclasses import asdict

    from rigctl.bench.load import DEFAULT_PRECISION, LoadRequest, summarize_level

    run_dir = root / host / run_id
    run_dir.mkdir(parents=True)
    requests, summaries = [], []
    for level, rows in levels.items():
        done = [LoadRequest(level=level, index=i, **row) for i, row in enumerate(rows)]
        requests += done
        summaries.append(summarize_level(level, done, max(r.started_s + r.wall_s for r in done), warmup=level,
                                         machine=machine))
    (run_dir / "requests.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in requests))
    (run_dir / "levels.jsonl").write_text("".join(json.dumps(asdict(s)) + "\n" for s in summaries))
    record = RunRecord(id=run_id, kind="load", host=host, started=started, concurrency=max(levels),
                       servers=[Server(name=server, argv=args or [])], artifacts=[Artifact(name=artifact)],
                       extra={"slot_ctx": slot_ctx, "levels": list(levels), "requests": None,
                              "max_requests": None, "precision": DEFAULT_PRECISION, "warmup": 1,
                              "max_tokens": max_tokens})
    record.seal(run_dir)
    return run_dir
