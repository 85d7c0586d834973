"""`rigctl bench run|summary`: clock-gated, alternating llama-bench runs on the hosts, and their summary.

A bench spec (CLI flags or a YAML file, :func:`load_spec`) names hosts, model artifacts from the
inventory and the llama-bench matrix (``-p -n -r -fa -ngl -t -ctk -ctv -d``; ``d``: context depths,
``d: [0, 4096, 16384]`` sweeps pp/tg at each). :func:`start_bench` starts one job per host through
:mod:`rigctl.jobs` running :mod:`rigctl.hostside.bench_task`: ``rounds`` cells per model (a cell is
one llama-bench invocation over the whole matrix), in ``alternate`` or ``grouped`` order, each
started at or below the cool-down threshold (default 40 °C) with no thermal or power clock-event
reason active, as ``nvidia-smi`` reports them, with the llama-server instances of the host stopped
for the run and started again after (``stop_servers``, default on). Through each cell the clocks,
power, reasons and temperature are sampled (``clocks``) and the cell is marked throttled when they
say heat or power held it back.

Raw files of a bench run (``<results>/<host>/<run id>/``, see :mod:`rigctl.hostside.bench_task`)::

    run.json                                the run record (matrix, artifacts with sha256 + manifest
                                            + GGUF shape, GPU with the inventory's bandwidth, llama.cpp
                                            build, every command line, host facts)
    cells.jsonl                             one line per cell: artifact, command, cool-down readings,
                                            temp_start_c / temp_end_c, throttle verdict, timestamps,
                                            llama_bench_s (the tool's own wall time, clock poller aside)
    llama-bench/cell-NNN-<artifact>.json    llama-bench -o json; per-repetition tokens/s in each
                                            test object's ``samples_ts`` (``samples_ns``: times)
    llama-bench/cell-NNN-<artifact>.clocks.jsonl  the GPU readings through the cell
    llama-bench/cell-NNN-<artifact>.log     llama-bench's stderr

The summary (:func:`summarize`) is computed from those raw files only: per test (``pp512``,
``tg128``, ``pp512+tg128``, ``... @ d4096``), configuration and model, the mean and sample standard
deviation of every repetition's tokens/s, the ratio of the first model to each other, fa1/fa0
(same configuration with flash attention on vs off), cold (each cell's first repetition, right
after the cool-down) against steady state (the later ones) and rep/first (steady over cold: below
1 when the card slows as it warms). Throttled cells are left out of the means and listed; where
every cell of a test was throttled the mean is theirs and marked THROTTLED. Runs of different
hosts or llama.cpp builds are summarised apart unless ``merge`` is asked.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import statistics  # not numpy: starting a bench imports this module, and numpy costs a tenth of a second
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rigctl.charts import new_figure, save_png
from rigctl.errors import ConfigError, DrainedError, RigctlError
from rigctl.hostside.bench_cells import CELLS_FILE
from rigctl.hostside.bench_task import plan_cells
from rigctl.inputs import read_mapping, validated
from rigctl.inventory import Host, Inventory
from rigctl.inventory.gates import Cooldown, Matrix
from rigctl.results.record import parse_json
from rigctl.results.store import StoredRun, open_run_file, read_run_jsonl, run_file
from rigctl.trust import relative_path

if TYPE_CHECKING:  # rigctl.jobs brings paramiko; summaries (and rigctl.analysis.compare) do not need it
    from rigctl import jobs

log = logging.getLogger(__name__)

#: The host-side module a bench job runs (rigctl/hostside/bench_task.py).
BENCH_TASK = "bench_task"
RAW_DIR = "llama-bench"


# ----------------------------------------------------------------------------------------------- spec


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Clocks(_Strict):
    """The GPU readings taken through each cell, and when they mark it throttled."""

    sample_s: float = Field(default=1.0, gt=0)  # one nvidia-smi reading this often (plus start and end)
    # A busy reading with the SM clock below this share of its max marks the cell throttled.
    min_sm_fraction: float = Field(default=0.8, gt=0, le=1)


class BenchSpec(_Strict):
    hosts: list[str] = Field(min_length=1)
    models: list[str] = Field(min_length=1)
    matrix: Matrix = Matrix()
    rounds: int = Field(default=1, ge=1)
    order: Literal["alternate", "grouped"] = "alternate"
    cooldown: Cooldown = Cooldown()
    clocks: Clocks = Clocks()
    stop_servers: bool = True
    cell_timeout_s: float = Field(default=3600.0, gt=0)
    #: The GPUs the cells use (nvidia-smi indexes, pinned in PCI bus order); None: every GPU of the host.
    gpus: list[int] | None = Field(default=None, min_length=1)


def parse_spec(data: Mapping[str, Any], origin: str) -> BenchSpec:
    """A bench spec from a mapping (YAML or CLI); ConfigError naming the first bad key."""
    return validated(BenchSpec, dict(data), origin)


def load_spec(path: Path, overrides: Mapping[str, Any] | None = None) -> BenchSpec:
    """A YAML bench spec, with ``overrides`` (from CLI flags) on top."""
    data = read_mapping(path, "bench spec", empty=True)
    for key, value in (overrides or {}).items():
        if key == "matrix":
            data["matrix"] = {**(data.get("matrix") or {}), **value}
        elif key in ("cooldown", "clocks"):
            data[key] = {**(data.get(key) or {}), **value}
        else:
            data[key] = value
    return parse_spec(data, str(path))


def llama_bench_path(host: Host) -> str:
    root = str(host.vars.get("llama_cpp_install_root") or "/opt/llama.cpp")
    return f"{root}/current/bin/llama-bench"


def bench_job_spec(host: Host, spec: BenchSpec, builds: Sequence[tuple[str, str]] = ()) -> jobs.JobSpec:
    """The job that runs ``spec`` on ``host``; ConfigError when the host lacks one of the artifacts.
    ``builds`` ((name, install directory) pairs): cells alternate these builds' llama-bench for each model
    instead of running the current build's, each cell naming its build (what an upgrade's gates compare)."""
    from rigctl import jobs

    available = {a.name: a for a in host.artifacts}
    for name in spec.models:
        if name not in available:
            raise ConfigError(f"host {host.name}: bench model {name!r} is not an artifact of this host "
                              f"(it has: {', '.join(available) or 'none'})")
    models = [{"name": name, "path": available[name].path} for name in spec.models]
    if builds:
        models = [{**model, "llama_bench": f"{directory}/bin/llama-bench", "build": build}
                  for model in models for build, directory in builds]
    _check_gpus(host, spec.gpus)
    params = {
        "llama_bench": llama_bench_path(host),
        "models": models,
        "matrix": spec.matrix.flags(),
        "rounds": spec.rounds,
        "order": spec.order,
        "cooldown": spec.cooldown.model_dump(),
        "clocks": spec.clocks.model_dump(),
        "bandwidth_gbs": host.gpu.bandwidth_gbs if host.gpu else None,
        "cell_timeout_s": spec.cell_timeout_s,
        "gpus": spec.gpus,
    }
    cells = len(plan_cells(models, spec.rounds, spec.order))
    budget = cells * (spec.cell_timeout_s + spec.cooldown.timeout_s) + 600
    return jobs.JobSpec(kind="bench", task=BENCH_TASK, params=params, lock="gpu", max_runtime_s=int(budget),
                        stop_servers=spec.stop_servers, artifacts=tuple(m["path"] for m in models))


def _check_gpus(host: Host, gpus: list[int] | None) -> None:
    """ConfigError naming the host when a GPU the cells would use does not exist or has MIG on: llama-bench
    pinned to a GPU index finds no device under MIG, and the clock readings are the whole card's, not the
    instance's, so a MIG GPU's verdict would judge what the cell did not run on."""
    present = host.gpu_indexes
    for index in gpus or []:
        if present and index not in present:
            raise ConfigError(f"host {host.name}: bench gpus: GPU {index} does not exist "
                              f"(nvidia-smi indexes {', '.join(map(str, present))})")
    mig = sorted(i for i, on in present.items() if on and (gpus is None or i in gpus))
    if mig:
        raise ConfigError(f"host {host.name}: bench gpus: GPU {', '.join(map(str, mig))} has MIG on; llama-bench "
                          f"cannot be pinned to a MIG instance by index and its clocks are the whole card's "
                          f"(bench another GPU with gpus: [...], or turn MIG off)")


def start_bench(inventory: Inventory, spec: BenchSpec) -> dict[str, jobs.JobInfo | RigctlError]:
    """One bench job per host of the spec; per host its job or the error (a busy lock, a bad artifact, a drained
    host). Inside a :func:`rigctl.connections.connections` scope, following and pulling reuse the connection."""
    from rigctl import jobs
    from rigctl.fleet.drain import admitted

    hosts = inventory.select(spec.hosts, where="the bench's hosts (-H, or hosts: in its spec)")
    kept, skipped = admitted(hosts, lambda host: host, "a bench")
    drained: dict[str, jobs.JobInfo | RigctlError] = {
        name: DrainedError(f"host {name} is drained ({why}); not benched") for name, why in skipped.items()}
    return {**jobs.start_each(kept, lambda host: bench_job_spec(host, spec)), **drained}


# ----------------------------------------------------------------------------------------------- parsers

#: Keys every llama-bench JSON test object has and the summary reads.
REQUIRED_KEYS = ("model_filename", "n_prompt", "n_gen", "samples_ts")


def parse_llama_bench_json(text: str, origin: str = "llama-bench output") -> list[dict[str, Any]]:
    """llama-bench ``-o json`` output (one array of test objects); ConfigError when it is not, or is empty
    (a llama-bench that wrote nothing, say on a full disk, has no results to count)."""
    if not text.strip():
        raise ConfigError(f"{origin}: empty ({len(text)} bytes): llama-bench wrote no results")
    try:
        data = parse_json(text, origin)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{origin}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list):
        raise ConfigError(f"{origin}: expected a JSON array of llama-bench results")
    if not data:
        raise ConfigError(f"{origin}: an empty array: llama-bench wrote no results")
    for number, entry in enumerate(data):
        missing = [k for k in REQUIRED_KEYS if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise ConfigError(f"{origin}: result {number} lacks {', '.join(missing)}")
    return data


def flash_attn_flag(value: Any) -> int:
    """llama-bench writes flash_attn as a bool (older builds), 0/1 or on/off/auto."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    return {"on": 1, "off": 0, "auto": -1, "1": 1, "0": 0, "true": 1, "false": 0}.get(str(value).lower(), -1)


