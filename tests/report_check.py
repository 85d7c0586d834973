"""Recompute a campaign report's numbers from the raw files its links point at.

Each table cell of the report that is a number links to the raw files it came from; these helpers
parse the Markdown tables, follow the links and compute the number again with plain numpy, not
with rigctl's own code."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from rigctl.hostside.scorers import GSM8K_SCORES

LINK = re.compile(r"\[([^\]]+)\]\(([^)]+)\)")


def tables(markdown: str) -> list[tuple[str, str, list[dict[str, str]]]]:
    """(section ``##``, heading ``###``, rows as column -> cell) for every table, in order."""
    out = []
    section = heading = ""
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section, heading = line[3:].strip(), ""
        elif line.startswith("### "):
            heading = line[4:].strip()
        elif line.startswith("| ") and i + 1 < len(lines) and re.match(r"\| (---:|:---)", lines[i + 1]):
            header = [c.strip() for c in line.strip()[2:-2].split(" | ")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("| "):
                cells = [c.strip() for c in lines[i].strip()[2:-2].split(" | ")]
                rows.append(dict(zip(header, cells, strict=True)))
                i += 1
            out.append((section, heading, rows))
            continue
        i += 1
    return out


def links(cell: str, base: Path) -> tuple[str, list[Path]]:
    """The cell's main text and every file it links to (resolved against the report's directory)."""
    found = LINK.findall(cell)
    if not found:
        return cell, []
    return found[0][0], [(base / target).resolve() for _, target in found]


def leading_number(text: str) -> float:
    return float(re.match(r"[-+]?\d+(\.\d+)?", text.strip()).group(0))


def bench_samples(files: list[Path], test: str) -> dict[str, list[float]]:
    """Per artifact (from the cell file name), every repetition's t/s of ``test`` in those files."""
    out: dict[str, list[float]] = {}
    for path in files:
        artifact = re.match(r"cell-\d+-(.+)\.json$", path.name).group(1)
        for entry in json.loads(path.read_text()):
            parts = ([f"pp{entry['n_prompt']}"] if entry["n_prompt"] else []) + (
                [f"tg{entry['n_gen']}"] if entry["n_gen"] else [])
            name = "+".join(parts) + (f" @ d{entry['n_depth']}" if entry.get("n_depth") else "")
            if name == test:
                out.setdefault(artifact, []).extend(entry["samples_ts"])
    return out


def answers(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_score(path: Path, set_name: str | None = None, key: str = "score") -> float:
    rows = [r for r in answers(path) if set_name is None or r["set"] == set_name]
    return float(np.mean([float(r[key]) for r in rows]))


def _score_key(column: str) -> str:
    """The answer key a quality column averages: ``overall (lm-eval strict-match)`` -> ``lmeval_strict_match``."""
    named = {f"overall ({name})": key for key, name in GSM8K_SCORES.items()}
    return named.get(column, "score")


def paired_gap(path_a: Path, path_b: Path) -> tuple[int, float]:
    a = {(r["set"], r["id"]): float(r["score"]) for r in answers(path_a)}
    b = {(r["set"], r["id"]): float(r["score"]) for r in answers(path_b)}
    keys = sorted(set(a) & set(b))
    return len(keys), float(np.mean([b[k] - a[k] for k in keys]))


def discordant(path_a: Path, path_b: Path, set_name: str | None = None) -> tuple[int, int]:
    """(A right and B wrong, A wrong and B right) over the paired questions (of one set)."""
    a = {(r["set"], r["id"]): float(r["score"]) for r in answers(path_a) if set_name in (None, r["set"])}
    b = {(r["set"], r["id"]): float(r["score"]) for r in answers(path_b) if set_name in (None, r["set"])}
    keys = set(a) & set(b)
    return sum(a[k] > b[k] for k in keys), sum(a[k] < b[k] for k in keys)


def mcnemar_exact(b: int, c: int) -> float:
    """Twice the smaller binomial tail at one half, summed by hand."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n)


def p_cell(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _artifact(path: Path) -> str:
    return re.match(r"cell-\d+-(.+)\.json$", path.name).group(1)


def check_report(report: Path) -> dict[str, int]:
    """Recompute every speed, quality, comparison and habit number of the report; count what was checked."""
    base = report.parent
    checked = {"speed": 0, "ratio": 0, "quality": 0, "gap": 0, "habits": 0, "drafting": 0, "links": 0,
               "impossible": 0, "tests": 0, "holm": 0, "flips": 0}
    exact_p: list[tuple[float, str]] = []  # every comparison's exact p and its Holm cell, for Holm's check
    markdown = report.read_text()
    for _, target in LINK.findall(markdown):
        assert (base / target).resolve().is_file(), f"dead link {target}"
        checked["links"] += 1
    for section, heading, rows in tables(markdown):
        for row in rows:
            for column, cell in row.items():
                text, files = links(cell, base)
                if not files:
                    continue
                if section == "Speed" and column.endswith(" t/s") and text.startswith("impossible"):
                    checked["impossible"] += 1
                elif section == "Speed" and column.endswith(" t/s"):
                    (values,) = bench_samples(files, row["test"]).values()
                    mean, sd = (float(x) for x in text.split(" ± "))
                    assert mean == round(float(np.mean(values)), 2), (heading, row["test"], text)
                    assert sd == round(float(np.std(values, ddof=1)), 2), (heading, row["test"], text)
                    checked["speed"] += 1
                elif section == "Speed" and " / " in column:
                    first_label = column.split(" / ")[0]
                    first_files = links(row[f"{first_label} t/s"], base)[1]
                    first = _artifact(first_files[0])
                    samples = bench_samples(files, row["test"])
                    (other,) = set(samples) - {first}
                    expected = np.mean(samples[first]) / np.mean(samples[other])
                    assert leading_number(text) == round(float(expected), 3), (column, text)
                    checked["ratio"] += 1
                elif section == "Quality" and column == "n":
                    assert int(text) == len(answers(files[0]))
                elif section == "Quality":
                    overall = column == "overall" or column.startswith("overall (")
                    expected = mean_score(files[0], None if overall else column, _score_key(column))
                    assert leading_number(text) == round(expected, 3), (heading, column, text)
                    checked["quality"] += 1
                elif column == "B - A, points" and section != "Sensitivity":
                    n, gap = paired_gap(*files)
                    assert int(links(row["n"], base)[0]) == n
                    assert leading_number(text) == round(gap * 100, 1), (row, text)
                    checked["gap"] += 1
                elif column == "b / c" and text != "graded":
                    b, c = (int(x) for x in text.split(" / "))
                    assert (b, c) == discordant(*files), (row, text)
                    p = mcnemar_exact(b, c)
                    assert links(row["p (exact)"], base)[0] == p_cell(p), (row, p)
                    holm_column = next(k for k in row if k.startswith("p (Holm"))
                    exact_p.append((p, row[holm_column]))
                    checked["tests"] += 1
                elif section == "Flips" and column in ("right→wrong", "wrong→right"):
                    flips_md, answers_a, answers_b = files
                    down, up = discordant(answers_a, answers_b, None if row["set"] == "overall" else row["set"])
                    assert int(text) == (down if column == "right→wrong" else up), (row, column)
                    listed = flips_md.read_text()
                    heading = f"## {column} ("
                    if row["set"] == "overall":
                        assert f"{heading}{text})" in listed, (row, column)
                    checked["flips"] += 1
                elif section == "Drafting" and column in ("t/s", "speedup"):
                    rows_ = [r for r in answers(files[0]) if r["temperature"] == float(row["temperature"])]
                    mine = [r for r in rows_ if r["contender"] == row["contender"]]
                    if column == "t/s":
                        expected = np.mean([r["tokens_per_s"] for r in mine])
                        assert float(text) == round(float(expected), 2), (row, text)
                    else:
                        baseline = rows_[0]["contender"]  # the race asks the baseline first
                        ratios = []
                        for prompt in dict.fromkeys(r["prompt"] for r in mine):
                            own = np.mean([r["tokens_per_s"] for r in mine if r["prompt"] == prompt])
                            theirs = np.mean([r["tokens_per_s"] for r in rows_
                                              if r["contender"] == baseline and r["prompt"] == prompt])
                            ratios.append(own / theirs)
                        expected = np.exp(np.mean(np.log(ratios)))
                        assert float(text) == round(float(expected), 3), (row, text)
                    checked["drafting"] += 1
                elif section == "Answer habits" and column == "cut off":
                    rows_ = [r for r in answers(files[0]) if r["set"] == row["set"]]
                    assert int(text) == sum(bool(r.get("cutoff")) for r in rows_)
                    checked["habits"] += 1
                elif section == "Answer habits" and column == "no tool call":
                    rows_ = [r for r in answers(files[0]) if r["set"] == row["set"]]
                    toolless = sum(bool(r.get("toolless")) for r in rows_)
                    assert text == f"{toolless} of {sum('toolless' in r for r in rows_)}"
                    checked["habits"] += 1
    if exact_p:
        # Holm by hand: sort, scale by the number left, keep it monotone.
        order = sorted(range(len(exact_p)), key=lambda i: exact_p[i][0])
        running = 0.0
        for rank, i in enumerate(order):
            running = max(running, min(1.0, (len(order) - rank) * exact_p[i][0]))
            assert exact_p[i][1] == p_cell(running), (exact_p, i)
            checked["holm"] += 1
    return checked
