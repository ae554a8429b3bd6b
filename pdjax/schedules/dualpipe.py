"""DualPipe and DualPipeV op order, as DeepSeek's reference ``step()`` produces it.

Each rank runs one program over two *phases* (the two stages it holds). With ``n`` half
ranks, ``h`` the rank's position from its end of the pipeline and ``H`` micro-batches per
phase, the eight steps are (counts per rank):

1. ``2(n-h-1)`` forwards of phase 0
2. ``h+1`` x (F0, F1)
3. ``n-h-1`` x (I1, W, F1)                    zero-bubble: I queues its W
4. ``H-2n+h+1`` x (F0&B1, F1&B0)              the first F0&B1 of the middle rank(s)
                                              (``h = n-1``) is not overlapped: F0 then B1
5. ``n-h-1`` x (B1, F1&B0)
6. ``h+1`` x (B1, B0)                         full backwards, then I from the middle on
7. ``n-h-1`` x (W, I0)
8. ``h+1`` x W

``W`` always pops the *oldest* queued weight-grad, whichever phase queued it.

- **DualPipe** (N even ranks, C even micro-batches, C >= 2N): ``n = N/2``,
  ``h = min(r, N-1-r)``, ``H = C/2``. Rank r holds stage r of direction 0 and stage
  ``2N-1-r`` (direction 1's stage ``N-1-r``); phase 0 is direction 0 on the first half of
  the ranks and direction 1 on the second half.
- **DualPipeV** (N ranks, C >= 2N micro-batches, 2N stages in a V): ``n = N``, ``h = r``,
  ``H = C``; rank r holds stages r (phase 0) and 2N-1-r (phase 1); the non-overlapped
  pair is on the last rank. DualPipeV(N, C) equals the first half of DualPipe(2N, 2C).
"""

from __future__ import annotations

from collections import deque

from pdjax.arguments import check_int

from .layout import Layout
from .ops import Op, OverlapFB
from .schedule import Schedule


def dualpipe_rank_ops(n: int, h: int, per_phase: int, stages: tuple[int, int],
                      first_mb: tuple[int, int]) -> tuple:
    """One rank's ops for the eight-step program (see module docstring).

    ``stages[p]`` / ``first_mb[p]`` are the stage and first micro-batch id of phase ``p``.
    """
    n_fwd, n_bwd = [0, 0], [0, 0]
    weight_queue: deque[Op] = deque()
    out: list = []

    def fwd(p: int) -> Op:
        op = Op("F", stages[p], first_mb[p] + n_fwd[p])
        n_fwd[p] += 1
        return op

    def bwd(p: int, split: bool = False) -> Op:
        mb = first_mb[p] + n_bwd[p]
        n_bwd[p] += 1
        if split:
            weight_queue.append(Op("W", stages[p], mb))
            return Op("I", stages[p], mb)
        return Op("B", stages[p], mb)

    warm = n - h - 1
    out.extend(fwd(0) for _ in range(2 * warm))                      # 1
    for _ in range(h + 1):                                           # 2
        out.append(fwd(0))
        out.append(fwd(1))
    for _ in range(warm):                                            # 3
        out.append(bwd(1, split=True))
        out.append(weight_queue.popleft())
        out.append(fwd(1))
    for i in range(per_phase - 2 * n + h + 1):                       # 4
        if i == 0 and h == n - 1:
            out.append(fwd(0))
            out.append(bwd(1))
        else:
            out.append(OverlapFB(fwd(0), bwd(1)))
        out.append(OverlapFB(fwd(1), bwd(0)))
    for _ in range(warm):                                            # 5
        out.append(bwd(1))
        out.append(OverlapFB(fwd(1), bwd(0)))
    k = h + 1                                                        # 6
    for i in range(k):
        out.append(bwd(1, split=i > k // 2 or (i == k // 2 and h % 2 == 1)))
        out.append(bwd(0, split=i >= k // 2))
    for _ in range(warm):                                            # 7
        out.append(weight_queue.popleft())
        out.append(bwd(0, split=True))
    for _ in range(h + 1):                                           # 8
        out.append(weight_queue.popleft())
    if weight_queue:  # pragma: no cover - guarded by the step counts above
        raise AssertionError(f"weight-grad queue not empty: {list(map(str, weight_queue))}")
    return tuple(out)


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipe over ``num_ranks`` ranks (even) and ``num_microbatches`` (even, >= 2 x ranks),
    half of the micro-batches entering at each end."""
    n_ranks = check_int("num_ranks", num_ranks, 1)
    c = check_int("num_microbatches", num_microbatches, 1)
    if n_ranks % 2:
        raise ValueError(f"dualpipe needs an even num_ranks, got {n_ranks}")
    if c % 2:
        raise ValueError(f"dualpipe needs an even num_microbatches (half enter at each end), got {c}")
    if c < 2 * n_ranks:
        raise ValueError(f"dualpipe needs num_microbatches >= 2 * num_ranks = {2 * n_ranks}, got {c}")
    layout = Layout.bidirectional(n_ranks, c)
    n, half = n_ranks // 2, c // 2
    ops = []
    for r in range(n_ranks):
        h = min(r, n_ranks - 1 - r)
        dir_stage = (r, 2 * n_ranks - 1 - r)
        dir_mb = (0, half)
        p0 = 1 if r >= n else 0  # direction run as phase 0
        ops.append(dualpipe_rank_ops(n, h, half, (dir_stage[p0], dir_stage[1 - p0]),
                                     (dir_mb[p0], dir_mb[1 - p0])))
    return Schedule("dualpipe", layout, tuple(ops))


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV: ``2 x num_ranks`` stages in a V over ``num_ranks`` ranks,
    ``num_microbatches >= 2 x num_ranks``."""
    n_ranks = check_int("num_ranks", num_ranks, 1)
    c = check_int("num_microbatches", num_microbatches, 1)
    if c < 2 * n_ranks:
        raise ValueError(f"dualpipev needs num_microbatches >= 2 * num_ranks = {2 * n_ranks}, got {c}")
    layout = Layout.v_shape(n_ranks, c)
    ops = tuple(dualpipe_rank_ops(n_ranks, r, c, (r, 2 * n_ranks - 1 - r), (0, 0)) for r in range(n_ranks))
    return Schedule("dualpipev", layout, ops)
