"""The report's quality sections: scores per task with intervals, the campaign's comparisons (paired gaps,
tests, equivalence, the forest plot), flipped questions, sensitivity switches and answer habits."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rigctl.analysis.campaign import LoadedCampaign, Located
from rigctl.analysis.compare import (
    OVERALL,
    PairComparison,
    Scoring,
    SetGap,
    answers_path,
    check_sets,
    compare_pair,
    flip_counts,
    load_answers,
    other_scores,
    run_scores,
)
from rigctl.analysis.format import gap_points, p_text, points, ratio_text
from rigctl.analysis.habits import answer_habits
from rigctl.analysis.report.markdown import NOT_PULLED, Links, md_table, quoted
from rigctl.charts import new_figure, save_png
from rigctl.errors import RigctlError
from rigctl.hostside.scorers import GSM8K_SCORES
from rigctl.results.record import ANSWERS_FILE, RUN_FILE
from rigctl.results.store import StoredRun
from rigctl.stats import Interval, holm, verdict_text

if TYPE_CHECKING:
    pass


def detectable_text(compared: list[Compared]) -> str:
    """The scope line's power clause: per comparison, the smallest gap detectable at 80 % power."""
    parts = []
    for c in compared:
        gap = c.pair.recorded.overall
        test = gap.test
        basis = f"{test.b + test.c} of {gap.n} discordant" if test and test.b is not None else f"n={gap.n}"
        detectable = gap_points(gap.detectable)
        parts.append(f"{c.name} on {c.evaluation} {detectable}{' points' if detectable.startswith('±') else ''} "
                     f"({basis})")
    if not parts:
        return ""
    return ("Smallest gap detectable at 80 % power (two-sided 5 %, from the observed discordance): "
            + "; ".join(parts) + ".")


def quality_section(loaded: LoadedCampaign, found: Located, links: Links, out_dir: Path,
                     charts: list[Path]) -> list[str]:
    campaign = loaded.campaign
    lines = ["## Quality", ""]
    for evaluation in campaign.evals:
        pulled = [(t, found.evals[(evaluation.name, t.id)]) for t in evaluation.runs]
        pulled = [(t, r) for t, r in pulled if r is not None]
        lines += [f"### {evaluation.name} (task {found.task_names.get(evaluation.name, evaluation.task)})", ""]
        if not pulled:
            lines += [NOT_PULLED, ""]
            continue
        lines += _run_notes(pulled, links, deviation_text)
        lines += _run_notes(pulled, links, lambda run: request_text(run.record.task))
        scores = {t.id: run_scores(r, resamples=campaign.resamples, seed=campaign.seed) for t, r in pulled}
        sets = sorted({g.set for gaps in scores.values() for g in gaps if g.set != OVERALL})
        # GSM8K runs carry lm-eval's two scores beside rigctl's: each gets its own named column.
        metrics = other_scores([row for _, r in pulled for row in load_answers(r)])
        named = [f"overall ({GSM8K_SCORES['score']})"] if metrics else ["overall"]
        header = ["model", "host", *(sets if len(sets) > 1 else []), *named,
                  *(f"overall ({GSM8K_SCORES[m]})" for m in metrics), "n"]
        rows = []
        overall: list[tuple[str, Interval]] = []
        for target, run in pulled:
            by_set = {g.set: g for g in scores[target.id]}
            file = [answers_path(run)]
            cells = [links.number(ratio_text(by_set[s].gap), file) if s in by_set else "-"
                     for s in (sets if len(sets) > 1 else [])]
            total = by_set[OVERALL]
            others = [run_scores(run, resamples=campaign.resamples, seed=campaign.seed, metric=m)[-1].gap
                      for m in metrics]
            rows.append([campaign.label(target.artifact), target.host, *cells,
                         links.number(ratio_text(total.gap), file),
                         *(links.number(ratio_text(gap), file) for gap in others), links.number(str(total.n), file)])
            overall.append((campaign.target_label(target.id), total.gap))
        lines += md_table(header, rows, align="ll")
        chart = out_dir / f"quality-{evaluation.name}.png"
        _quality_chart(chart, overall, f"{evaluation.name}: overall score (95% interval)")
        charts.append(chart)
        lines += ["", f"![{evaluation.name}]({chart.name})", ""]
    return lines


def deviation_text(run: StoredRun) -> str | None:
    """What a run's record says departs from its instrument's own request (a BFCL task with a token limit, say):
    its scores are then not the instrument's, and the report says so before showing them."""
    deviations = run.record.extra.get("deviations")
    if not isinstance(deviations, dict) or not deviations.get("settings"):
        return None
    return (f"**Not {deviations.get('from', 'the instrument')}**: "
            f"{'; '.join(map(str, deviations['settings']))}. Why: {deviations.get('reason') or 'not said'}.")


