"""``Figure``: the matplotlib Figure that pdjax's plotting functions return, shown as its
image when it is a notebook cell's last line.

pdjax draws without pyplot (the user's backend and figure state are never touched). A plain
``matplotlib.figure.Figure`` made that way has no display of its own: a Jupyter kernel shows
it as the text ``<Figure size 800x350 with 1 Axes>`` unless pyplot's inline backend happens
to have registered its formatter (and never under Agg, a headless kernel's backend). This
subclass carries ``_repr_png_``, so it renders once under any backend; where the inline
backend's formatter is registered, that formatter is used instead (still one image). It is
otherwise matplotlib's ``Figure``: ``savefig``, ``axes``, ``subplots``, ``add_subplot``.
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure as _MatplotlibFigure

REPR_DPI = 100


class Figure(_MatplotlibFigure):
    """A matplotlib ``Figure`` that a notebook shows as a PNG image (``_repr_png_``).

        fig = Figure(figsize=(8, 3.5)); ax = fig.subplots(); ax.plot(x, y)
        fig          # a notebook cell's last line: the figure, drawn once
    """

    def _repr_png_(self) -> bytes:
        return png_bytes(self)


def png_bytes(fig, dpi: int = REPR_DPI) -> bytes:
    """``fig`` (any matplotlib Figure) as PNG bytes, cropped to what is drawn (legends
    outside the axes included)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()
