"""The PNG charts of reports and benches: a figure on Agg's canvas, and its one way to a file.

Matplotlib is imported by these functions, not by this module: it takes half a second and only commands that draw
need it. Figures are made without pyplot (no figure manager, no backend to pick, nothing left open to close),
which the PNG does not see: the same figure, axes and pixels as ``plt.subplots`` gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Pixels per inch of every chart a report links.
DPI = 110


def new_figure(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float], squeeze: bool = True
               ) -> tuple[Figure, Any]:
    """A figure of ``figsize`` inches with its axes, as :meth:`matplotlib.figure.Figure.subplots` returns them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=figsize)
    FigureCanvasAgg(figure)
    return figure, figure.subplots(nrows, ncols, squeeze=squeeze)


def save_png(figure: Figure, path: Path, dpi: int = DPI) -> Path:
    """Lay ``figure`` out tight and write it to ``path`` as a PNG."""
    figure.tight_layout()
    # tight_layout leaves a placeholder layout engine behind, and savefig then draws the whole figure once with
    # drawing disabled, for a layout that is already done, before the draw it writes: without an engine it draws
    # once (the same pixels).
    figure.set_layout_engine(None)
    figure.savefig(path, dpi=dpi)
    return path