def bench_test_name(n_prompt: int, n_gen: int, n_depth: int = 0) -> str:
    """llama-bench's test names: pp512, tg128, pp512+tg128; `` @ d4096`` with a depth."""
    parts = ([f"pp{n_prompt}"] if n_prompt else []) + ([f"tg{n_gen}"] if n_gen else [])
    name = "+".join(parts) or "none"
    return f"{name} @ d{n_depth}" if n_depth else name


@dataclass(frozen=True)
class BenchSample:
    """One test of one cell: its per-repetition tokens/s and what it ran on."""

    host: str
    run_id: str
    build: str  # llama.cpp commit (from the run record, else llama-bench's build_commit)
    model: str  # artifact name
    cell: int
    test: str
    config: str  # everything but the model and flash attention: ngl, threads, cache types
    flash_attn: int
    samples_ts: tuple[float, ...]
    temp_start_c: float | None = None
    temp_end_c: float | None = None
    depth: int = 0  # tokens already in the context (llama-bench -d)
    n_prompt: int = 0
    n_gen: int = 0  # tokens generated per repetition (0: a pp test)
    ngl: int = 0
    type_k: str = "f16"
    type_v: str = "f16"
    throttled: bool = False  # the cell's clock readings say heat or power held the card back
    throttle_why: tuple[str, ...] = ()


