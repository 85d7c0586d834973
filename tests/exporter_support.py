"""Helpers the exporter's unit and lab tests share: hand-made result runs, metric parsing, promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from rigctl.results.record import RawFile, RunRecord, file_sha256

PROMTOOL = shutil.which("promtool")


def parse_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def sample_value(samples: dict, metric: str, **labels: str) -> float:
    matches = [v for lab, v in samples.get(metric, []) if all(lab.get(k) == want for k, want in labels.items())]
    assert len(matches) == 1, f"{metric}{labels}: {len(matches)} samples in {samples.get(metric)}"
    return matches[0]


def promtool_check(text: bytes) -> None:
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()
    assert not (done.stdout + done.stderr).strip(), (done.stdout + done.stderr).decode()  # no lint warnings either


def bench_json(model_file: str, n_prompt: int, n_gen: int, samples: list[float], fa: int = 1) -> dict:
    return {"model_filename": model_file, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": 0, "flash_attn": fa,
            "n_gpu_layers": 99, "n_threads": 6, "type_k": "f16", "type_v": "f16",
            "avg_ts": sum(samples) / len(samples), "samples_ts": samples, "build_commit": "b11434"}


def cells_jsonl(*cells: tuple[int, str, str]) -> str:
    """cells.jsonl as the bench task writes it: index, artifact, raw file, rc."""
    return "".join(json.dumps({"index": i, "artifact": art, "raw": raw, "rc": 0}) + "\n" for i, art, raw in cells)


def write_run(root: Path, host: str, run_id: str, kind: str, ended: str, files: dict[str, str], **fields) -> None:
    run_dir = root / host / run_id
    run_dir.mkdir(parents=True)
    for name, text in files.items():
        (run_dir / name).write_text(text)
    record = RunRecord(id=run_id, kind=kind, host=host, started=ended, ended=ended, status="done",
                       files=[RawFile(n, file_sha256(run_dir / n), (run_dir / n).stat().st_size) for n in files],
                       **fields)
    record.save(run_dir)


def seed_results(root: Path) -> None:
    """Two bench runs of one model on desktop (the later one wins) and an eval run on laptop."""
    art = [{"name": "smol-q4_1", "path": "/var/lib/rigctl/models/smol-q4_1.gguf"}]
    model_file = "/var/lib/rigctl/models/smol-q4_1.gguf"
    for run_id, ended, rounds in (("bench-a", "2026-11-30T01:00:00.0Z", ([100.0, 110.0], [90.0])),
                                  ("bench-b", "2026-11-30T02:00:00.0Z", ([140.0, 142.0], [138.0, 140.0]))):
        files = {f"cell-{i}.json": json.dumps([bench_json(model_file, 0, 128, tps)]) for i, tps in enumerate(rounds)}
        files["cells.jsonl"] = cells_jsonl(*((i, "smol-q4_1", f"cell-{i}.json") for i in range(len(rounds))))
        write_run(root, "desktop", run_id, "bench", ended, files, artifacts=art)
    answers = "\n".join(json.dumps({"id": str(i), "set": "s", "score": s, "cutoff": False})
                        for i, s in enumerate([1, 0, 1, 1]))
    write_run(root, "laptop", "eval-a", "eval", "2026-11-30T03:00:00.0Z", {"answers.jsonl": answers},
               artifacts=art, task={"name": "gsm8k"})


_PROMQL_WORDS = {
    "rate", "irate", "increase", "sum", "avg", "max", "min", "count", "by", "without", "on", "ignoring",
    "group_left", "group_right", "and", "or", "unless", "bool", "topk", "bottomk", "avg_over_time",
    "max_over_time", "min_over_time", "delta", "deriv", "time", "vector", "scalar", "abs", "clamp_min",
    "clamp_max", "label_replace", "histogram_quantile", "offset",
}


def dashboard_metric_names(expr: str) -> set[str]:
    """Metric names an expression reads: label matchers, ranges, strings and grouping clauses removed,
    what is left that is not a PromQL function or keyword."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {n for n in names if n not in _PROMQL_WORDS and not re.fullmatch(r"[0-9.e]+", n)}


def wait_for(predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.25):
    """``predicate``'s first truthy value, polled every ``poll`` s; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(poll)
