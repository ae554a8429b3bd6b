"""The schedule IR: per rank, an ordered tuple of compute ops over a :class:`Layout`.

One representation for every consumer: the validator, the simulator, plots, the device
executor, and CSV import/export (torch.distributed.pipelining's format).
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from functools import cached_property

from .layout import Layout
from .ops import AnyOp, Op, OverlapFB


@dataclass(frozen=True, repr=False)
class Schedule:
    """A pipeline schedule.

    ``ops[r]`` is rank ``r``'s program, run in order (stored as tuples, whatever sequences
    were given). ``name`` is the generator's name (or ``"csv"``), ``options`` the
    generator's extra arguments (e.g. stages per rank). Two schedules are equal when their
    layouts and ops are: the name and options describe where a schedule came from, not
    what it is (so a CSV round trip gives an equal schedule).
    """

    name: str = field(compare=False)
    layout: Layout
    ops: tuple[tuple[AnyOp, ...], ...]
    options: tuple[tuple[str, object], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.ops, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in self.ops):
            raise TypeError("Schedule.ops must be a list or tuple of one list or tuple of ops per rank")
        object.__setattr__(self, "ops", tuple(tuple(r) for r in self.ops))
        object.__setattr__(self, "options", tuple(tuple(o) for o in self.options))
        if len(self.ops) != self.layout.num_ranks:
            raise ValueError(
                f"Schedule.ops has {len(self.ops)} rank programs but the layout has "
                f"{self.layout.num_ranks} ranks"
            )
        for r, ops in enumerate(self.ops):
            for i, op in enumerate(ops):
                if not isinstance(op, (Op, OverlapFB)):
                    raise TypeError(f"rank {r} op #{i}: expected Op or OverlapFB, got {type(op).__name__}")

    # ---- sizes ---------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.layout.num_ranks

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.layout.num_microbatches

    @cached_property
    def max_microbatch(self) -> int:
        """Largest micro-batch id named by any op (-1 if there are none)."""
        return max((p.microbatch for ops in self.ops for op in ops for p in op.parts), default=-1)

    @cached_property
    def num_ops(self) -> int:
        """Number of ops over all ranks (a pair counts once)."""
        return sum(len(ops) for ops in self.ops)

    def option(self, key: str, default=None):
        return dict(self.options).get(key, default)

    # ---- consumers -----------------------------------------------------------------
    def validate(self) -> "Schedule":
        """Check counts, per-rank order and deadlock-freedom; raise ValueError naming the
        first offending rank and op. Returns ``self`` so calls chain."""
        from .validate import validate

        validate(self)
        return self

    def to_csv(self, path=None) -> str:
        """torch.distributed.pipelining compute-only CSV: one row per rank. Returns the
        text; with ``path``, also writes it there."""
        from .csvio import schedule_to_csv

        text = schedule_to_csv(self)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_csv(cls, text, *, layout: Layout | None = None, validate: bool = True) -> "Schedule":
        """Parse torch's compute-only CSV: its text, or a path (a ``pathlib.Path``, or a
        string naming an existing file). Without ``layout`` the stages form one chain 0..S-1
        and each stage's rank is where its ops appear (torch's convention); pass
        ``Layout.bidirectional(...)`` for DualPipe."""
        from .csvio import parse_csv

        if isinstance(text, os.PathLike) or (isinstance(text, str) and "\n" not in text and "," not in text
                                             and os.path.isfile(text)):
            with open(text) as f:
                text = f.read()

        layout, ops = parse_csv(text, layout=layout)
        schedule = cls("csv", layout, ops)
        return schedule.validate() if validate else schedule

    def comms(self):
        """Per rank, the compute ops with derived SEND/RECV actions (see ``comms``)."""
        from .comms import derive_comms

        return derive_comms(self)

    def param_copies(self) -> list[int]:
        """Per rank, parameters held in units of one stage's weights (1F1B: 1,
        DualPipe and DualPipeV: 2, interleaved with v stages per rank: v)."""
        counts = [0] * self.num_ranks
        for r in self.layout.stage_rank:
            counts[r] += 1
        return counts

    def to_text(self) -> str:
        """A step-by-rank grid of ops (torch's ``_format_pipeline_order`` layout)."""
        from .render import schedule_text

        return schedule_text(self)

    def __repr__(self) -> str:
        return str(self)

    def __str__(self) -> str:
        return (f"Schedule({self.name!r}, ranks={self.num_ranks}, stages={self.num_stages}, "
                f"microbatches={self.num_microbatches}, ops={self.num_ops})")

    def _repr_html_(self) -> str:
        rows = []
        for r, ops in enumerate(self.ops):
            cells = "".join(f"<td style='padding:1px 4px'>{html.escape(str(op))}</td>" for op in ops[:200])
            more = "<td>…</td>" if len(ops) > 200 else ""
            rows.append(f"<tr><th>rank {r}</th>{cells}{more}</tr>")
        return f"<div><b>{html.escape(str(self))}</b><table>{''.join(rows)}</table></div>"

    def _repr_png_(self) -> bytes:
        """Gantt chart of the schedule simulated with F=1, B=2, W=1 (FB=F+B)."""
        from .gantt import timeline_png
        from .simulate import simulate

        return timeline_png(simulate(self, F=1.0, B=2.0, W=1.0))
