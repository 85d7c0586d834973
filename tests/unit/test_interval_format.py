"""One interval format for `rigctl compare` and the report: rigctl.analysis.format's points and ratio_text."""

from __future__ import annotations

from report_check import LINK  # noqa: E402  (how the report tests read a linked number)

from rigctl.analysis.format import points, ratio_text
from rigctl.stats import Interval


def interval(estimate: float, low: float, high: float, n: int = 40) -> Interval:
    return Interval(estimate, low, high, n, 1000, 0.95, "indices")


def test_gaps_in_points_and_ratios() -> None:
    assert points(interval(0.065, 0.031, 0.098)) == "+6.5 (+3.1 to +9.8)"
    assert points(interval(-0.02, -0.081, 0.04)) == "-2.0 (-8.1 to +4.0)"
    assert ratio_text(interval(1.2351, 1.2279, 1.2414)) == "1.235 (1.228 to 1.241)"
    assert points(interval(0.0, 0.0, 0.0, n=0)) == ratio_text(interval(0.0, 0.0, 0.0, n=0)) == "-"


def test_the_format_can_be_link_text() -> None:
    for text in (points(interval(-0.02, -0.081, 0.04)), ratio_text(interval(0.91, 0.88, 0.95))):
        found = LINK.findall(f"[{text}](../results/desktop/run/answers.jsonl)")
        assert found == [(text, "../results/desktop/run/answers.jsonl")]
