"""``plot_profile``: a measured kernel timeline (a :class:`~pdjax.analysis.profile.Profile`
or a list of :class:`~pdjax.analysis.streams.Span`) drawn one row per stream, bars coloured by
op class, with a predicted timeline (streams "compute" and "comm") in rows below it, in the
same colours. Time in milliseconds. matplotlib is imported when a plot is drawn, never by
importing this module; no pyplot (the user's backend and figure state are untouched).
"""

from __future__ import annotations

from pdjax.analysis.streams import OP_CLASSES, STREAMS, Span, makespan

COLORS = {"gemm": "#4c9be8", "attention": "#f2a33a", "indexer": "#e8684c", "dispatch": "#8cc152",
          "combine": "#a07cc5", "other": "#b4b4b4"}


def plot_profile(prof_or_spans, predicted=None, path=None, ax=None):
    """Draw the measured timeline ``prof_or_spans`` (a Profile or a sequence of Span), one
    row per stream, and, if given, the ``predicted`` sequence of Span below it (rows
    "predicted compute", "predicted comm"); time in ms, one colour per op class. Draws on
    ``ax`` (a matplotlib Axes; default a new :class:`~pdjax.schedules.figure.Figure`, which
    a notebook shows as its image), saves to ``path`` (.png, .svg or .pdf) if given, and
    returns the figure. TypeError for inputs that are not Spans."""
    measured = _spans("prof_or_spans", getattr(prof_or_spans, "spans", prof_or_spans))
    predicted = None if predicted is None else _spans("predicted", predicted)
    rows = [(f"stream {s}" if s.isdigit() else s, [x for x in measured if x.stream == s]) for s in _streams(measured)]
    if predicted is not None:
        rows += [(f"predicted {s}", [x for x in predicted if x.stream == s]) for s in _streams(predicted, STREAMS)]
    from matplotlib.patches import Patch

    from pdjax.schedules.figure import Figure
    from pdjax.schedules.gantt import save
    if ax is None:
        ax = Figure(figsize=(12.0, 0.5 * len(rows) + 1.6)).subplots()
    for row, (_, spans) in enumerate(rows):
        for op_class in OP_CLASSES:
            bars = [(s.start_s * 1e3, s.duration_s * 1e3) for s in spans if s.op_class == op_class]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLORS[op_class], linewidth=0)
    if predicted is not None:
        ax.axhline(len(rows) - len(_streams(predicted, STREAMS)) - 0.5, color="black", linewidth=0.8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_xlabel("time (ms)")
    title = f"measured: makespan {makespan(measured) * 1e3:.2f} ms"
    if predicted is not None:
        title += f"; predicted: makespan {makespan(predicted) * 1e3:.2f} ms"
    ax.set_title(title)
    ax.legend(handles=[Patch(color=COLORS[c], label=c) for c in OP_CLASSES], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig = ax.figure
    fig.tight_layout()
    if path is not None:
        save(fig, path)
    return fig


def _spans(name: str, spans) -> list:
    try:
        spans = list(spans)
    except TypeError:
        raise TypeError(f"plot_profile: {name} must be a Profile or a sequence of Span, "
                        f"got {type(spans).__name__}") from None
    bad = [s for s in spans if not isinstance(s, Span)]
    if bad:
        raise TypeError(f"plot_profile: {name} must hold Span objects, got a {type(bad[0]).__name__}")
    return spans


def _streams(spans, first=()) -> list:
    """The streams of ``spans``: those of ``first`` in that order, then the rest numerically."""
    present = {s.stream for s in spans}
    rest = sorted(present - set(first), key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0, s))
    return [s for s in first if s in present] + rest
