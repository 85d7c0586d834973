"""The llama-bench task of a bench job, run on the host by :mod:`rigctl.hostside.jobrun`. Stdlib only.

One *cell* is one llama-bench invocation for one model with the whole matrix (llama-bench expands
the comma lists itself, as in ``-p 512,2048 -n 128 -r 5 -d 0,4096``). ``rounds`` cells per model are
run in ``alternate`` order (A, B, A, B, ...) or ``grouped`` (A, A, ..., B, B, ...).

The GPUs a cell uses are ``gpus`` (nvidia-smi indexes: llama-bench runs with them as
CUDA_VISIBLE_DEVICES, in PCI bus order) or, without, every GPU; every reading is theirs (``-i``), one per
GPU. Before each cell they are polled with ``nvidia-smi`` until each is at or below the threshold *and*
holds no thermal or power clock-event reason (or the timeout passes, which is recorded and the cell runs
anyway). While the cell runs a light poller (one ``nvidia-smi -lms`` process looping on its own every
``clocks.sample_s``, read by one thread, plus one reading as the cell ends) records each GPU's SM and
memory clocks, the SM clock's maximum, power draw and limit, the active clock-event reasons and the
temperature. A cell is ``throttled`` when, in a reading taken while llama-bench ran or as it ended (not
the one before it loads the model), a GPU held a
thermal or power reason (not the idle reasons: gpu_idle, a software power cap at idle power), or the SM
clock of a GPU busy (the GPU-idle reason off) fell below ``clocks.min_sm_fraction`` of its maximum.

Raw files in the run directory (what summaries and reports read):

    llama-bench/cell-NNN-<artifact>.json        llama-bench ``-o json`` output of cell NNN (1-based), a
                                                list with one object per test; the per-repetition
                                                samples are each object's ``samples_ts`` (tokens/s)
                                                and ``samples_ns`` lists
    llama-bench/cell-NNN-<artifact>.log         llama-bench's stderr
    llama-bench/cell-NNN-<artifact>.clocks.jsonl  the cell's GPU readings, one JSON line each: t_s
                                                (seconds since the cell started), during (taken
                                                from llama-bench's start through the reading as the
                                                cell ends), gpu (nvidia-smi index),
                                                sm_mhz, mem_mhz, max_sm_mhz, power_w, power_limit_w,
                                                reasons (bitmask), temp_c (null where the driver
                                                reports N/A)
    cells.jsonl                                 one line per cell: index, round, artifact, path,
                                                command, started, ended, cooldown {readings,
                                                reasons, waited_s, timed_out}, temp_start_c,
                                                temp_end_c, clocks (the file above), throttle
                                                {throttled, why, min_sm_fraction, reasons, samples},
                                                rc, raw, log

Params (from :func:`rigctl.bench.matrix.bench_job_spec`): ``llama_bench`` (binary), ``models`` [{name,
path}, with ``llama_bench`` and ``build`` where the cells alternate builds rather than models: that
entry's binary and the build's name, which its cells.jsonl lines carry], ``matrix`` {p, n, r, fa, ngl,
t, ctk, ctv, d}, ``rounds``, ``order``, ``cooldown`` {threshold_c (null: no gating), timeout_s,
poll_s}, ``clocks`` {sample_s, min_sm_fraction}, ``bandwidth_gbs`` (the inventory's figure for the GPU,
recorded), ``cell_timeout_s``, ``gpus`` (null: every GPU).

A bench that takes the card from the host's servers (:class:`rigctl.jobs.JobSpec` ``stop_servers``) finds
them stopped: the job's unit stopped them, as root, before this task began, and starts them again after it
ends (:func:`rigctl.hostside.jobrun.prepare` and ``finish``); the record's ``extra.servers_stopped`` names
them, and its ``servers`` carry their argv as deployed, read just before.
"""

from __future__ import annotations

import functools
import json
import operator
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from rigctl.hostside import gguf, nvidia_smi

