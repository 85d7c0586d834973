"""Text from outside rigctl on the terminal: shown as the text it is, never as markup or as a control. The
CLI's tables are driven as commands (test_compare's flips, test_enroll's hosts); here the escaping itself
and the error line every command ends with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rigctl.trust import printable

REPO = Path(__file__).resolve().parents[2]


@given(st.text())
def test_any_text_becomes_one_line_of_printable_characters(text: str) -> None:
    shown = printable(text)
    assert shown.isprintable()
    assert (shown == text) == text.isprintable()  # printable text is left exactly as it is


@given(st.text())
def test_lines_keep_their_breaks_and_nothing_else(text: str) -> None:
    assert all(part.isprintable() for part in printable(text, lines=True).split("\n"))
    assert printable(text, lines=True).count("\n") == text.count("\n")


@pytest.mark.parametrize(("text", "expected"), [
    ("clear\x1b[2J title\x1b]0;owned\x07", "clear\\x1b[2J title\\x1b]0;owned\\x07"),
    ("line\nbreak\r\tand \u202egnirts", "line\\nbreak\\r\\tand \\u202egnirts"),
    ("[/] é 🙂 plain", "[/] é 🙂 plain"),
])
def test_controls_are_written_as_their_escapes(text: str, expected: str) -> None:
    assert printable(text) == expected


def test_an_error_quoting_outside_text_is_one_line_of_text(tmp_path: Path) -> None:
    """The error line shows markup and escapes literally, and a line break cannot forge a second line."""
    weird = str(tmp_path / "inv [/] [bold]x\x1b[2J\nerror: forged")
    done = subprocess.run([sys.executable, "-m", "rigctl.cli", "-i", weird, "hosts"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2
    assert done.stderr == (f"error: inventory {tmp_path}/inv [/] [bold]x\\x1b[2J\\nerror: forged: "
                           "no such file or directory\n")


HOSTILE = "x [/] [bold]y\x1b[2J\x1b]0;owned\x07"
SHOWN = "x [/] [bold]y\\x1b[2J\\x1b]0;owned\\x07"


def test_compare_prints_a_records_sets_and_answers_as_text(tmp_path: Path) -> None:
    """The habits table (and every other) shows the record's set names and answers literally."""
    from handmade_runs import eval_run

    rows = [{"id": f"q{i}", "set": HOSTILE, "score": i % 2, "cutoff": False, "pred": HOSTILE, "gold": "[/]"}
            for i in range(10)]
    eval_run(tmp_path, "desktop", "eval-20261130T050000Z-0001", "m-a", rows)
    eval_run(tmp_path, "desktop", "eval-20261130T050000Z-0002", "m-b", [{**r, "score": 1} for r in rows])
    done = subprocess.run([sys.executable, "-m", "rigctl.cli", "compare", "desktop/eval-20261130T050000Z-0001",
                           "desktop/eval-20261130T050000Z-0002"], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "RIGCTL_RESULTS": str(tmp_path), "COLUMNS": "400"})
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout + done.stderr and "\x07" not in done.stdout + done.stderr
    habits = done.stdout.split("answer habits", 1)[1]
    assert habits.count(SHOWN) == 4 and "[/] 10" in habits  # two runs: set and predicted answer each
