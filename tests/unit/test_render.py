"""Text from outside rigctl on the terminal: shown as the text it is, never as markup or as a control."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table

from rigctl.cli import app as cli_app
from rigctl.cli.render import outside_text
from rigctl.errors import ProbeError


def shown(renderable: object) -> str:
    """What a colour terminal would get for ``renderable``, with no line wrapped."""
    out = io.StringIO()
    Console(file=out, width=400, force_terminal=True, color_system="truecolor").print(renderable, soft_wrap=True)
    return out.getvalue()


@given(st.text())
def test_any_text_reaches_the_terminal_as_one_line_of_printable_characters(text: str) -> None:
    got = shown(outside_text(text))
    assert got.endswith("\n") and all(ch.isprintable() for ch in got[:-1]), repr(got)


@pytest.mark.parametrize(("text", "expected"), [
    ("[/] closes nothing", "[/] closes nothing"),
    ("[bold red]loud[/]", "[bold red]loud[/]"),
    (":skull: emoji code", ":skull: emoji code"),
    ("clear\x1b[2J title\x1b]0;owned\x07", "clear\\x1b[2J title\\x1b]0;owned\\x07"),
    ("line\nbreak\r\tand \u202egnirts", "line\\nbreak\\r\\tand \\u202egnirts"),
])
def test_markup_emoji_and_controls_are_shown_not_obeyed(text: str, expected: str) -> None:
    assert shown(outside_text(text)) == expected + "\n"
    table = Table()
    table.add_column("cell")
    table.add_row(outside_text(text))
    assert expected in shown(table)


def test_lines_keep_their_breaks_when_asked() -> None:
    assert shown(outside_text("one\x1b[31m\ntwo", lines=True)) == "one\\x1b[31m\ntwo\n"


def test_an_error_quoting_a_host_is_one_line_of_text(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    def fail(**_kwargs: object) -> None:
        raise ProbeError("rig", "os", "odd [/] text\x1b[2J\nerror: forged second line")

    monkeypatch.setattr(cli_app, "app", fail)
    with pytest.raises(SystemExit) as exited:
        cli_app._run_app()
    assert exited.value.code == 1
    assert capsys.readouterr().err == "error: rig: probe: os: odd [/] text\\x1b[2J\\nerror: forged second line\n"