#: Matrix keys in llama-bench's flag order; list values become comma lists.
MATRIX_FLAGS = (("p", "-p"), ("n", "-n"), ("r", "-r"), ("fa", "-fa"), ("ngl", "-ngl"), ("t", "-t"),
                ("ctk", "-ctk"), ("ctv", "-ctv"), ("d", "-d"))


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


class GpuReader:
    """Readings of the GPUs a cell uses (``gpus``: nvidia-smi indexes, asked with ``-i``; None: every GPU,
    as an unpinned llama-bench uses them all), falling back once to the drivers' old name for the reasons
    field. Each reading names its GPU (``gpu``), so several GPUs' lines are never mixed."""

    def __init__(self, job: Any, gpus: list[int] | None = None):
        self.job = job
        self.gpus = gpus
        self.fields: tuple[str, ...] = nvidia_smi.READING_FIELDS

    @property
    def selection(self) -> list[str]:
        """nvidia-smi's option naming the GPUs read (none: every GPU)."""
        return ["-i", ",".join(str(g) for g in self.gpus)] if self.gpus else []

    def read(self) -> list[dict[str, Any]] | None:
        """One reading per GPU read, or None without nvidia-smi (or when it answers neither spelling)."""
        out = self.job.gpu_query(",".join(self.fields), self.selection)
        if not out and self.fields == nvidia_smi.READING_FIELDS:
            out = self.job.gpu_query(",".join(nvidia_smi.LEGACY_READING_FIELDS), self.selection)
            if out:
                self.fields = nvidia_smi.LEGACY_READING_FIELDS
        return [nvidia_smi.parse_reading(line) for line in out.splitlines() if line.strip()] if out else None


def throttle_verdict(readings: list[dict[str, Any]], min_sm_fraction: float) -> dict[str, Any]:
    """Whether a cell ran throttled, from the readings taken while its llama-bench ran (``during``: from
    its start through the reading as it ends; the one taken as the cell starts, before llama-bench loads
    the model, says nothing of it): on any GPU read, a thermal or power reason held
    (:func:`~rigctl.hostside.nvidia_smi.held_reasons`: not on an idle GPU, not a power cap at idle
    power), or the SM clock of a busy reading (GPU-idle reason off) below ``min_sm_fraction`` of its
    maximum. ``samples`` counts every reading of the cell, ``reasons`` names every reason any showed."""
    during = [r for r in readings if r.get("during", True)]
    several = len({r.get("gpu") for r in during}) > 1
    mask = functools.reduce(operator.or_, (r.get("reasons") or 0 for r in readings), 0)
    held = 0
    lowest: tuple[float, Any] | None = None
    held_on: set[Any] = set()
    for r in during:
        reading_held = nvidia_smi.held_reasons(r)
        if reading_held:
            held |= reading_held
            held_on.add(r.get("gpu"))
        busy = not (r.get("reasons") or 0) & nvidia_smi.GPU_IDLE
        if busy and r.get("sm_mhz") is not None and r.get("max_sm_mhz"):
            fraction = r["sm_mhz"] / r["max_sm_mhz"]
            if lowest is None or fraction < lowest[0]:
                lowest = (fraction, r.get("gpu"))
    why = []
    if held:
        where = f" on GPU {', '.join(str(g) for g in sorted(held_on, key=str))}" if several else ""
        why.append("reason " + ", ".join(nvidia_smi.reason_names(held)) + where)
    if lowest is not None and lowest[0] < min_sm_fraction:
        where = f" on GPU {lowest[1]}" if several else ""
        why.append(f"SM clock at {lowest[0]:.0%} of its max (below {min_sm_fraction:.0%}){where}")
    return {"throttled": bool(why), "why": why,
            "min_sm_fraction": None if lowest is None else round(lowest[0], 4),
            "reasons": nvidia_smi.reason_names(mask), "samples": len(readings)}


