"""``rigctl compare``: paired eval gaps with intervals and tests, bench and load ratios; rendering only,
the work is in :mod:`rigctl.analysis.compare`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from rigctl.cli.common import ResultsOption, console, err_console, finite, results_store
from rigctl.cli.render import outside_text
from rigctl.errors import ConfigError

if TYPE_CHECKING:  # rigctl.analysis.compare pulls in the bench and pydantic: imported where used
    from rigctl.analysis.compare import Comparison
    from rigctl.analysis.habits import RunHabits

# No default here: rigctl.stats' (the report's too) applies, and importing it to show one costs numpy.
SeedOption = Annotated[int | None, typer.Option(help="Bootstrap seed (default: the one the report uses).")]
ResamplesOption = Annotated[int | None, typer.Option(help="Bootstrap resamples (default: as the report draws).")]


def _share(count: int, total: int) -> str:
    return f"{count}/{total} ({count / total:.0%})" if total else "-"


def _labels(counts: dict[str, int], limit: int = 4) -> str:
    items = list(counts.items())
    text = ", ".join(f"{k} {v}" for k, v in items[:limit])
    return text + (f", +{len(items) - limit} more" if len(items) > limit else "") if items else "-"


def _test_cells(gap) -> list[str]:
    """b / c (discordant questions) and the exact test's p-value of a gap."""
    from rigctl.analysis.format import p_text

    test = gap.test
    if test is None:
        return ["-", "-"]
    counts = f"{test.b} / {test.c}" if test.b is not None else "graded"
    return [counts, p_text(test.p)]


def _verdict_cell(gap, margin: float | None, p: float | None = None) -> str:
    from rigctl.stats import verdict_text

    return verdict_text(gap.verdict(p), margin) if margin is not None else "-"


def print_eval_comparison(result: Comparison) -> None:
    from rigctl.analysis.format import p_text, points, ratio_text
    from rigctl.hostside.scorers import GSM8K_SCORES

    for index, pair in enumerate(result.pairs):
        title = f"{pair.b.name} ({pair.b.label}) - {pair.a.name} ({pair.a.label}): task {pair.task}"
        named = any(v.scoring.metric != "score" for v in pair.variants)
        title += f", score {GSM8K_SCORES['score']}" if named else ""
        if pair.forced:
            err_console.print(outside_text(f"warning: compared with --force: {pair.forced}"))
        if pair.only_a or pair.only_b:
            err_console.print(outside_text(f"note: {pair.only_a} questions only in {pair.a.name}, {pair.only_b} "
                                           f"only in {pair.b.name}; left out"))
        table = Table(title=outside_text(title))
        columns = ["set", "n", "A", "B", "B - A, points (95%)", "b / c", "p (exact)"]
        columns += [f"±{pair.margin:g} points"] if pair.margin is not None else []
        for column in columns:
            table.add_column(column, justify="left" if column == "set" else "right")
        recorded = pair.recorded
        for gap in [*recorded.sets, recorded.overall]:
            cells = [outside_text(gap.set), str(gap.n), f"{gap.score_a:.3f}", f"{gap.score_b:.3f}", points(gap.gap),
                     *_test_cells(gap)]
            cells += [_verdict_cell(gap, pair.margin)] if pair.margin is not None else []
            table.add_row(*cells, style="bold" if gap.set == "overall" else None)
        console.print(table)
        if pair.replicate is not None:
            noise = pair.replicate
            console.print(outside_text(
                f"replicate {noise.run.name}: disagrees with A on {ratio_text(noise.disagreement)} of {noise.n} "
                f"questions (A and B: {ratio_text(pair.disagreement) if pair.disagreement else '-'}); its gap "
                f"{points(noise.gap)} points: the A/B gap is " +
                ("within replicate noise" if pair.within_noise else "clearly larger than replicate noise")))
        if len(result.pairs) > 1:
            console.print(f"overall p (Holm-adjusted across the {len(result.pairs)} pairs): "
                          f"{p_text(result.holm[index])}", markup=False, highlight=False)
        if len(pair.variants) > 1:
            sens = Table(title="sensitivity: the overall gap under each switch" +
                         (" and by lm-eval's scores" if named else ""))
            for column in ("scoring", "n", "A", "B", "B - A, points (95%)", "moved"):
                sens.add_column(column, justify="left" if column == "scoring" else "right")
            base = recorded.overall.gap.estimate
            for variant in pair.variants:
                overall = variant.overall
                moved = (overall.gap.estimate - base) * 100
                sens.add_row(outside_text(variant.label), str(overall.n), f"{overall.score_a:.3f}",
                             f"{overall.score_b:.3f}", points(overall.gap),
                             "" if variant is recorded else f"{moved:+.1f}")
            console.print(sens)
    if len(result.runs) > 2:
        matrix = Table(title="overall gap, column - row, points (95%)")
        matrix.add_column("run")
        for run in result.runs:
            matrix.add_column(outside_text(run.label), justify="right")
        for run, row in zip(result.runs, result.matrix(), strict=True):
            matrix.add_row(outside_text(run.label), *("-" if gap is None else points(gap.gap) for gap in row))
        console.print(matrix)