def _run_notes(pulled: Sequence[tuple[Any, StoredRun]], links: Links,
               note: Callable[[StoredRun], str | None]) -> list[str]:
    """One line per distinct note the runs carry, linked to the records of the runs that carry it."""
    seen: dict[str, list[StoredRun]] = {}
    for _, run in pulled:
        if (text := note(run)) is not None:
            seen.setdefault(text, []).append(run)
    return [line for text, runs in seen.items()
            for line in (f"{text} ({links.number('run record', [r.path / RUN_FILE for r in runs])})", "")]


def request_text(task: Any) -> str | None:
    """Which request produced a GSM8K run's numbers, from its record's task (None for other scorers). A record
    from before requests were stamped ran rigctl's own, then the only one."""
    if task is None or task.scorer != "gsm8k":
        return None
    request = task.request or {"name": "rigctl"}
    scoring = ", ".join(f"{name} {version}" for name, version in sorted(task.instruments.items())) or "lm-eval 0.4"
    if request.get("name") == "lm-eval":
        turns = "as chat turns" if request.get("fewshot_as_multiturn") else "in one user turn"
        return (f"**Request: {request.get('reproduces', 'lm-eval')}'s own** ({request.get('num_fewshot')}-shot "
                f"{turns}, stop {', '.join(map(str, request.get('stop') or []))}, {request.get('max_tokens')} "
                f"tokens); the lm-eval columns are its scores ({scoring}), to set beside its published numbers.")
    limit = request.get("max_tokens")
    return (f"**Request: rigctl's own** (zero-shot, no stop sequences{f', {limit} tokens' if limit else ''}); "
            f"the lm-eval columns apply {scoring}'s scoring to it, so they do not compare with lm-eval's published "
            f"gsm8k numbers (task option `request: lm-eval` asks as lm-eval does).")


