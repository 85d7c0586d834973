"""One way to write an interval, a p-value and a gap, for ``rigctl compare`` and the report alike."""

from __future__ import annotations

import math

from rigctl.stats import Interval


def points(interval: Interval) -> str:
    """A score gap in points with its interval: ``+6.5 (+3.1 to +9.8)``; ``-`` when empty. The one interval
    format, with :func:`ratio_text`, of the CLI and the report (parentheses, so that it can be link text)."""
    if interval.empty:
        return "-"
    return f"{interval.estimate * 100:+.1f} ({interval.low * 100:+.1f} to {interval.high * 100:+.1f})"


def p_text(p: float) -> str:
    """A p-value as people read it: ``0.008``, ``<0.001``, ``-`` when there is none."""
    if math.isnan(p):
        return "-"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def gap_points(gap: float) -> str:
    """A detectable gap in points: ``±12.3``; ``none at this n`` or ``-`` (no discordance to go on)."""
    if math.isnan(gap):
        return "-"
    return "none at this n" if math.isinf(gap) else f"±{gap * 100:.1f}"


def ratio_text(interval: Interval) -> str:
    """A ratio or a score with its interval: ``1.235 (1.228 to 1.241)``; ``-`` when empty."""
    if interval.empty:
        return "-"
    return f"{interval.estimate:.3f} ({interval.low:.3f} to {interval.high:.3f})"