def _clip(text: str, width: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def print_flips(result: Comparison) -> None:
    """Per pair: right→wrong and wrong→right counts per set, then every flipped question with both replies."""
    from rigctl.analysis.compare import flip_counts

    for pair in result.pairs:
        counts = Table(title=outside_text(f"flips, {pair.a.name} → {pair.b.name} (as recorded)"))
        for column in ("set", "right→wrong", "wrong→right"):
            counts.add_column(column, justify="left" if column == "set" else "right")
        for count in flip_counts(pair.flips, [g.set for g in pair.recorded.sets]):
            counts.add_row(outside_text(count.set), str(count.right_to_wrong), str(count.wrong_to_right),
                           style="bold" if count.set == "overall" else None)
        console.print(counts)
        if not pair.flips:
            continue
        table = Table(title=outside_text(f"flipped questions: A = {pair.a.name}, B = {pair.b.name}"))
        for column in ("set", "id", "flip", "A replied", "B replied"):
            table.add_column(column, overflow="fold")
        for flip in pair.flips:
            table.add_row(outside_text(flip.set), outside_text(flip.id), flip.direction,
                          outside_text(_clip(flip.reply_a)), outside_text(_clip(flip.reply_b)))
        console.print(table)
        a_file, b_file = pair.files
        console.print(outside_text(f"replies in full: {a_file} and {b_file}"), soft_wrap=True)


def print_plan(result: Comparison) -> None:
    """The smallest gap each pair can detect (two-sided 5 %, 80 % power) with its observed discordance,
    at the questions in hand and at multiples of them."""
    from rigctl.analysis.compare import PLAN_SCALES, plan
    from rigctl.analysis.format import gap_points

    table = Table(title="smallest gap detectable at 80 % power (two-sided 5 %), from the observed discordance")
    for column in ("pair", "set", "n", "discordant", *(f"{k}x n" if k > 1 else "at n" for k in PLAN_SCALES)):
        table.add_column(column, justify="left" if column in ("pair", "set") else "right")
    for row in plan(result):
        discordant = f"{row.discordant} ({row.discordance:.0%})" if row.discordant is not None else "graded"
        table.add_row(outside_text(f"{row.pair.b.name} - {row.pair.a.name}"), outside_text(row.gap.set),
                      str(row.gap.n), discordant,
                      *(gap_points(g) for g in row.detectable), style="bold" if row.gap.set == "overall" else None)
    console.print(table)


def print_habits(habits: list[RunHabits]) -> None:
    table = Table(title="answer habits")
    for column in ("run", "set", "n", "predicted", "gold", "cut off", "no tool call", "look like missed calls"):
        table.add_column(column)
    for run in habits:
        for s in run.sets:
            # The run's label, its sets and the answers it recorded are the record's text.
            table.add_row(outside_text(run.run.label), outside_text(s.set), str(s.n),
                          outside_text(_labels(s.predicted)), outside_text(_labels(s.gold)),
                          _share(s.cutoff, s.n), _share(s.toolless, s.tool_rows),
                          str(s.missed_calls) if s.tool_rows else "-")
    console.print(table)


def print_load_comparison(stored, **bootstrap: int) -> None:
    from rigctl.analysis.format import ratio_text
    from rigctl.bench.load import compare_load

    if len(stored) != 2:
        raise ConfigError(f"a load comparison needs two load runs, got {len(stored)}")
    a, b = stored
    table = Table(title=outside_text(f"load: B {b.host}/{b.id} / A {a.host}/{a.id}, level by level"))
    for column in ("concurrency", "A output t/s", "B output t/s", "output t/s B / A (95%)", "TTFT B / A (95%)",
                   "TPOT B / A (95%)", "errors A, B"):
        table.add_column(column, justify="right")
    for level in compare_load(a, b, **bootstrap):
        table.add_row(str(level.concurrency), f"{level.a.output_tps:.2f}", f"{level.b.output_tps:.2f}",
                      ratio_text(level.output_tps), ratio_text(level.ttft), ratio_text(level.tpot),
                      f"{level.a.errors}, {level.b.errors}")
    console.print(table)


def compare(
    runs: Annotated[list[str], typer.Argument(help="Runs by id, host/id or directory (two or more; one bench run "
                                                    "with two models, or one kld run, also works).")],
    force: Annotated[bool, typer.Option("--force", help="Compare eval runs of different task files or datasets.")
                     ] = False,
    cutoff_as_right: Annotated[bool, typer.Option("--cutoff-as-right", help="Also score every cut-off reply as right."
                                                  )] = False,
    toolless_as_right: Annotated[bool, typer.Option("--toolless-as-right",
                                                    help="Also score every reply without a tool call as right.")
                                 ] = False,
    exclude: Annotated[list[str] | None, typer.Option("--exclude", help="Also leave out these sets (repeat or "
                                                                        "comma-separate).")] = None,
    by: Annotated[str, typer.Option(help="Bench runs: sides by auto, run, model or build.")] = "auto",
    flips: Annotated[bool, typer.Option("--flips", help="Also list the questions that flipped (right→wrong, "
                                                        "wrong→right) with both replies.")] = False,
    margin: Annotated[float | None, typer.Option(
        "--equivalence-margin", metavar="POINTS",
        callback=finite,
        help="Test equivalence within ±POINTS (TOST): says equivalent, different, or not shown either way.")] = None,
    plan: Annotated[bool, typer.Option("--plan", help="Also print the smallest gap detectable at 80 % power "
                                                      "with these runs' discordance, at n and more questions.")
                    ] = False,
    replicate: Annotated[str | None, typer.Option(
        "--replicate", metavar="RUN",
        help="A second run of A's artifact: its disagreement with A is set beside the A/B difference, which is "
             "flagged when not clearly larger than that noise.")] = None,
    results: ResultsOption = None,
    seed: SeedOption = None,
    resamples: ResamplesOption = None,
) -> None:
    """Paired per-question gaps with 95% bootstrap intervals per set and overall (a matrix for more than
    two runs), McNemar's exact test (right/wrong) or a sign-flip test (graded) with the discordant counts,
    how the gap moves under each sensitivity switch, and answer habits; for bench runs, t/s ratios per
    test with intervals from the per-repetition samples."""
    from rigctl.analysis.compare import compare_runs, effective_flags
    from rigctl.analysis.format import ratio_text
    from rigctl.analysis.habits import answer_habits
    from rigctl.analysis.speed import compare_bench_runs

    bootstrap = {k: v for k, v in {"seed": seed, "resamples": resamples}.items() if v is not None}
    store = results_store(results)
    stored = [store.find(ref) for ref in runs]
    for run in stored:  # whatever the kind: a figure measured under other settings than the profile's
        for flag in effective_flags(run):
            console.print(outside_text(f"effective configuration of {run.host}/{run.id}: {flag}"), style="yellow")
    if all(run.record.kind == "load" for run in stored):
        print_load_comparison(stored, **bootstrap)
        return
    if all(run.record.kind == "kld" for run in stored):
        from rigctl.cli.eval import print_kld

        print_kld(stored, **bootstrap)
        return
    if all(run.record.kind == "bench" for run in stored):
        bench = compare_bench_runs(stored, by=by, **bootstrap)
        table = Table(title=outside_text(f"tokens/s: {bench.b} / {bench.a}"))
        for column in ("test", "settings", f"A: {bench.a}", f"B: {bench.b}", "B / A (95%)"):
            table.add_column(outside_text(column), justify="left" if column in ("test", "settings") else "right")
        for r in bench.ratios:
            table.add_row(outside_text(r.test), outside_text(f"{r.config} fa{r.flash_attn}"), f"{r.mean_a:.2f}",
                          f"{r.mean_b:.2f}", ratio_text(r.ratio))
        console.print(table)
        if not bench.ratios:
            raise ConfigError(f"no test with equal settings on both sides ({bench.a} vs {bench.b})")
        return
    sets = tuple(s for item in exclude or [] for s in item.split(",") if s)
    result = compare_runs(stored, cutoff_as_right=cutoff_as_right, toolless_as_right=toolless_as_right,
                          exclude=sets, force=force, exclude_origin="--exclude", **bootstrap,
                          margin=margin, replicate=store.find(replicate) if replicate else None)
    print_eval_comparison(result)
    if flips:
        print_flips(result)
    if plan:
        print_plan(result)
    print_habits([answer_habits(run) for run in stored])
