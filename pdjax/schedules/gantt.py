"""Gantt charts of simulated schedules (matplotlib Figures, drawn without pyplot: the user's
backend and figure state are never touched; a new one is a :class:`~pdjax.schedules.figure.Figure`,
which a notebook shows as its image).

One row per rank, time on the x axis, a colour per op kind; an overlapped F&B pair is
drawn half forward colour (top) and half backward colour (bottom), as in the DualPipe
README figure. Ops of a second pipeline direction (DualPipe) or of a rank's later stage
(V schedules, interleaving) are drawn lighter. Micro-batch numbers are written in cells
that are wide enough; white space is bubble.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from .figure import Figure, png_bytes
from .ops import OVERLAP

COLORS = {"F": "#f2a33a", "B": "#4c9be8", "I": "#2bb3a3", "W": "#8cc152"}
_LABEL_LIMIT = 3000  # ops; beyond this, cells are too small to label


def _tint(color: str, light: bool) -> tuple:
    rgb = to_rgb(color)
    return tuple(c + (1 - c) * 0.45 for c in rgb) if light else rgb


def _is_light(schedule, stage: int) -> bool:
    layout = schedule.layout
    if len(layout.pipelines) > 1:
        return layout.stage_pipeline[stage] == 1
    return layout.stages_on_rank(layout.stage_rank[stage])[0] != stage


def draw(timeline, ax=None, title: str | None = None):
    """Draw ``timeline`` on ``ax`` (a new figure if None); returns the figure."""
    sched = timeline.schedule
    num_ranks = sched.num_ranks
    if ax is None:
        width = min(max(8.0, timeline.makespan * 0.35), 28.0)
        ax = Figure(figsize=(width, 0.45 * num_ranks + 1.2)).subplots()
    fig = ax.figure
    label = sched.num_ops <= _LABEL_LIMIT
    bars: dict[tuple, list] = {}
    for r, ops in enumerate(sched.ops):
        for op, s, e in zip(ops, timeline.starts[r].tolist(), timeline.ends[r].tolist()):
            if e <= s:
                continue
            if op.kind == OVERLAP:
                for part, dy in ((op.forward, -0.4), (op.backward, 0.0)):
                    key = (part.kind, _is_light(sched, part.stage), dy, 0.4)
                    bars.setdefault(key, []).append((r, s, e, part.microbatch))
            else:
                key = (op.kind, _is_light(sched, op.stage), -0.4, 0.8)
                bars.setdefault(key, []).append((r, s, e, op.microbatch))
    for (kind, light, dy, h), items in bars.items():
        color = _tint(COLORS[kind], light)
        for r in range(num_ranks):
            spans = [(s, e - s) for rr, s, e, _ in items if rr == r]
            if spans:
                ax.broken_barh(spans, (r + dy, h), facecolors=color, edgecolors="white", linewidth=0.4)
        if label:
            for r, s, e, mb in items:
                if (e - s) >= 0.6:
                    ax.text((s + e) / 2, r + dy + h / 2, str(mb), ha="center", va="center", fontsize=6)
    ax.set_ylim(num_ranks - 0.5, -0.5)
    ax.set_xlim(0, timeline.makespan or 1.0)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.set_xlabel("time")
    ax.set_title(title or f"{sched.name}: {num_ranks} ranks, {sched.num_microbatches} micro-batches, "
                          f"makespan {timeline.makespan:g}, bubble ratio {timeline.bubble_ratio:.3f}")
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="bubble"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 1.5 / (num_ranks + 3)),
              fontsize=7, ncol=len(handles), frameon=False)
    fig.tight_layout()
    return fig


def save(fig, path) -> None:
    """Save ``fig`` to ``path`` (format from its suffix: .png, .svg or .pdf)."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"plot path must end in .png, .svg or .pdf, got {str(path)!r}")
    fig.savefig(path, dpi=150)


def timeline_png(timeline) -> bytes:
    """PNG bytes of the Gantt chart (for notebooks' ``_repr_png_``)."""
    return png_bytes(draw(timeline))


def timeline_html(timeline, png: bytes | None = None) -> str:
    """The timeline's summary line above its Gantt chart (an inline PNG): what a notebook
    shows, since frontends prefer HTML to PNG when an object offers both."""
    png = timeline_png(timeline) if png is None else png
    summary = (f"{timeline.schedule}: makespan {timeline.makespan:g}, bubble ratio {timeline.bubble_ratio:.3f}, "
               f"bubbles per rank {np.round(timeline.bubble, 6).tolist()}")
    return (f"<div><pre>{html.escape(summary)}</pre>"
            f"<img src='data:image/png;base64,{base64.b64encode(png).decode()}'></div>")


def timeline_bundle(timeline) -> dict:
    """``{"image/png", "text/html"}`` of the timeline, its chart drawn once."""
    png = timeline_png(timeline)
    return {"image/png": png, "text/html": timeline_html(timeline, png)}
