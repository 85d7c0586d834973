"""``rigctl eval run|tasks|fetch``: rendering only; the work is in :mod:`rigctl.evals`."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from rigctl.cli.common import ResultsOption, console, err_console, finite, load_inventory, results_store
from rigctl.errors import ConfigError
from rigctl.hostside.scorers import GSM8K_SCORES

app = typer.Typer(no_args_is_help=True, help="Quality evals (GSM8K, BFCL simple, choice suites) against a server.")


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def print_summary(summary: dict[str, Any], scorer: str, title: str) -> None:
    table = Table(title=title)
    scores = list(GSM8K_SCORES) if scorer == "gsm8k" else ["score"]
    columns = ["set", "n", *(GSM8K_SCORES[key] if scorer == "gsm8k" else key for key in scores), "cut-offs"]
    columns += ["tool-less", "missed calls"] if scorer == "bfcl_simple" else []
    for column in columns:
        table.add_column(column, justify="left" if column == "set" else "right")

    def row(name: str, block: dict[str, Any]) -> list[str]:
        cells = [name, str(block["n"]), *(_fmt(block.get(key)) for key in scores)]
        cells += [str(block["cutoffs"])]
        cells += [str(block.get("toolless", 0)), str(block.get("missed_calls", 0))] if scorer == "bfcl_simple" else []
        return cells

    for name, block in summary["sets"].items():
        table.add_row(*row(name, block))
    if len(summary["sets"]) > 1:
        overall = summary["overall"]
        table.add_row(*row("overall", overall), end_section=False)
        console.print(table)
        console.print(f"overall: {_fmt(overall['score'])} over questions, {_fmt(overall['macro'])} over sets",
                      highlight=False)
        return
    console.print(table)


class _Bar:
    """A progress bar with ETA and the running score."""

    def __init__(self, total: int, done: int):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[score]}"), console=console, transient=False)
        self.bar = self.progress.add_task("eval", total=total, completed=done, score="")
        self.scored, self.score_sum = 0, 0.0  # this session's answers: a running mean, the same cost each answer

    def answer(self, row: dict[str, Any], done: int, total: int) -> None:
        self.scored += 1
        self.score_sum += float(row["score"])
        score = f"score {self.score_sum / self.scored:.3f}"
        self.progress.update(self.bar, completed=done, total=total, score=score)

    def job(self, info: Any) -> None:
        self.progress.update(self.bar, completed=info.done, total=info.total or None, score=info.message)


@app.command("run")
def eval_run(
    task: Annotated[str | None, typer.Option("--task", "-t", help="Shipped task name (see `rigctl eval tasks`) "
                                             "or a task file.")] = None,
    host: Annotated[list[str] | None, typer.Option(
        "--host", help="Inventory host (with --server). Repeat the pair to fan out over several servers of "
                       "the same artifact and build: one run, questions dealt to whichever server is free.")] = None,
    server: Annotated[list[str] | None, typer.Option("--server", "-s", help="llama_server instance on the "
                                                                              "--host before it.")] = None,
    url: Annotated[str | None, typer.Option("--url", help="Server URL: any OpenAI-compatible endpoint, or an "
                                            "override for --host/--server.")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", help="File holding the bearer key ('-': stdin; else $RIGCTL_API_KEY, else the "
        "inventory's). Never the key itself on the command line, where `ps` shows it.")] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="Requests in flight.")] = 8,
    limit: Annotated[int | None, typer.Option("--limit", "-n", min=1, help="First N questions of each set.")] = None,
    resume: Annotated[str | None, typer.Option("--resume", help="Finish a stopped run (id, host/id or path).")]
    = None,
    remote: Annotated[bool, typer.Option("--remote", help="Run as a detached job on the host; pull the results.")]
    = False,
    thinking: Annotated[bool, typer.Option("--thinking", help="Let the model think (reasoning kept apart).")]
    = False,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed (greedy anyway).")] = 1234,
    timeout: Annotated[float, typer.Option("--timeout", min=1, callback=finite, help="Seconds per request.")] = 600.0,
    results: Annotated[Path | None, typer.Option("--results", envvar="RIGCTL_RESULTS",
                                                 help="Results store (default ./results).")] = None,
) -> None:
    """Run a task against one server, or fanned out over several that serve the same artifact and build:
    N requests at a time per server, greedy, thinking off, every answer kept with the server that gave it."""
    from rigctl.evals import runner
    from rigctl.evals.fanout import FanOut
    from rigctl.evals.target import inventory_targets, url_target
    from rigctl.evals.tasks import load_task
    from rigctl.results.store import ResultsStore, iter_jsonl

    store = ResultsStore(results)
    api_key = read_api_key(api_key_file)
    if remote and api_key:
        raise ConfigError("--remote asks the server with the key the llama_server role installed on the host; "
                          "--api-key-file and RIGCTL_API_KEY are for runs from here")
    hosts, servers = host or [], server or []
    if len(hosts) != len(servers):
        raise ConfigError(f"--host and --server go in pairs (or give --url alone): got {len(hosts)} --host and "
                          f"{len(servers)} --server")
    if len(hosts) > 1 and (url or remote):
        raise ConfigError(f"a fan-out over {len(hosts)} servers takes neither --url nor --remote")
    if hosts:
        from rigctl.fleet.drain import admitted, refuse_drained

        inventory = load_inventory()
        pairs = [(inventory.host(h), s) for h, s in zip(hosts, servers, strict=True)]
        kept, skipped = admitted(pairs, lambda pair: pair[0], "the eval")
        if not kept:
            refuse_drained([pair[0] for pair in pairs], "the eval")
        for name, why in skipped.items():
            err_console.print(f"skipped {name}: {why}", markup=False, highlight=False)
        targets = inventory_targets(kept, url=url, api_key=api_key, facts=not resume)
    elif url:
        targets = [url_target(url, api_key=api_key)]
    elif resume:
        targets = runner.recorded_targets(store.find(resume), load_inventory, api_key)
    else:
        raise ConfigError("give --host and --server, or --url")
    fanout = FanOut.of(targets) if len(targets) > 1 and not resume else FanOut(tuple(targets))
    target = fanout.first
    endpoints = fanout.endpoints

    if resume:
        if remote:
            raise ConfigError("--resume runs from here; a remote run is redone with --remote")
        run, loaded, options = runner.resume_run(store, resume, endpoints)
        console.print(f"resuming {run.ref}: {loaded.name} against {fanout.describe()}", highlight=False)
    else:
        if task is None:
            raise ConfigError("--task is required (or --resume RUN)")
        options = runner.Options(concurrency=concurrency, seed=seed, thinking=thinking, timeout=timeout,
                                 retry=runner.retry_for(fanout.targets))
        with console.status(f"loading {task} and its datasets"):
            loaded = load_task(task, limit=limit)
        if loaded.deviations:
            console.print(f"note: not {loaded.deviations['from']}: {'; '.join(loaded.deviations['settings'])} "
                          f"(the task says why: {loaded.deviations['reason']})", markup=False, highlight=False)
        if remote:
            from rigctl.evals.remote import run_remote

            console.print(f"{loaded.name}: {len(loaded.questions)} questions, job on {target.host}", highlight=False)
            bar = _Bar(len(loaded.questions), 0)
            with bar.progress:
                pulled = run_remote(loaded, target, options, store, limit=limit, on_progress=bar.job)
            summary = pulled.record.extra.get("summary") or {}
            print_summary(summary, loaded.scorer, f"{loaded.name} on {target.endpoint} (job)")
            console.print(f"{pulled.host}/{pulled.id}: pulled to {pulled.path}", highlight=False)
            return
        run = runner.start(loaded, fanout.targets, store, options=options, limit=limit)
        console.print(f"{run.ref}: {loaded.name}, {len(loaded.questions)} questions against "
                      f"{fanout.describe()}, {options.concurrency} at a time" +
                      (" per server" if len(endpoints) > 1 else ""), highlight=False)
    done = len(runner.answered(run.path / "answers.jsonl"))
    bar = _Bar(len(loaded.questions), done)
    started = time.monotonic()
    with bar.progress:
        summary = runner.run(loaded, endpoints, run, options, on_answer=bar.answer)
    print_summary(summary, loaded.scorer, f"{loaded.name} on {fanout.describe()}")
    if len(endpoints) > 1:
        answers = Counter(row.get("server") for row in iter_jsonl(run.path / "answers.jsonl"))
        shares = ", ".join(f"{e.label} {answers[e.label]}" for e in endpoints)
        console.print(f"answers per server: {shares}", markup=False, highlight=False)
    console.print(f"{run.ref}: {time.monotonic() - started:.0f} s, answers in {run.path / 'answers.jsonl'}",
                  highlight=False)


def read_api_key(path: Path | None) -> str | None:
    """The key in ``path`` ('-': stdin), else $RIGCTL_API_KEY, else None (the inventory's is used); either
    without the whitespace around it (an env file's line break is not part of the key)."""
    if path is None:
        return os.environ.get("RIGCTL_API_KEY", "").strip() or None
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    except OSError as exc:
        raise ConfigError(f"--api-key-file {path}: {exc.strerror or exc}") from None
    key = text.strip()
    if not key:
        raise ConfigError(f"--api-key-file {path}: empty")
    return key


@app.command("tasks")
def eval_tasks() -> None:
    """The shipped task files: name, scorer, sets and where their data comes from."""
    from rigctl.evals.tasks import load_task, shipped_tasks

    table = Table(title="shipped eval tasks")
    for column in ("task", "scorer", "sets", "data", "description"):
        table.add_column(column)
    for path in shipped_tasks():
        spec = load_task(str(path), fetch=False).spec
        sources = [s.dataset for s in spec.sets] if spec.scorer == "choice" else [spec.dataset]
        data = "\n".join(f"{s.hf}@{s.revision[:12]}/{s.file}" if s.hf else (s.url or s.path or "") for s in sources)
        sets = ", ".join(s.name for s in spec.sets) if spec.scorer == "choice" else spec.name
        table.add_row(path.stem, spec.scorer, sets, data, spec.description)
    console.print(table)


@app.command("fetch")
def eval_fetch(task: Annotated[str, typer.Argument(help="Shipped task name or task file.")]) -> None:
    """Download and verify a task's datasets into the cache (for offline runs); records first hashes."""
    from rigctl.evals.tasks import load_task

    loaded = load_task(task)
    for file in loaded.files:
        console.print(f"{file.key}: {file.sha256} {file.path}", markup=False, highlight=False)
    console.print(f"{loaded.name}: {len(loaded.questions)} questions", highlight=False)


@app.command("kld")
def eval_kld(
    hosts: Annotated[str, typer.Option("--hosts", "-H", help="Hosts or groups, comma-separated.")],
    reference: Annotated[str, typer.Option("--reference", "-r", help="The reference artifact (bf16 or Q8_0).")],
    models: Annotated[str, typer.Option("--models", "-m", help="Quantised artifacts, comma-separated.")],
    text: Annotated[Path, typer.Option("--text", help="The text to score (a file here; shipped and hashed).")],
    ctx: Annotated[int, typer.Option("--ctx", "-c", help="Tokens per chunk (llama-perplexity -c).")] = 512,
    chunks: Annotated[int | None, typer.Option("--chunks", help="Chunks to score (default: all the text has).")]
    = None,
    batch: Annotated[int | None, typer.Option("--batch", "-b", help="llama-perplexity -b.")] = None,
    threads: Annotated[int | None, typer.Option("--threads", "-t", help="llama-perplexity -t.")] = None,
    ngl: Annotated[int | None, typer.Option("--ngl", help="GPU layers (llama-perplexity -ngl).")] = None,
    max_logits_gib: Annotated[float, typer.Option(
        "--max-logits-gib", callback=finite,
        help="Refuse when the reference's logits file could grow past this.")] = 16.0,
    keep_servers: Annotated[bool, typer.Option("--keep-servers", help="Leave llama-server instances running.")]
    = False,
    wait: Annotated[bool, typer.Option("--wait", help="Stream progress, pull and print the results.")] = False,
    results: ResultsOption = None,
) -> None:
    """KL divergence of quantised artifacts against their reference with llama-perplexity, as a job on each
    host: mean KLD, its 99th percentile and the same-top-1 share, with intervals over the text's chunks."""
    from rigctl import jobs
    from rigctl.cli.render import follow_started
    from rigctl.evals.kld import KLD_TASK, parse_spec, start_kld

    spec = parse_spec({"hosts": [h for h in hosts.split(",") if h], "reference": reference,
                       "models": [m for m in models.split(",") if m], "text": text, "ctx": ctx, "chunks": chunks,
                       "batch": batch, "threads": threads, "ngl": ngl, "max_logits_gib": max_logits_gib,
                       "stop_servers": not keep_servers}, "command line")
    jobs.task_sources(KLD_TASK)
    inventory = load_inventory()
    started = start_kld(inventory, spec)
    store = results_store(results) if wait else None
    ok, done = follow_started(inventory, started, store)
    if store is not None and done:
        print_kld([store.find(f"{f.job.host}/{f.job.id}") for f in done])
    if not ok:
        raise typer.Exit(1)


def print_kld(runs: list[Any], **bootstrap: int) -> None:
    """Each KLD run's artifacts against their reference, then the paired gaps between runs and artifacts that
    scored the same tokens (hosts against each other, artifacts against each other)."""
    from rigctl.analysis.kld import (
        GAP_HEADER,
        ROW_HEADER,
        gap_cells,
        kld_results,
        paired_gaps,
        result_cells,
    )

    scored = [(run, result) for run in runs for result in kld_results(run, **bootstrap)]
    if not scored:
        raise ConfigError("no KLD results in " + ", ".join(f"{r.host}/{r.id}" for r in runs))
    table = Table(title=f"KL divergence against the reference, llama-perplexity's numbers with 95% intervals "
                        f"over chunks ({scored[0][1].corpus}, -c {scored[0][1].ctx})")
    for column in ROW_HEADER:
        table.add_column(column, justify="left" if column in ("host", "artifact", "vs") else "right")
    for _, result in scored:
        table.add_row(*result_cells(result))
    console.print(table)
    gaps = paired_gaps(scored, **bootstrap)
    if gaps:
        table = Table(title="paired on the same tokens")
        for column in GAP_HEADER:
            table.add_column(column, justify="left" if column == "B - A" else "right")
        for gap in gaps:
            table.add_row(*gap_cells(gap))
        console.print(table)