def config_label(entry: Mapping[str, Any]) -> str:
    return (f"ngl{entry.get('n_gpu_layers', '?')} t{entry.get('n_threads', '?')} "
            f"{entry.get('type_k', '?')}/{entry.get('type_v', '?')}")


def samples_from_cell(
    entries: Sequence[Mapping[str, Any]], *, host: str, run_id: str, build: str, model: str, cell: int,
    temps: tuple[float | None, float | None] = (None, None), throttle: Mapping[str, Any] | None = None,
) -> list[BenchSample]:
    """The :class:`BenchSample` of each test object of one cell (pure); ``throttle``: the cell's verdict
    from cells.jsonl."""
    out = []
    throttle = throttle or {}
    for entry in entries:
        depth = int(entry.get("n_depth", 0) or 0)
        out.append(BenchSample(
            host=host, run_id=run_id, build=build or str(entry.get("build_commit", "")), model=model, cell=cell,
            test=bench_test_name(int(entry["n_prompt"]), int(entry["n_gen"]), depth),
            config=config_label(entry), flash_attn=flash_attn_flag(entry.get("flash_attn", 0)),
            samples_ts=tuple(float(x) for x in entry["samples_ts"]),
            temp_start_c=temps[0], temp_end_c=temps[1], depth=depth, n_prompt=int(entry["n_prompt"]),
            n_gen=int(entry["n_gen"]), ngl=int(entry.get("n_gpu_layers", 0) or 0),
            type_k=str(entry.get("type_k", "f16")), type_v=str(entry.get("type_v", "f16")),
            throttled=bool(throttle.get("throttled")), throttle_why=tuple(throttle.get("why") or ()),
        ))
    return out


def load_run_samples(run: StoredRun) -> list[BenchSample]:
    """Every sample of a pulled bench run, read from its raw files (cells.jsonl + llama-bench JSON)."""
    cells_path = run_file(run, "bench", CELLS_FILE)
    recorded = run.record.llama_cpp.commit
    samples: list[BenchSample] = []
    for number, cell in enumerate(read_run_jsonl(run, CELLS_FILE), 1):
        if cell.get("rc") != 0 or cell.get("error"):  # a failed cell has no results to count
            continue
        where = f"{cells_path}: cell {number}"
        raw_name, artifact, index = cell.get("raw"), cell.get("artifact"), cell.get("index")
        if not isinstance(raw_name, str) or not raw_name or not isinstance(artifact, str) or type(index) is not int:
            raise ConfigError(f"{where}: needs raw and artifact (strings) and index (an integer)")
        relative_path(raw_name, f"{run.host}/{run.id}/{CELLS_FILE} cell {index} raw")
        try:
            with open_run_file(run, raw_name) as handle:
                text = handle.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: {raw_name}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        entries = parse_llama_bench_json(text, f"{run.host}/{run.id}/{raw_name}")
        try:
            # A cell of a bench that alternates builds names its own; the others ran the record's.
            build = cell.get("build") if isinstance(cell.get("build"), str) and cell.get("build") else recorded
            samples += samples_from_cell(entries, host=run.host, run_id=run.id, build=build, model=artifact,
                                         cell=index, temps=(cell.get("temp_start_c"), cell.get("temp_end_c")),
                                         throttle=cell.get("throttle"))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{run.host}/{run.id}/{raw_name}: not llama-bench results: {exc}") from None
    return samples


# ----------------------------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class SummaryRow:
    partition: str  # "host @ build" (or "all" when merged)
    test: str
    config: str
    flash_attn: int
    model: str
    n: int  # repetitions in the mean
    cells: int  # cells in the mean
    mean: float
    stddev: float
    rep_first: float  # steady / cold
    cold: float = math.nan  # mean of each cell's first repetition
    steady: float = math.nan  # mean of every later repetition
    throttled_cells: int = 0  # cells whose clock readings say throttled: left out of the mean ...
    all_throttled: bool = False  # ... unless every cell was, when the mean is theirs and says so
    ratio: dict[str, float] = field(default_factory=dict)  # this model / other model, by other
    fa1_fa0: float | None = None


def counted(samples: Sequence[BenchSample]) -> list[BenchSample]:
    """What a mean is taken over: the unthrottled cells, or every cell when all were throttled."""
    return [s for s in samples if not s.throttled] or list(samples)


