"""``rigctl bench run|summary|spec|server|load``: rendering only; the work is in :mod:`rigctl.bench` and
:mod:`rigctl.jobs`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from rigctl.cli.common import (
    ResultsOption,
    console,
    finite,
    load_inventory,
    parse_ints,
    parse_words,
    preload_inventory,
    results_store,
)
from rigctl.cli.preloading import INVENTORY_COMMANDS
from rigctl.cli.render import follow_started
from rigctl.errors import ConfigError

app = typer.Typer(no_args_is_help=True, help="Speed benches: llama-bench matrices, server speed, drafter race.")


@app.callback()
def bench_options(ctx: typer.Context) -> None:
    if ctx.invoked_subcommand in INVENTORY_COMMANDS["bench"]:
        preload_inventory()


@app.command("run")
def bench_run(
    spec_file: Annotated[Path | None, typer.Argument(help="YAML bench spec; flags override its keys.")] = None,
    hosts: Annotated[str | None, typer.Option("--hosts", "-H", help="Hosts or groups, comma-separated.")] = None,
    models: Annotated[str | None, typer.Option("--models", "-m", help="Artifacts, comma-separated.")] = None,
    p: Annotated[str | None, typer.Option("-p", help="Prompt lengths (pp), e.g. 512,2048.")] = None,
    n: Annotated[str | None, typer.Option("-n", help="Generation lengths (tg), e.g. 128.")] = None,
    r: Annotated[int | None, typer.Option("-r", help="Repetitions per test.")] = None,
    fa: Annotated[str | None, typer.Option("--fa", help="Flash attention: 0, 1 or 0,1.")] = None,
    ngl: Annotated[str | None, typer.Option("--ngl", help="GPU layers, e.g. 99.")] = None,
    t: Annotated[str | None, typer.Option("-t", help="Threads, e.g. 6.")] = None,
    ctk: Annotated[str | None, typer.Option("--ctk", help="K cache types, e.g. f16,q8_0.")] = None,
    ctv: Annotated[str | None, typer.Option("--ctv", help="V cache types.")] = None,
    d: Annotated[str | None, typer.Option("-d", help="Depths (tokens already in the context).")] = None,
    rounds: Annotated[int | None, typer.Option("--rounds", help="Cells per model.")] = None,
    order: Annotated[str | None, typer.Option("--order", help="alternate (A,B,A,B) or grouped.")] = None,
    cooldown: Annotated[float | None, typer.Option("--cooldown", callback=finite,
                                                   help="Start each cell at or below this °C.")] = None,
    no_cooldown: Annotated[bool, typer.Option("--no-cooldown", help="Do not wait for the GPU to cool.")] = False,
    cooldown_timeout: Annotated[float | None, typer.Option("--cooldown-timeout", callback=finite,
                                                           help="Max wait per cell, s.")] = None,
    cooldown_poll: Annotated[float | None, typer.Option("--cooldown-poll", callback=finite,
                                                        help="Seconds between readings.")] = None,
    clock_sample: Annotated[float | None, typer.Option("--clock-sample", callback=finite,
                                                       help="Seconds between GPU clock readings through a cell "
                                                            "(one more as it starts and ends).")] = None,
    min_sm_fraction: Annotated[float | None, typer.Option("--min-sm-fraction", callback=finite,
                                                          help="A cell whose busy SM clock fell below this share "
                                                               "of its max is throttled.")] = None,
    keep_servers: Annotated[bool, typer.Option("--keep-servers", help="Leave llama-server instances running.")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Stream progress and pull the results at the end.")] = False,
    results: ResultsOption = None,
) -> None:
    """Start a clock-gated llama-bench run as a detached job on each host: each cell waits for the cool-down
    threshold with no thermal or power clock-event reason active, and is marked throttled when its clock
    readings say heat or power held it back."""
    from rigctl import jobs
    from rigctl.bench.matrix import BENCH_TASK, load_spec, parse_spec, start_bench

    matrix = {k: v for k, v in {"p": parse_ints(p, "-p"), "n": parse_ints(n, "-n"), "r": r,
                                "fa": parse_ints(fa, "--fa"), "ngl": parse_ints(ngl, "--ngl"), "t": parse_ints(t, "-t"),
                                "ctk": parse_words(ctk), "ctv": parse_words(ctv), "d": parse_ints(d, "-d")}.items()
              if v is not None}
    cool = {k: v for k, v in {"threshold_c": cooldown, "timeout_s": cooldown_timeout,
                              "poll_s": cooldown_poll}.items() if v is not None}
    if no_cooldown:
        cool["threshold_c"] = None
    clocks = {k: v for k, v in {"sample_s": clock_sample, "min_sm_fraction": min_sm_fraction}.items()
              if v is not None}
    overrides: dict[str, Any] = {k: v for k, v in {"hosts": parse_words(hosts), "models": parse_words(models),
                                                   "rounds": rounds, "order": order}.items() if v is not None}
    if matrix:
        overrides["matrix"] = matrix
    if cool:
        overrides["cooldown"] = cool
    if clocks:
        overrides["clocks"] = clocks
    if keep_servers:
        overrides["stop_servers"] = False
    spec = load_spec(spec_file, overrides) if spec_file else parse_spec(overrides, "command line")
    jobs.task_sources(BENCH_TASK)  # read and parsed while the inventory loads
    inv = load_inventory()
    # The command's connection scope (see rigctl.cli.main.main): starting, following and pulling share one per host.
    started = start_bench(inv, spec)
    ok, _ = follow_started(inv, started, results_store(results) if wait else None)
    if not ok:
        raise typer.Exit(1)


# ----------------------------------------------------------------------------------------------- summary


@app.command("summary")
def bench_summary(
    runs: Annotated[list[str], typer.Argument(help="Run ids, host/id or run directories.")],
    merge: Annotated[bool, typer.Option("--merge", help="Summarise different hosts and builds together.")] = False,
    csv_file: Annotated[Path | None, typer.Option("--csv", help="Also write the summary as CSV here.")] = None,
    png_file: Annotated[Path | None, typer.Option("--png", help="Also draw a bar chart with error bars here.")] = None,
    md_file: Annotated[Path | None, typer.Option("--md", help="Also write the Markdown tables here.")] = None,
    results: ResultsOption = None,
) -> None:
    """Per test and model: mean ± stddev t/s, ratio between models, fa1/fa0, cold vs steady state, and
    the throttled cells, left out of the means (from the raw files)."""
    from rigctl.bench.matrix import load_run_samples, summarize, to_csv, to_markdown, to_png

    store = results_store(results)
    samples = [s for ref in runs for s in load_run_samples(store.find(ref))]
    rows = summarize(samples, merge=merge)
    markdown = to_markdown(rows, samples)
    console.print(markdown, markup=False, highlight=False, soft_wrap=True)
    if md_file:
        md_file.write_text(markdown)
    if csv_file:
        csv_file.write_text(to_csv(rows))
        console.print(f"wrote {csv_file}", highlight=False)
    if png_file:
        to_png(rows, png_file)
        console.print(f"wrote {png_file}", highlight=False)


# ----------------------------------------------------------------------------------------------- spec


@app.command("spec")
def bench_spec(
    host: Annotated[str, typer.Argument(help="Host from the inventory.")],
    baseline: Annotated[str, typer.Option("--baseline", "-b", help="Instance without drafting.")],
    drafters: Annotated[str | None, typer.Option(
        "--drafters", "-d", help="Drafting instances (default: all of the baseline's artifact).")] = None,
    prompts: Annotated[str | None, typer.Option("--prompts", help="Prompt kinds (default: all).")] = None,
    prompts_file: Annotated[Path | None, typer.Option("--prompts-file", help="YAML: kind -> chat messages.")] = None,
    repeats: Annotated[int, typer.Option("--repeats", "-n", help="Requests per prompt and contender.")] = 3,
    temperatures: Annotated[str, typer.Option("--temperatures", help="Comma-separated; 0 is greedy.")] = "0,0.8",
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per reply.")] = 256,
    no_start: Annotated[bool, typer.Option("--no-start", help="Do not start instances that are stopped.")] = False,
    results: ResultsOption = None,
) -> None:
    """The drafter race: speedup (geometric mean), acceptance and greedy byte-identity against no drafting."""
    from rigctl.bench.drafting import run_race, to_markdown

    try:
        temps = [float(t) for t in temperatures.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--temperatures {temperatures!r}: expected numbers separated by commas") from None

    def show(r) -> None:
        accepted = f", accepted {r.draft_n_accepted}/{r.draft_n}" if r.draft_n else ""
        console.print(f"  {r.contender} {r.prompt} t={r.temperature:g} #{r.repeat}: {r.tokens} tokens, "
                      f"{r.tokens_per_s:.2f} tok/s{accepted}", markup=False, highlight=False)

    result = run_race(load_inventory().host(host), baseline, parse_words(drafters), kinds=parse_words(prompts),
                      prompts_file=prompts_file, repeats=repeats, temperatures=temps, max_tokens=max_tokens,
                      start=not no_start, store=results_store(results), on_request=show)
    console.print(to_markdown(result.rows), markup=False, highlight=False, soft_wrap=True)
    for name, deltas in result.metrics.items():
        if deltas:
            console.print(f"{name}: " + ", ".join(f"{k.removeprefix('llamacpp:')}={v:g}" for k, v in deltas.items()),
                          markup=False, highlight=False, soft_wrap=True)
    console.print(f"run: {result.ref}", highlight=False)


# ----------------------------------------------------------------------------------------------- server


@app.command("server")
def bench_server(
    host: Annotated[str, typer.Argument(help="Host from the inventory.")],
    instance: Annotated[str, typer.Argument(help="llama_server instance on that host.")],
    prompt_lengths: Annotated[str, typer.Option("--prompt-lengths", help="Prompt tokens to sweep.")] = "128,512,1024",
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens generated per request.")] = 64,
    load_runs: Annotated[int, typer.Option("--load-runs", help="Restarts timed to /health 200.")] = 1,
    ctx_sizes: Annotated[str | None, typer.Option("--ctx-sizes", help="Context sizes for GPU memory "
                                                  "(stops the instance meanwhile), e.g. 4096,8192.")] = None,
    results: ResultsOption = None,
) -> None:
    """TTFT and decode t/s over a prompt-length sweep, model load time, GPU memory per context size."""
    from rigctl.bench.server import run_server_bench, to_markdown

    result = run_server_bench(
        load_inventory().host(host), instance, prompt_lengths=parse_ints(prompt_lengths, "--prompt-lengths") or [],
        max_tokens=max_tokens, load_runs=load_runs, ctx_sizes=parse_ints(ctx_sizes, "--ctx-sizes") or [],
        store=results_store(results), on_step=lambda m: console.print(f"  {m}", markup=False, highlight=False))
    console.print(to_markdown(result), markup=False, highlight=False, soft_wrap=True)
    console.print(f"run: {result.ref}", highlight=False)


# ----------------------------------------------------------------------------------------------- load


@app.command("load")
def bench_load(
    host: Annotated[str, typer.Argument(help="Host from the inventory.")],
    instance: Annotated[str, typer.Argument(help="llama_server instance on that host (its arguments, a probe's).")],
    concurrency: Annotated[str, typer.Option("--concurrency", "-c", help="Concurrent requests per level.")
                           ] = "1,2,4,8",
    requests: Annotated[int | None, typer.Option("--requests", "-n", help="Least requests per level (default 4 "
                                                                          "per client, at least 8).")] = None,
    max_requests: Annotated[int | None, typer.Option("--max-requests", help="Most requests per level, sent while "
                                                     "the intervals are wider than --precision (default 4x the "
                                                     "least).")] = None,
    precision: Annotated[float, typer.Option("--precision", callback=finite,
                                             help="Half-width asked of each level's 95 % intervals (throughput, "
                                                  "mean TPOT), relative.")] = 0.10,
    warmup: Annotated[int, typer.Option("--warmup", help="Warm-up requests per client before each level, in "
                                        "no figure.")] = 1,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens generated per request.")] = 32,
    slot_ctx: Annotated[int, typer.Option("--slot-ctx", help="Context tokens per slot of the probe.")] = 1024,
    level_timeout: Annotated[float, typer.Option("--level-timeout", callback=finite,
                                                 help="Stop sending a level after this, s.")] = 120.0,
    png_file: Annotated[Path | None, typer.Option("--png", help="Also draw the curve here.")] = None,
    results: ResultsOption = None,
) -> None:
    """A load curve: per concurrency level, after a warm-up, output t/s, requests/s, TTFT and TPOT p50/p95/p99
    (streamed), errors, 95 % intervals of throughput and mean TPOT, and the machine's other load, through a
    probe of the instance with a slot per client (the instance is stopped meanwhile); curves more clients
    cannot explain are flagged as interference."""
    from rigctl.bench.load import run_load, to_markdown, to_png

    result = run_load(load_inventory().host(host), instance,
                      concurrency=parse_ints(concurrency, "--concurrency") or [], requests=requests,
                      max_requests=max_requests, precision=precision, warmup=warmup,
                      max_tokens=max_tokens, slot_ctx=slot_ctx, level_timeout_s=level_timeout,
                      store=results_store(results),
                      on_step=lambda m: console.print(f"  {m}", markup=False, highlight=False))
    console.print(to_markdown(result.levels, f"{result.host}/{result.instance}"), markup=False, highlight=False,
                  soft_wrap=True)
    run = result.ref
    if png_file:
        to_png([(run, result.levels)], png_file, f"{run}: load curve")
        console.print(f"wrote {png_file}", highlight=False)
    console.print(f"run: {run}", highlight=False)
