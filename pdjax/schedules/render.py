"""Text renderings and Chrome/Perfetto trace export of schedules and timelines."""

from __future__ import annotations

import json
from pathlib import Path

from .ops import OVERLAP

_TEXT_CHAR = {"F": "F", "B": "B", "I": "I", "W": "W", OVERLAP: "X"}


def schedule_text(schedule, max_steps: int | None = None) -> str:
    """A step-by-rank grid (rows are steps, columns ranks), like torch's
    ``_format_pipeline_order``. ``max_steps`` truncates long schedules."""
    steps = max((len(ops) for ops in schedule.ops), default=0)
    shown = steps if max_steps is None else min(steps, max_steps)
    cols = [[str(op) for op in ops[:shown]] for ops in schedule.ops]
    widths = [max([len(f"Rank {r}")] + [len(c) for c in col]) for r, col in enumerate(cols)]
    label_w = len(f"Step {max(shown - 1, 0)}")
    lines = [" " * (label_w + 2) + " ".join(f"Rank {r}".ljust(w) for r, w in enumerate(widths))]
    for i in range(shown):
        cells = [(col[i] if i < len(col) else "").ljust(w) for col, w in zip(cols, widths)]
        lines.append(f"Step {i}".ljust(label_w) + ": " + " ".join(cells).rstrip())
    if shown < steps:
        lines.append(f"... {steps - shown} more steps")
    return "\n".join(lines) + "\n"


def timeline_text(timeline, width: int = 120) -> str:
    """One line per rank, time scaled to ``width`` columns. Each op is drawn with its
    kind letter (``X`` for an overlapped F&B pair) and, where it fits, its micro-batch;
    ``.`` is idle time (bubble)."""
    if width < 10:
        raise ValueError(f"width must be >= 10 columns, got {width}")
    span = timeline.makespan or 1.0
    scale = width / span
    lines = [f"makespan {timeline.makespan:g}, bubble ratio {timeline.bubble_ratio:.3f}, "
             f"{width} cols = {span:g} time units"]
    for r, ops in enumerate(timeline.schedule.ops):
        row = ["."] * width
        for op, s, e in zip(ops, timeline.starts[r].tolist(), timeline.ends[r].tolist()):
            a, b = int(round(s * scale)), int(round(e * scale))
            if b <= a:
                continue
            mb = op.forward.microbatch if op.kind == OVERLAP else op.microbatch
            label = _TEXT_CHAR[op.kind] + str(mb)
            if len(label) > b - a:  # no room for the micro-batch: kind letter only
                label = _TEXT_CHAR[op.kind] * (b - a)
            label = label + _TEXT_CHAR[op.kind].lower() * (b - a - len(label))
            row[a:b] = list(label)
        lines.append(f"rank {r:>3} |" + "".join(row) + f"| bubble {timeline.bubble[r]:g}")
    return "\n".join(lines) + "\n"


def chrome_trace(timeline, path=None, time_scale_us: float = 1000.0) -> dict:
    """Chrome/Perfetto trace: one process, one thread per rank, a complete ("X") event
    per op with its stage and micro-batch in ``args``. Times are simulator units times
    ``time_scale_us`` (microseconds). Writes JSON to ``path`` when given."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": timeline.schedule.name}}]
    for r in range(len(timeline.schedule.ops)):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
    for r, ops in enumerate(timeline.schedule.ops):
        for op, s, e in zip(ops, timeline.starts[r].tolist(), timeline.ends[r].tolist()):
            args = {"op": str(op)}
            if op.kind == OVERLAP:
                args.update(forward=str(op.forward), backward=str(op.backward))
            else:
                args.update(stage=op.stage, microbatch=op.microbatch)
            events.append({"name": str(op), "cat": op.kind, "ph": "X", "pid": 0, "tid": r,
                           "ts": s * time_scale_us, "dur": (e - s) * time_scale_us, "args": args})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace
