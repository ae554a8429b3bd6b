"""``plot``: the Gantt chart of a simulated schedule, drawn and optionally saved
(matplotlib is imported by the first plot, not by ``import pdjax.schedules``)."""

from __future__ import annotations

from .simulate import simulate


def plot(timeline_or_schedule, path=None, *, ax=None, **simulate_kwargs):
    """Gantt chart of a :class:`~pdjax.schedules.simulate.Timeline` (or of a Schedule,
    simulated with ``simulate_kwargs``), drawn on ``ax`` (a matplotlib Axes; default a new
    figure). Saves to ``path`` (format from its suffix: .png, .svg, .pdf) and returns the
    Figure: a new one is a :class:`~pdjax.schedules.figure.Figure`, which a notebook cell
    ending in ``plot(t)`` shows as the chart; with ``ax``, the figure ``ax`` belongs to."""
    from .gantt import draw, save

    t = timeline_or_schedule
    if not hasattr(t, "makespan"):
        t = simulate(t, **simulate_kwargs)
    fig = draw(t, ax=ax)
    if path is not None:
        save(fig, path)
    return fig
