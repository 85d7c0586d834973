"""The llama-bench task of a bench job, run on the host by :mod:`rigctl.remote.jobrun`. Stdlib only.

One *cell* is one llama-bench invocation for one model with the whole matrix (llama-bench expands
the comma lists itself, as in ``-p 512,2048 -n 128 -r 5``). ``rounds`` cells per model are run in
``alternate`` order (A, B, A, B, ...) or ``grouped`` (A, A, ..., B, B, ...). Before each cell the
GPU is polled with ``nvidia-smi`` until it is at or below the threshold (or the timeout passes,
which is recorded and the cell runs anyway); the temperature is read again when the cell ends.

Raw files in the run directory (what summaries and reports read):

    llama-bench/cell-NNN-<artifact>.json   llama-bench ``-o json`` output of cell NNN (1-based), a
                                           list with one object per test; the per-repetition
                                           samples are each object's ``samples_ts`` (tokens/s)
                                           and ``samples_ns`` lists
    llama-bench/cell-NNN-<artifact>.log    llama-bench's stderr
    cells.jsonl                            one line per cell: index, round, artifact, path,
                                           command, started, ended, cooldown {readings, waited_s,
                                           timed_out}, temp_start_c, temp_end_c, rc, raw, log

Params (from :func:`rigctl.bench.bench_job_spec`): ``llama_bench`` (binary), ``models`` [{name,
path}], ``matrix`` {p, n, r, fa, ngl, t, ctk, ctv, d}, ``rounds``, ``order``, ``cooldown``
{threshold_c (null: no gating), timeout_s, poll_s}, ``stop_servers`` (true: stop every running
``llama-server@`` unit for the run and start them again after), ``cell_timeout_s``.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

#: Matrix keys in llama-bench's flag order; list values become comma lists.
MATRIX_FLAGS = (("p", "-p"), ("n", "-n"), ("r", "-r"), ("fa", "-fa"), ("ngl", "-ngl"), ("t", "-t"),
                ("ctk", "-ctk"), ("ctv", "-ctv"), ("d", "-d"))
SERVER_UNIT = "llama-server@{}.service"


def llama_bench_argv(binary: str, model_path: str, matrix: dict[str, Any]) -> list[str]:
    """The llama-bench command line for one cell."""
    argv = [binary, "-m", model_path]
    for key, flag in MATRIX_FLAGS:
        value = matrix.get(key)
        if value is None or value == []:
            continue
        argv += [flag, ",".join(str(v) for v in value) if isinstance(value, list | tuple) else str(value)]
    return argv + ["-o", "json"]


def plan_cells(models: list[dict[str, str]], rounds: int, order: str) -> list[tuple[int, dict[str, str]]]:
    """(round, model) per cell in run order."""
    if order == "alternate":
        return [(r, m) for r in range(1, rounds + 1) for m in models]
    if order == "grouped":
        return [(r, m) for m in models for r in range(1, rounds + 1)]
    raise ValueError(f"order must be alternate or grouped, not {order!r}")


def parse_temperature(stdout: str) -> int:
    """GPU 0's temperature from ``nvidia-smi --query-gpu=temperature.gpu --format=csv,noheader,nounits``."""
    return int(float(stdout.strip().splitlines()[0].split(",")[0]))


def read_temperature(job: Any) -> int | None:
    out = job.gpu_query("temperature.gpu")
    return parse_temperature(out) if out else None


def cool_down(job: Any, threshold: float | None, timeout_s: float, poll_s: float) -> dict[str, Any]:
    """Poll until the GPU is at or below ``threshold``; every reading, the wait and whether it timed out."""
    readings: list[int] = []
    started = time.monotonic()
    if threshold is None:
        temp = read_temperature(job)
        return {"readings": [temp] if temp is not None else [], "waited_s": 0.0, "timed_out": False}
    while True:
        temp = read_temperature(job)
        if temp is None:
            raise job.TaskError("cool-down needs nvidia-smi's temperature.gpu and none could be read")
        readings.append(temp)
        if temp <= threshold:
            return {"readings": readings, "waited_s": round(time.monotonic() - started, 3), "timed_out": False}
        if time.monotonic() - started >= timeout_s:
            job.log(f"GPU still at {temp} °C after {timeout_s:g} s (threshold {threshold:g}); running the cell")
            return {"readings": readings, "waited_s": round(time.monotonic() - started, 3), "timed_out": True}
        time.sleep(poll_s)


def active_servers() -> list[str]:
    """Instance names of the llama-server units running now (enabled or started by hand)."""
    listing = subprocess.run(["systemctl", "list-units", "llama-server@*.service", "--state=active", "--plain",
                              "--no-legend"], capture_output=True, text=True, check=False, timeout=30).stdout
    units = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return sorted(u.removeprefix("llama-server@").removesuffix(".service") for u in units)