def _quality_chart(path: Path, overall: list[tuple[str, Interval]], title: str) -> None:
    fig, ax = new_figure(figsize=(6, 1.3 + 0.45 * len(overall)))
    ys = range(len(overall))
    est = [i.estimate for _, i in overall]
    err = [[i.estimate - i.low for _, i in overall], [i.high - i.estimate for _, i in overall]]
    ax.barh(list(ys), est, xerr=err, capsize=4, color=[f"C{k}" for k in ys])
    ax.set_yticks(list(ys), [name for name, _ in overall], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("score")
    ax.set_title(title, fontsize=10)
    save_png(fig, path)


@dataclass(frozen=True)
class Compared:
    name: str
    section: str
    evaluation: str
    pair: PairComparison
    holm: float = float("nan")  # the overall p-value, Holm-adjusted across the campaign's comparisons

    @property
    def verdict(self) -> str:
        """Equivalent within the margin, different (by the Holm-adjusted p), or not shown either way."""
        gap = self.pair.recorded.overall
        return verdict_text(gap.verdict(self.holm), self.pair.margin) if self.pair.margin is not None else "-"


def compared_pairs(loaded: LoadedCampaign, found: Located) -> tuple[list[Compared], list[str]]:
    campaign = loaded.campaign
    scoring = Scoring(cutoff_as_right=campaign.sensitivity.cutoff_as_right,
                      toolless_as_right=campaign.sensitivity.toolless_as_right,
                      exclude=tuple(campaign.sensitivity.exclude))
    out: list[Compared] = []
    problems: list[str] = []
    try:  # the excluded sets are the campaign's: each must be in one of its runs, not in every pair's
        check_sets(scoring.exclude, [run for run in found.evals.values() if run is not None], "sensitivity.exclude")
    except RigctlError as exc:
        problems.append(str(exc))
    for comparison in campaign.comparisons:
        for evaluation in campaign.evals:
            if comparison.evals and evaluation.name not in comparison.evals:
                continue
            run_a = found.evals.get((evaluation.name, comparison.a))
            run_b = found.evals.get((evaluation.name, comparison.b))
            if run_a is None or run_b is None:
                continue
            replicate = found.evals.get((evaluation.name, comparison.replicate)) if comparison.replicate else None
            if comparison.replicate and replicate is None:
                problems.append(f"{comparison.name} on {evaluation.name}: its replicate {comparison.replicate} "
                                f"is not pulled yet (the gap is shown without it)")
            try:
                pair = compare_pair(run_a, run_b, scoring=scoring, resamples=campaign.resamples, seed=campaign.seed,
                                    margin=campaign.margin(comparison), replicate=replicate)
            except RigctlError as exc:  # a refusal (different tasks) is reported, not fatal to the report
                problems.append(f"{comparison.name} on {evaluation.name}: {exc}")
                continue
            out.append(Compared(comparison.name, comparison.section, evaluation.name, pair))
    adjusted = holm([c.pair.recorded.overall.test.p if c.pair.recorded.overall.test else float("nan") for c in out])
    return [dataclasses.replace(c, holm=p) for c, p in zip(out, adjusted, strict=True)], problems


def comparison_sections(loaded: LoadedCampaign, compared: list[Compared], problems: list[str],
                         links: Links, forest: Path | None = None) -> list[str]:
    lines: list[str] = []
    for section, title in SECTION_TITLES.items():
        items = [c for c in compared if c.section == section]
        if not items:
            continue
        lines += [f"## {title}", "", "A, B: the recorded score (for GSM8K rigctl's normalised one; lm-eval's "
                  "strict-match and flexible-extract gaps are under Sensitivity). "
                  "B - A in points (95% paired bootstrap interval), question by question; "
                  "b / c: questions A got right and B wrong / A wrong and B right; p: McNemar's exact test "
                  "(sign-flip permutation test for graded scores), and Holm-adjusted across all the campaign's "
                  "comparisons; verdict: TOST at 5 % against the equivalence margin, else the "
                  "Holm-adjusted test.", ""]
        replicated = any(c.pair.replicate for c in items)
        if replicated:
            lines += ["A/B disagree, replicate disagrees: the share of questions scored differently by A and B, "
                      "and by A and a second run of A (95% interval); replicate gap: that second run minus A. "
                      "A gap whose interval overlaps the replicate gap's is flagged: not clearly larger than "
                      "the noise of running twice.", ""]
        rows = []
        for c in items:
            gap = c.pair.recorded.overall
            files = list(c.pair.files)
            test = gap.test
            counts = f"{test.b} / {test.c}" if test and test.b is not None else "graded"
            verdict = c.verdict + ("; within replicate noise" if c.pair.within_noise else "")
            row = [c.name, c.evaluation, links.number(str(gap.n), files),
                   links.number(f"{gap.score_a:.3f}", files[:1]), links.number(f"{gap.score_b:.3f}", files[1:]),
                   links.number(points(gap.gap), files), links.number(counts, files),
                   links.number(p_text(test.p) if test else "-", files), p_text(c.holm)]
            if replicated:
                noise = c.pair.replicate
                replicate_files = [files[0], noise.run.path / ANSWERS_FILE] if noise else []
                row += [links.number(ratio_text(c.pair.disagreement), files) if c.pair.disagreement else "-",
                        links.number(ratio_text(noise.disagreement), replicate_files) if noise else "-",
                        links.number(points(noise.gap), replicate_files) if noise else "-"]
            rows.append([*row, verdict])
        holm_column = f"p (Holm, {len(compared)} comparison{'s' if len(compared) != 1 else ''})"
        noise_columns = ["A/B disagree", "replicate disagrees", "replicate gap, points"] if replicated else []
        lines += md_table(["comparison", "eval", "n", "A", "B", "B - A, points", "b / c", "p (exact)", holm_column,
                         *noise_columns, "verdict"], rows, align="ll")
        lines.append("")
    if forest is not None:
        lines += [f"![every comparison's gap with its interval and equivalence band]({forest.name})", ""]
    if problems:
        lines += ["Comparisons not made:", "", *(f"- {p}" for p in problems), ""]
    return lines


def _forest_plot(path: Path, compared: list[Compared]) -> None:
    """Every comparison's overall B - A (points) with its 95% bootstrap interval, the TOST's 90%
    interval where a margin is set, and the ±margin equivalence band behind it."""
    fig, ax = new_figure(figsize=(7, 1.4 + 0.5 * len(compared)))
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for row, c in enumerate(reversed(compared)):
        gap = c.pair.recorded.overall
        margin = c.pair.margin
        if margin is not None:
            ax.fill_between([-margin, margin], row - 0.4, row + 0.4, color="C2", alpha=0.18, linewidth=0,
                            label=once("equivalence band (±margin)"))
        if gap.gap.empty:
            continue
        est = gap.gap.estimate * 100
        ax.errorbar([est], [row], xerr=[[est - gap.gap.low * 100], [gap.gap.high * 100 - est]], fmt="o",
                    color="C0", capsize=4, label=once("B - A, 95% bootstrap interval"))
        equivalence = gap.equivalence
        if equivalence is not None and not math.isnan(equivalence.low):
            ax.plot([equivalence.low * 100, equivalence.high * 100], [row - 0.18] * 2, color="C1", linewidth=3,
                    label=once("90% interval of the TOST"))
    ax.axvline(0, color="0.4", linewidth=0.8)
    ax.set_yticks(range(len(compared)), [f"{c.name}\n{c.evaluation}: {c.verdict}" for c in reversed(compared)],
                  fontsize=8)
    ax.set_ylim(-0.7, len(compared) - 0.3)
    ax.set_xlabel("B - A, points")
    ax.set_title("paired differences: every comparison", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    save_png(fig, path)


def _flip_file(path: Path, c: Compared, links: Links) -> None:
    """Every flipped question of one comparison with both replies, for the report's flips links."""
    pair = c.pair
    file_a, file_b = pair.files
    lines = [f"# Flips: {c.name} on {c.evaluation}", "",
             f"A: {pair.a.label} ([answers]({links.rel(file_a)})); B: {pair.b.label} ([answers]({links.rel(file_b)})).",
             ""]
    for direction in ("right→wrong", "wrong→right"):
        group = [f for f in pair.flips if f.direction == direction]
        lines += [f"## {direction} ({len(group)})", ""]
        for flip in group:
            lines += [f"### {flip.set} / {flip.id}", "", f"A (score {flip.score_a:g}):", "", quoted(flip.reply_a),
                      "", f"B (score {flip.score_b:g}):", "", quoted(flip.reply_b), ""]
    path.write_text("\n".join(lines).rstrip() + "\n")


def flips_section(compared: list[Compared], links: Links, out_dir: Path) -> list[str]:
    rows = []
    for index, c in enumerate(compared, 1):
        flips_md = out_dir / f"flips-{index}.md"
        _flip_file(flips_md, c, links)
        files = [flips_md, *c.pair.files]
        for count in flip_counts(c.pair.flips, [g.set for g in c.pair.recorded.sets]):
            rows.append([c.name, c.evaluation, count.set, links.number(str(count.right_to_wrong), files),
                         links.number(str(count.wrong_to_right), files)])
    if not rows:
        return []
    return ["## Flips", "", "Questions that changed between A and B, as recorded; each count links to the "
            "list of those questions with both replies, then to the two answer files.", "",
            *md_table(["comparison", "eval", "set", "right→wrong", "wrong→right"], rows, align="lll"), ""]


def sensitivity_section(compared: list[Compared], links: Links) -> list[str]:
    rows = []
    for c in compared:
        if len(c.pair.variants) < 2:
            continue
        base = c.pair.recorded.overall.gap.estimate
        files = list(c.pair.files)
        for variant in c.pair.variants:
            gap: SetGap = variant.overall
            moved = "" if variant is c.pair.recorded or gap.gap.empty else f"{(gap.gap.estimate - base) * 100:+.1f}"
            rows.append([c.name, c.evaluation, variant.label, links.number(str(gap.n), files),
                         links.number(points(gap.gap), files), moved])
    if not rows:
        return []
    return ["## Sensitivity", "", "The overall gap when the sceptic's switches are applied, and for GSM8K under "
            "lm-eval's strict-match and flexible-extract in place of rigctl's normalised score (B - A, points).", "",
            *md_table(["comparison", "eval", "scoring", "n", "B - A, points", "moved"], rows, align="lll"), ""]


def habits_section(loaded: LoadedCampaign, found: Located, links: Links) -> list[str]:
    campaign = loaded.campaign
    rows = []
    for evaluation in campaign.evals:
        for target in evaluation.runs:
            run = found.evals.get((evaluation.name, target.id))
            if run is None:
                continue
            habits = answer_habits(run)
            file = [habits.file]
            for s in habits.sets:
                top = s.top_label
                rows.append([
                    campaign.target_label(target.id), evaluation.name, s.set, links.number(str(s.n), file),
                    links.number(f"{top[0]} {top[1]}", file) if top else "-",
                    links.number(", ".join(f"{k} {v}" for k, v in s.gold.items()), file) if s.gold else "-",
                    links.number(f"{s.cutoff}", file),
                    links.number(f"{s.toolless} of {s.tool_rows}", file) if s.tool_rows else "-",
                    links.number(str(s.missed_calls), file) if s.tool_rows else "-",
                ])
    if not rows:
        return []
    header = ["model", "eval", "set", "n", "most predicted", "gold", "cut off", "no tool call",
              "look like missed calls"]
    return ["## Answer habits", "", *md_table(header, rows, align="lll"), ""]


SECTION_TITLES = {"headline": "Head to head", "quantisation": "Quantisation cost", "qat": "What QAT is worth",
                  "other": "Other comparisons"}
