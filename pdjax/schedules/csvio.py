"""CSV import/export in torch.distributed.pipelining's compute-only format.

One row per rank, one cell per op: ``0F3``, ``1I0``, ``2W5``, ``3B1``,
``(0F7;7B3)OVERLAP_F_B``. Empty cells (torch writes them for idle time steps) are
skipped on import; export writes none. Rows end with ``\\n``.
"""

from __future__ import annotations

import csv
import io

from .layout import Layout
from .ops import parse_op


def schedule_to_csv(schedule) -> str:
    """Serialise ``schedule.ops`` to torch's compute-only CSV text."""
    return "".join(",".join(str(op) for op in ops) + "\n" for ops in schedule.ops)


def parse_csv(text: str, *, layout: Layout | None = None) -> tuple[Layout, tuple]:
    """Parse torch's compute-only CSV into ``(layout, ops per rank)`` for a
    :class:`~pdjax.schedules.schedule.Schedule` (``Schedule.from_csv`` builds and validates it).

    Without ``layout``, stages form one chain 0..S-1, each stage is owned by the rank
    whose row names it, and the micro-batches are 0..max. Raises ValueError naming the
    rank (row) and cell of a malformed op or a stage split over two ranks.
    """
    if not isinstance(text, str):
        raise TypeError(f"CSV text must be str, got {type(text).__name__}")
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as e:
        raise ValueError(f"schedule CSV: {e}") from None
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()  # trailing blank lines
    if not rows:
        raise ValueError("CSV has no rows (one row per rank expected)")
    ops = []
    for r, row in enumerate(rows):
        rank_ops = []
        for c, cell in enumerate(row):
            if cell.strip():
                rank_ops.append(parse_op(cell, where=f"rank {r}, cell {c}"))
        ops.append(tuple(rank_ops))
    if layout is None:
        layout = _infer_chain_layout(ops)
    elif layout.num_ranks != len(ops):
        raise ValueError(f"CSV has {len(ops)} rows but the layout has {layout.num_ranks} ranks")
    return layout, tuple(ops)


def _infer_chain_layout(ops) -> Layout:
    owner: dict[int, tuple[int, object]] = {}
    max_mb = -1
    for r, rank_ops in enumerate(ops):
        for i, op in enumerate(rank_ops):
            for part in op.parts:
                max_mb = max(max_mb, part.microbatch)
                seen = owner.get(part.stage)
                if seen is None:
                    owner[part.stage] = (r, op)
                elif seen[0] != r:
                    raise ValueError(
                        f"rank {r} op #{i} {op}: stage {part.stage} already appears on rank {seen[0]} "
                        f"(op {seen[1]}); a stage lives on one rank"
                    )
    if not owner:
        raise ValueError("CSV names no ops")
    num_stages = max(owner) + 1
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        raise ValueError(f"stages {missing[:8]} appear in no row (stages must be 0..{num_stages - 1})")
    parts = sum(len(op.parts) for rank_ops in ops for op in rank_ops)
    if 2 * (max_mb + 1) * num_stages > parts:   # before anything is sized by the largest id
        raise ValueError(f"micro-batch id {max_mb}, but {parts} ops cannot hold a forward and a backward of "
                         f"micro-batches 0..{max_mb} on each of {num_stages} stages (ids must be 0..m-1)")
    return Layout.chain([owner[s][0] for s in range(num_stages)], max_mb + 1, num_ranks=len(ops))