def cool_down(gpu: GpuReader, job: Any, threshold: float | None, timeout_s: float, poll_s: float) -> dict[str, Any]:
    """Poll until every GPU the cell uses is at or below ``threshold`` with no thermal or power reason held;
    per poll the hottest GPU's temperature and the reasons of all of them, the wait and whether it timed
    out."""
    temps: list[int] = []
    reasons: list[int | None] = []
    started = time.monotonic()

    def outcome(timed_out: bool) -> dict[str, Any]:
        return {"readings": temps, "reasons": reasons, "waited_s": round(time.monotonic() - started, 3),
                "timed_out": timed_out}

    while True:
        readings = gpu.read()
        known = [r for r in readings or [] if r["temp_c"] is not None]
        if not readings or len(known) != len(readings):
            if threshold is None:
                return outcome(False)
            raise job.TaskError("cool-down needs nvidia-smi's temperature.gpu of every GPU the cell uses "
                                "and none could be read")
        hottest = max(r["temp_c"] for r in known)
        masks = [r["reasons"] for r in readings if r["reasons"] is not None]
        temps.append(hottest)
        reasons.append(functools.reduce(operator.or_, masks) if masks else None)
        if threshold is None:
            return outcome(False)
        held = functools.reduce(operator.or_, (nvidia_smi.held_reasons(r) for r in readings), 0)
        if hottest <= threshold and not held:
            return outcome(False)
        if time.monotonic() - started >= timeout_s:
            state = f"{hottest} °C" + (f", {', '.join(nvidia_smi.reason_names(held))}" if held else "")
            job.log(f"GPU still at {state} after {timeout_s:g} s (threshold {threshold:g} °C); running the cell")
            return outcome(True)
        time.sleep(poll_s)


