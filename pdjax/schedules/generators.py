"""Schedule generators and the ``build(name, ...)`` entry point.

Names: ``gpipe``, ``1f1b``, ``interleaved-1f1b`` (``num_stages_per_rank=v``), ``zb1p``
(ZB-H1), ``dualpipe``, ``dualpipev``, the zero-bubble family of :mod:`.greedy`
(``zbh2``, ZB-H2; ``zbv``, ZB-V) and the building-block schedules of :mod:`.vblock`
(``v-half``, ``v-min``). Stage ``s`` of a one-stage-per-rank schedule
lives on rank ``s``; interleaved stage ``k*P + r`` is rank ``r``'s ``k``-th chunk.
"""

from __future__ import annotations

from collections import deque

from pdjax.arguments import check_int

from .dualpipe import dualpipe, dualpipev
from .greedy import zbh2, zbv
from .vblock import v_half, v_min
from .layout import Layout
from .ops import Op
from .schedule import Schedule


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (micro-batch order)."""
    p = check_int("num_ranks", num_ranks, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    ops = tuple(
        tuple(Op("F", r, i) for i in range(m)) + tuple(Op("B", r, i) for i in range(m)) for r in range(p)
    )
    return Schedule("gpipe", Layout.chain(range(p), m, num_ranks=p), ops)


def _one_f_one_b(p: int, m: int, r: int, split_lag: int | None) -> tuple:
    """1F1B program of rank ``r``; with ``split_lag`` the backward is split into I and W,
    each W running once more than ``split_lag`` weight-grads are queued (ZB-H1)."""
    warm = min(p - 1 - r, m)
    out: list = [Op("F", r, i) for i in range(warm)]
    queue: deque[Op] = deque()

    def backward(i: int) -> None:
        if split_lag is None:
            out.append(Op("B", r, i))
            return
        out.append(Op("I", r, i))
        queue.append(Op("W", r, i))
        if len(queue) > split_lag:
            out.append(queue.popleft())

    for i in range(m - warm):
        out.append(Op("F", r, warm + i))
        backward(i)
    for i in range(m - warm, m):
        backward(i)
    out.extend(queue)
    return tuple(out)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): ``P-1-r`` warm-up forwards on rank ``r``, then F/B pairs."""
    p = check_int("num_ranks", num_ranks, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    ops = tuple(_one_f_one_b(p, m, r, None) for r in range(p))
    return Schedule("1f1b", Layout.chain(range(p), m, num_ranks=p), ops)


def zb1p(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with the backward split into I and W; rank ``r`` defers its W by
    ``r`` micro-batches so the W fill the end-of-pipeline bubble. Same activation
    memory as 1F1B; bubble (P-1)(F+B-2W) when W <= min(F, I)."""
    p = check_int("num_ranks", num_ranks, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    ops = tuple(_one_f_one_b(p, m, r, r) for r in range(p))
    return Schedule("zb1p", Layout.chain(range(p), m, num_ranks=p), ops)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, num_stages_per_rank: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: ``v = num_stages_per_rank`` chunks per rank, stage
    ``k*P + r`` on rank ``r``; needs ``num_microbatches % num_ranks == 0``.

    Forwards go in groups of P micro-batches per chunk; rank ``r`` warms up with
    ``2(P-1-r) + (v-1)P`` forwards, then alternates F and B (B visits chunks in reverse).
    """
    p = check_int("num_ranks", num_ranks, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    v = check_int("num_stages_per_rank", num_stages_per_rank, 1)
    if v == 1:
        s = one_f_one_b(p, m)
        return Schedule("interleaved-1f1b", s.layout, s.ops, (("num_stages_per_rank", 1),))
    if m % p:
        raise ValueError(
            f"interleaved-1f1b needs num_microbatches divisible by num_ranks ({p}), got {m}"
        )
    total = m * v

    def slot(j: int, backward: bool) -> tuple[int, int]:
        chunk = (j // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (j // (p * v)) * p + j % p

    ops = []
    for r in range(p):
        warm = min(2 * (p - 1 - r) + (v - 1) * p, total)
        out: list = []
        for j in range(warm):
            k, mb = slot(j, False)
            out.append(Op("F", k * p + r, mb))
        for j in range(total - warm):
            k, mb = slot(warm + j, False)
            out.append(Op("F", k * p + r, mb))
            k, mb = slot(j, True)
            out.append(Op("B", k * p + r, mb))
        for j in range(total - warm, total):
            k, mb = slot(j, True)
            out.append(Op("B", k * p + r, mb))
        ops.append(tuple(out))
    layout = Layout.chain([s % p for s in range(p * v)], m, num_ranks=p)
    return Schedule("interleaved-1f1b", layout, tuple(ops), (("num_stages_per_rank", v),))


#: The schedule generators by name: ``build(name, num_ranks, num_microbatches)`` calls them.
GENERATORS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb1p": zb1p,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
    "zbh2": zbh2,
    "zbv": zbv,
    "v-half": v_half,
    "v-min": v_min,
}


def build(name: str, num_ranks: int, num_microbatches: int, **options) -> Schedule:
    """Build a named schedule. ``options``: ``num_stages_per_rank`` for interleaved-1f1b.

    Raises ValueError for an unknown name, a non-positive size, an unknown option, or a
    size the schedule does not support (the message names the rule).
    """
    if not isinstance(name, str):
        raise ValueError(f"schedule name must be a str, got {name!r}")
    key = name.strip().lower()
    if key not in GENERATORS:
        raise ValueError(f"unknown schedule name {name!r}; known: {sorted(GENERATORS)}")
    allowed = {"num_stages_per_rank"} if key == "interleaved-1f1b" else set()
    unknown = set(options) - allowed
    if unknown:
        raise ValueError(f"schedule {key!r} takes no option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return GENERATORS[key](num_ranks, num_microbatches, **options)