def cold_and_steady(cells: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Cold (each cell's first repetition, run right after the cool-down) and steady state (every later
    repetition): their means, nan where there is none."""
    cold = [c[0] for c in cells if c]
    steady = [v for c in cells for v in c[1:]]
    return (statistics.fmean(cold) if cold else math.nan, statistics.fmean(steady) if steady else math.nan)


def rep_over_first(cells: Sequence[Sequence[float]]) -> float:
    """Steady state over cold (below 1 when the card slows as it warms); nan without both."""
    cold, steady = cold_and_steady(cells)
    return steady / cold if cold and not math.isnan(cold) and not math.isnan(steady) else math.nan


def summarize(samples: Iterable[BenchSample], *, merge: bool = False) -> list[SummaryRow]:
    """Per partition (host and build, unless ``merge``), test, config, flash attention and model."""
    groups: dict[tuple[str, str, str, int, str], list[BenchSample]] = {}
    models_order: dict[str, list[str]] = {}
    for s in samples:
        partition = "all" if merge else f"{s.host} @ {s.build[:12] or '?'}"
        groups.setdefault((partition, s.test, s.config, s.flash_attn, s.model), []).append(s)
        order = models_order.setdefault(partition, [])
        if s.model not in order:
            order.append(s.model)
    means: dict[tuple[str, str, str, int, str], float] = {}
    rows: list[SummaryRow] = []
    for key, group in groups.items():
        ordered = sorted(group, key=lambda s: (s.run_id, s.cell))
        clean = [s for s in ordered if not s.throttled]
        used = counted(ordered)
        values = [v for s in used for v in s.samples_ts]
        mean = statistics.fmean(values) if values else math.nan
        means[key] = mean
        cold, steady = cold_and_steady([s.samples_ts for s in used])
        rows.append(SummaryRow(
            partition=key[0], test=key[1], config=key[2], flash_attn=key[3], model=key[4], n=len(values),
            cells=len(used), mean=mean, stddev=statistics.stdev(values) if len(values) > 1 else 0.0,
            rep_first=rep_over_first([s.samples_ts for s in used]), cold=cold, steady=steady,
            throttled_cells=len(ordered) - len(clean), all_throttled=not clean,
        ))
    out = []
    for row in rows:
        ratio = {}
        for other in models_order[row.partition]:
            theirs = means.get((row.partition, row.test, row.config, row.flash_attn, other))
            if other != row.model and theirs:
                ratio[other] = row.mean / theirs
        fa0 = means.get((row.partition, row.test, row.config, 0, row.model))
        fa1_fa0 = row.mean / fa0 if row.flash_attn == 1 and fa0 else None
        out.append(SummaryRow(**{**row.__dict__, "ratio": ratio, "fa1_fa0": fa1_fa0}))
    order_index = {p: {m: i for i, m in enumerate(ms)} for p, ms in models_order.items()}
    test_order = {t: i for i, t in enumerate(dict.fromkeys(r.test for r in rows))}
    return sorted(out, key=lambda r: (r.partition, test_order[r.test], r.config, -r.flash_attn,
                                      order_index[r.partition][r.model]))


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def throttle_note(row: SummaryRow) -> str:
    """What a mean hides about throttling, for beside it: nothing when no cell was throttled."""
    if row.all_throttled:
        return f" THROTTLED (all {row.cells} cells)"
    if row.throttled_cells:
        return f" ({row.throttled_cells} throttled cell{'s' if row.throttled_cells > 1 else ''} left out)"
    return ""


def throttled_cells(samples: Iterable[BenchSample]) -> list[str]:
    """One line per throttled cell: which, and why."""
    seen: dict[tuple[str, str, int], BenchSample] = {}
    for s in samples:
        if s.throttled:
            seen.setdefault((s.host, s.run_id, s.cell), s)
    return [f"{s.host}/{s.run_id} cell {s.cell} ({s.model}): {'; '.join(s.throttle_why) or 'throttled'}"
            for s in seen.values()]


def to_markdown(rows: Sequence[SummaryRow], samples: Iterable[BenchSample] = ()) -> str:
    """One table per partition; one line per test/config/fa, models side by side as in the study; then
    the throttled cells (left out of the means when the same test has unthrottled cells)."""
    out = []
    for partition in dict.fromkeys(r.partition for r in rows):
        part = [r for r in rows if r.partition == partition]
        models = list(dict.fromkeys(r.model for r in part))
        first = models[0]
        header = ["test", "config", "fa"] + [f"{m} t/s" for m in models]
        header += [f"{first}/{m}" for m in models[1:]] + [f"{m} fa1/fa0" for m in models]
        header += [f"rep/first ({', '.join(models)})", f"cold -> steady t/s ({', '.join(models)})"]
        out += [f"### {partition}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for key in dict.fromkeys((r.test, r.config, r.flash_attn) for r in part):
            by_model = {r.model: r for r in part if (r.test, r.config, r.flash_attn) == key}
            cells = [key[0], key[1], str(key[2])]
            cells += [f"{_num(by_model[m].mean)} ± {_num(by_model[m].stddev)}{throttle_note(by_model[m])}"
                      if m in by_model else "-" for m in models]
            cells += [_num(by_model[first].ratio.get(m), 3) if first in by_model else "-" for m in models[1:]]
            cells += [_num(by_model[m].fa1_fa0, 3) if m in by_model else "-" for m in models]
            cells += [", ".join(_num(by_model[m].rep_first, 3) if m in by_model else "-" for m in models)]
            cells += [", ".join(f"{_num(by_model[m].cold)} -> {_num(by_model[m].steady)}" if m in by_model else "-"
                                for m in models)]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    throttled = throttled_cells(samples)
    if throttled:
        out += ["Throttled cells (their clocks fell or a thermal/power reason was active; left out of the "
                "means where unthrottled cells exist):", "", *(f"- {line}" for line in throttled), ""]
    return "\n".join(out)


def to_csv(rows: Sequence[SummaryRow]) -> str:
    """One line per partition, test, config, fa and model (ratios as ``ratio_to`` pairs)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["partition", "test", "config", "flash_attn", "model", "n", "cells", "mean_ts", "stddev_ts",
                     "rep_first", "cold_ts", "steady_ts", "throttled_cells", "all_throttled", "fa1_fa0", "ratio_to"])
    for r in rows:
        ratios = ";".join(f"{m}={v:.6g}" for m, v in r.ratio.items())
        writer.writerow([r.partition, r.test, r.config, r.flash_attn, r.model, r.n, r.cells, f"{r.mean:.6g}",
                         f"{r.stddev:.6g}", _num(r.rep_first, 6), _num(r.cold, 6), _num(r.steady, 6),
                         r.throttled_cells, int(r.all_throttled), _num(r.fa1_fa0, 6), ratios])
    return buffer.getvalue()