class ClockPoller:
    """Readings through one cell from one ``nvidia-smi --query-gpu=... -lms N`` process (the tool's own
    loop: no process started per reading) of the GPUs the cell uses: its first lines as the cell starts
    (waited for), one per GPU every ``interval_s``, and one more read when the cell ends. Readings from
    :meth:`bench_started` on, that last one included, are marked ``during``: the verdict is theirs alone.
    Each reading goes to ``path`` as it comes, so a stopped run keeps what it saw."""

    def __init__(self, gpu: GpuReader, path: Any, interval_s: float):
        self.gpu, self.path, self.interval_s = gpu, path, interval_s
        self.readings: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._first = threading.Event()
        self._during = False
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def bench_started(self) -> None:
        """llama-bench starts now: readings from here until the block ends are taken while it runs."""
        with self._lock:
            self._during = True

    def _add(self, reading: dict[str, Any]) -> None:
        with self._lock:
            reading = {"t_s": round(time.monotonic() - self._t0, 3), "during": self._during, **reading}
            self.readings.append(reading)
            with open(self.path, "a") as out:
                out.write(json.dumps(reading, sort_keys=True) + "\n")

    def _follow(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self._add(nvidia_smi.parse_reading(line))
            except ValueError:  # a line the driver garbled: skip it, keep following
                continue
            finally:
                self._first.set()
        self._first.set()

    def __enter__(self) -> ClockPoller:
        self._t0 = time.monotonic()
        argv = ["nvidia-smi", f"--query-gpu={','.join(self.gpu.fields)}", "--format=csv,noheader,nounits",
                *self.gpu.selection, "-lms", str(max(100, int(self.interval_s * 1000)))]
        try:
            self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self._thread = threading.Thread(target=self._follow, name="clock-poller", daemon=True)
        self._thread.start()
        self._first.wait(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            last = self.gpu.read()
        except ValueError:
            last = None
        for reading in last or []:
            self._add(reading)


#: What the bandwidth bound needs of a model: its layers and attention shape (KV bytes per token).
GGUF_SHAPE_KEYS = ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
                   "attention.key_length", "attention.value_length", "context_length")


def gguf_shape(path: str) -> dict[str, Any] | None:
    """The architecture and attention shape from a GGUF file's metadata (None when it is not GGUF v2/v3).
    Per-layer arrays (``head_count_kv`` on some models) are kept as lists."""
    try:
        metadata = gguf.read_header(path, tensors=False)["meta"]
    except gguf.GGUFError:
        return None
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return None
    shape: dict[str, Any] = {"architecture": arch}
    for key in GGUF_SHAPE_KEYS:
        value = metadata.get(f"{arch}.{key}")
        if value is not None and not isinstance(value, dict):  # a dict: an array too long to keep
            shape[key] = value
    return shape


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
    clocks = p.get("clocks") or {}
    threshold = cooldown.get("threshold_c")
    min_fraction = float(clocks.get("min_sm_fraction", 0.8))
    cells = plan_cells(models, int(p.get("rounds", 1)), p.get("order", "alternate"))
    job.record.matrix = {**matrix, "rounds": p.get("rounds", 1), "order": p.get("order", "alternate"),
                            "cooldown": cooldown, "clocks": clocks, "cells": len(cells)}
    if p.get("bandwidth_gbs") is not None:
        job.record.gpu.bandwidth_gbs = p["bandwidth_gbs"]
    job.progress(0, len(cells), "hashing the model files")
    unique = {m["name"]: m["path"] for m in models}  # one model may be benched with several builds
    job.record.artifacts = [job.artifact(name, path) for name, path in unique.items()]
    for artifact in job.record.artifacts:
        artifact.gguf = gguf_shape(artifact.path)
    job.save_record()
    raw_dir = job.run_dir / "llama-bench"
    raw_dir.mkdir(parents=True, exist_ok=True)
    gpus = [int(g) for g in p["gpus"]] if p.get("gpus") else None
    gpu = GpuReader(job, gpus)
    # nvidia-smi's indexes follow the PCI bus; CUDA counts fastest first unless told to do the same.
    pin = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else None
    job.record.extra.setdefault("servers_stopped", [])
    for index, (round_no, model) in enumerate(cells, 1):
        name = model["name"]
        job.progress(index - 1, len(cells), f"cell {index}/{len(cells)} {name}: cooling down")
        wait = cool_down(gpu, job, threshold, float(cooldown.get("timeout_s", 600)),
                         float(cooldown.get("poll_s", 2)))
        argv = llama_bench_argv(model.get("llama_bench") or p["llama_bench"], model["path"], matrix)
        stem = f"cell-{index:03d}-{name}"
        job.progress(index - 1, len(cells), f"cell {index}/{len(cells)} {name}: running llama-bench")
        started = job.now()
        with ClockPoller(gpu, raw_dir / f"{stem}.clocks.jsonl", float(clocks.get("sample_s", 1.0))) as poller:
            began = time.monotonic()
            poller.bench_started()
            done = job.run(argv, timeout=float(p.get("cell_timeout_s", 3600)),
                           stdout=raw_dir / f"{stem}.json", stderr=raw_dir / f"{stem}.log", env=pin)
            llama_bench_s = round(time.monotonic() - began, 3)
        ended = job.now()
        verdict = throttle_verdict(poller.readings, min_fraction)
        temps = [r["temp_c"] for r in poller.readings if r.get("temp_c") is not None]
        line = {"index": index, "round": round_no, "artifact": name, "path": model["path"],
                "command": job.record.commands[-1], "started": started, "ended": ended, "cooldown": wait,
                "llama_bench_s": llama_bench_s,
                "temp_start_c": wait["readings"][-1] if wait["readings"] else None,
                "temp_end_c": temps[-1] if temps else None,
                "clocks": f"llama-bench/{stem}.clocks.jsonl" if poller.readings else None, "throttle": verdict,
                "rc": done.returncode, "raw": f"llama-bench/{stem}.json", "log": f"llama-bench/{stem}.log",
                **({"build": model["build"]} if model.get("build") else {})}
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
        note = f"; THROTTLED: {'; '.join(verdict['why'])}" if verdict["throttled"] else ""
        job.progress(index, len(cells), f"cell {index}/{len(cells)} {name}: done "
                                        f"({line['temp_start_c']} -> {line['temp_end_c']} °C{note})")