def stop_servers(job: Any, names: list[str]) -> list[str]:
    """Stop the named llama-server units; the ones stopped, to start again after."""
    stopped = []
    for name in names:
        unit = SERVER_UNIT.format(name)
        job.log(f"stopping {unit} for the bench")
        done = job.run(["systemctl", "stop", unit], timeout=120, record=False)
        if done.returncode != 0:
            raise job.TaskError(f"cannot stop {unit}: {done.stderr.decode(errors='replace').strip()}")
        stopped.append(name)
    return stopped


def restore_servers(job: Any, names: list[str]) -> list[str]:
    """Start again what :func:`stop_servers` stopped (plain subprocess: this runs while stopping too)."""
    problems = []
    for name in names:
        unit = SERVER_UNIT.format(name)
        job.log(f"starting {unit} again")
        # Not a crash loop: clear the unit's start-limit counter, which counts every start.
        subprocess.run(["systemctl", "reset-failed", unit], capture_output=True, timeout=60, check=False)
        done = subprocess.run(["systemctl", "start", unit], capture_output=True, text=True, timeout=120,
                              check=False)
        if done.returncode != 0:
            problems.append(f"{unit}: {done.stderr.strip()}")
    return problems


def _has_results(path: Path) -> bool:
    """Whether llama-bench's ``-o json`` output is a non-empty JSON array."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, list) and bool(data)


def run(job: Any) -> None:
    p = job.params
    models = p["models"]
    matrix = p["matrix"]
    cooldown = p.get("cooldown") or {}
    threshold = cooldown.get("threshold_c")
    cells = plan_cells(models, int(p.get("rounds", 1)), p.get("order", "alternate"))
    job.record["matrix"] = {**matrix, "rounds": p.get("rounds", 1), "order": p.get("order", "alternate"),
                            "cooldown": cooldown, "cells": len(cells)}
    job.progress(0, len(cells), "hashing the model files")
    job.record["artifacts"] = [job.artifact(m["name"], m["path"]) for m in models]
    job.save_record()
    raw_dir = job.run_dir / "llama-bench"
    raw_dir.mkdir(parents=True, exist_ok=True)
    stopped = stop_servers(job, active_servers() if p.get("stop_servers") else [])
    job.record["extra"]["servers_stopped"] = stopped
    try:
        for index, (round_no, model) in enumerate(cells, 1):
            name = model["name"]
            job.progress(index - 1, len(cells), f"cell {index}/{len(cells)} {name}: cooling down")
            wait = cool_down(job, threshold, float(cooldown.get("timeout_s", 600)), float(cooldown.get("poll_s", 2)))
            argv = llama_bench_argv(p["llama_bench"], model["path"], matrix)
            stem = f"cell-{index:03d}-{name}"
            job.progress(index - 1, len(cells), f"cell {index}/{len(cells)} {name}: running llama-bench")
            started = job.now()
            done = job.run(argv, timeout=float(p.get("cell_timeout_s", 3600)),
                           stdout=raw_dir / f"{stem}.json", stderr=raw_dir / f"{stem}.log")
            ended = job.now()
            temp_end = read_temperature(job)
            line = {"index": index, "round": round_no, "artifact": name, "path": model["path"],
                    "command": job.record["commands"][-1], "started": started, "ended": ended, "cooldown": wait,
                    "temp_start_c": wait["readings"][-1] if wait["readings"] else None, "temp_end_c": temp_end,
                    "rc": done.returncode, "raw": f"llama-bench/{stem}.json", "log": f"llama-bench/{stem}.log"}
            empty = done.returncode == 0 and not _has_results(raw_dir / f"{stem}.json")
            if empty:  # exit 0 and no results: llama-bench could not write them (a full disk, say)
                line["error"] = "llama-bench exited 0 but wrote no results"
            with open(job.run_dir / "cells.jsonl", "a") as out:
                out.write(json.dumps(line, sort_keys=True) + "\n")
            if empty:
                raise job.TaskError(f"cell {index} ({name}): llama-bench exited 0 but {stem}.json holds no results")
            if done.returncode != 0:
                tail = (raw_dir / f"{stem}.log").read_text(errors="replace").strip().splitlines()
                raise job.TaskError(f"cell {index} ({name}): llama-bench exited {done.returncode}: "
                                    f"{tail[-1] if tail else 'no output'}")
            job.progress(index, len(cells), f"cell {index}/{len(cells)} {name}: done "
                                            f"({line['temp_start_c']} -> {temp_end} °C)")
    finally:
        problems = restore_servers(job, stopped)
        if problems:
            job.record["extra"]["restore_problems"] = problems