def to_png(rows: Sequence[SummaryRow], path: Path) -> Path:
    """Bars of mean tokens/s with stddev error bars, one panel per partition, models side by side."""
    partitions = list(dict.fromkeys(r.partition for r in rows))
    if not partitions:
        raise ConfigError("nothing to plot: no bench samples")
    fig, axes = new_figure(len(partitions), 1, figsize=(9, 3.6 * len(partitions)), squeeze=False)
    for ax, partition in zip(axes[:, 0], partitions, strict=True):
        part = [r for r in rows if r.partition == partition]
        models = list(dict.fromkeys(r.model for r in part))
        keys = list(dict.fromkeys((r.test, r.config, r.flash_attn) for r in part))
        width = 0.8 / len(models)
        for i, model in enumerate(models):
            by_key = {(r.test, r.config, r.flash_attn): r for r in part if r.model == model}
            xs = [k + i * width for k in range(len(keys))]
            ax.bar(xs, [by_key[k].mean if k in by_key else 0 for k in keys], width,
                   yerr=[by_key[k].stddev if k in by_key else 0 for k in keys], capsize=3, label=model)
        ax.set_xticks([k + width * (len(models) - 1) / 2 for k in range(len(keys))])
        ax.set_xticklabels([f"{t}\nfa{fa}" for t, _, fa in keys])
        ax.set_ylabel("tokens/s")
        ax.set_title(partition)
        ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path)
    return path
