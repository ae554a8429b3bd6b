"""V-Half and V-Min built the way the controllable-memory paper builds them (Qi, Wan, Amar,
Lin, "Pipeline Parallelism with Controllable Memory", NeurIPS 2024, arXiv 2405.15362):
one micro-batch's *building block* repeated at a fixed interval, then squeezed.

Layout: :meth:`Layout.v_shape`, rank ``r`` holds stage ``down = r`` and ``up = 2P-1-r``.
Time is counted in *slots*, one slot per op of one stage with ``F = I = W`` (a V stage
has half a rank's layers, so a slot is half of one-stage-per-rank 1F1B's ``F``).

1. **Building block** (:func:`building_block`): the slots of micro-batch 0's forwards and
   input-grads. Forwards go down the V with ``d_F_down`` slots between consecutive ranks,
   turn on rank ``P-1`` in one slot and come back up with ``d_F_up``; the input-grads start
   on rank 0 one slot (plus a gap ``g``) after the last forward, go up with ``d_I_up``,
   turn on rank ``P-1`` one slot (plus a gap ``h``) later and come back down with
   ``d_I_down``. V-Min uses the least offsets ``(1, 1, 1, 1)``; V-Half spreads the down-leg
   forwards and the up-leg input-grads ``(2, 1, 2, 1)``, which moves activation lifespan from
   the first stage of each rank to the second. The gaps are the paper's collision rule
   made explicit: the block repeats every ``INTERVAL = 6`` slots (a rank's 6 ops per
   micro-batch), so each rank's four F/I slots must differ mod 6; among the ``(g, h)`` in
   ``0..5`` that achieve this, the one whose repeated block has the least peak memory
   (then the fewest added slots) is taken. This gives ``g = 2`` for V-Min when ``3 | P``
   and ``g = 3, h = 1`` for V-Half when ``P`` is even (``g = 0``, ``h = 1`` when odd).
2. **Repeat**: micro-batch ``j``'s F and I ops sit ``6j`` slots after micro-batch 0's.
   Every rank's W ops go into its free slots, the up stage's oldest pending W first, then
   the down stage's. In the steady state each rank then fills all 6 slots of every
   interval, and an activation lives ``lifespan = W slot - F slot + 1`` slots, so the rank
   holds ``ceil(lifespan / 6)`` micro-batches of that stage (the paper's lemma: the block's
   lifespan sets the peak memory).
3. **Squeeze**: warm-up ops (before micro-batch 0's last input-grad) and cool-down ops
   (after the last micro-batch's first forward), in slot order, move to the earliest free
   slot after their inputs on which the rank's peak (its W's placed again by the rule of
   2) stays within the repeated block's peak over all ranks; the steady state is left as
   repeated. A rank's program is its ops in slot order; the simulator then runs them with
   any costs (ops start as soon as their inputs and the previous op allow).

Published claims (``F = I = W``), checked by ``tests/pipeline/test_pipeline_zero_bubble.py``:
peak ``(P + 4) // 3`` (V-Min) and ``(P + 2) // 2`` (V-Half) micro-batches of one rank's
layers, against 1F1B's ``P``; bubble about ``2/3`` and ``1/2`` of 1F1B's. V-Half keeps its
steady state bubble-free exactly when ``W + 2I >= 2F`` and ``W + 2F >= 2I`` (the paper's
condition, with its B our I); V-Min's bubble grows with ``m`` at many unbalanced ratios
(e.g. ``F:I:W = 1.5:1:1``, where V-Half's does not).
"""

from __future__ import annotations

from pdjax.arguments import check_int

from .layout import Layout
from .ops import Op
from .schedule import Schedule

INTERVAL = 6
OFFSETS = {"v-half": (2, 1, 2, 1), "v-min": (1, 1, 1, 1)}   # d_F_down, d_F_up, d_I_up, d_I_down


def _block(p: int, offsets: tuple[int, int, int, int], g: int, h: int) -> dict:
    f_down, f_up, i_up, i_down = offsets
    slot = {}
    for r in range(p):
        slot[("F", r)] = f_down * r
    turn = slot[("F", p - 1)] + 1                       # F of stage P on rank P-1
    for r in range(p):
        slot[("F", 2 * p - 1 - r)] = turn + f_up * (p - 1 - r)
    first_i = slot[("F", 2 * p - 1)] + 1 + g            # I of stage 2P-1 on rank 0
    for r in range(p):
        slot[("I", 2 * p - 1 - r)] = first_i + i_up * r
    back = slot[("I", p)] + 1 + h                       # I of stage P-1 on rank P-1
    for r in range(p):
        slot[("I", r)] = back + i_down * (p - 1 - r)
    return slot


def _collision_free(p: int, slot: dict) -> bool:
    return all(len({slot[(k, s)] % INTERVAL for k in "FI" for s in (r, 2 * p - 1 - r)}) == 4
               for r in range(p))


def _place_w(fi: dict, num_ranks: int) -> dict:
    """W slots of one rank given its F/I slots (slot -> Op): each free slot runs the
    oldest pending W of the rank's up stage, else of its down stage."""
    pending: tuple[list, list] = ([], [])
    out = {}
    todo = sum(1 for op in fi.values() if op.kind == "I")
    t = min(fi, default=0)
    while len(out) < todo:
        op = fi.get(t)
        if op is not None:
            if op.kind == "I":
                pending[0 if op.stage >= num_ranks else 1].append(op)
        else:
            q = pending[0] if pending[0] else pending[1]
            if q:
                i_op = q.pop(0)
                out[t] = Op("W", i_op.stage, i_op.microbatch)
        t += 1
    return out


def _peak(fi: dict, ws: dict) -> int:
    """Most activations alive at once: +1 at an F's slot, -1 after a W's slot."""
    delta: dict = {}
    for t, op in fi.items():
        if op.kind == "F":
            delta[t] = delta.get(t, 0) + 1
    for t in ws:
        delta[t + 1] = delta.get(t + 1, 0) - 1
    cur = best = 0
    for t in sorted(delta):
        cur += delta[t]
        best = max(best, cur)
    return best


def _repeat(p: int, m: int, slot: dict) -> tuple[list, dict]:
    layout_rank = Layout.v_shape(p, m).stage_rank
    fi: list[dict] = [{} for _ in range(p)]
    at = {}
    for (kind, stage), t in slot.items():
        for j in range(m):
            fi[layout_rank[stage]][t + INTERVAL * j] = Op(kind, stage, j)
            at[(kind, stage, j)] = t + INTERVAL * j
    return fi, at


def _repeated_peak(p: int, m: int, slot: dict) -> int:
    fi, _ = _repeat(p, m, slot)
    return max(_peak(f, _place_w(f, p)) for f in fi)


def building_block(num_ranks: int, name: str) -> tuple[dict, tuple[int, int]]:
    """Micro-batch 0's slots ``{(kind, stage): slot}`` of the F and I ops of ``name``
    (``"v-half"`` or ``"v-min"``) on ``num_ranks`` ranks, and the gaps ``(g, h)`` chosen
    (see the module docstring)."""
    p = check_int("num_ranks", num_ranks, 1)
    if name not in OFFSETS:
        raise ValueError(f"name must be one of {sorted(OFFSETS)}, got {name!r}")
    best = None
    for g in range(INTERVAL):
        for h in range(INTERVAL):
            slot = _block(p, OFFSETS[name], g, h)
            if not _collision_free(p, slot):
                continue
            # enough micro-batches that the steady state is reached
            span = max(slot.values()) + 2 * INTERVAL
            key = (_repeated_peak(p, span // INTERVAL + 2, slot), g + h, h)
            if best is None or key < best[0]:
                best = (key, slot, (g, h))
    if best is None:  # pragma: no cover - (g, h) in 0..5 always leaves a collision-free block
        raise AssertionError(f"{name}: no collision-free building block for P = {p}")
    return best[1], best[2]


def v_block_schedule(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """The schedule of ``name`` built from its building block (module docstring). Options
    record the block (``block``: micro-batch 0's F/I slots), the gaps, the interval and
    the memory cap of the squeeze (``cap``, in stage activations)."""
    p = check_int("num_ranks", num_ranks, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    layout = Layout.v_shape(p, m)
    slot, gaps = building_block(p, name)
    fi, at = _repeat(p, m, slot)
    ws = [_place_w(f, p) for f in fi]
    cap = max(_peak(f, w) for f, w in zip(fi, ws))
    warm_end = at[("I", 0, 0)]            # micro-batch 0 leaves the pipeline
    cool_start = at[("F", 0, m - 1)]      # the last micro-batch enters it
    prev, nxt, rank = layout.prev_stage, layout.next_stage, layout.stage_rank
    for (kind, s, j), t in sorted(at.items(), key=lambda kv: kv[1]):
        if warm_end <= t <= cool_start:
            continue
        if kind == "F":
            dep = at[("F", prev[s], j)] if prev[s] >= 0 else -1
        else:
            dep = at[("F", s, j)]
            if nxt[s] >= 0:
                dep = max(dep, at[("I", nxt[s], j)])
        if j > 0:
            dep = max(dep, at[(kind, s, j - 1)])
        r = rank[s]
        for t_new in range(dep + 1, t):
            if t_new in fi[r]:
                continue
            trial = dict(fi[r])
            op = trial.pop(t)
            trial[t_new] = op
            w = _place_w(trial, p)
            if _peak(trial, w) <= cap:
                fi[r], ws[r], at[(kind, s, j)] = trial, w, t_new
                break
    ops = tuple(tuple(op for _, op in sorted({**fi[r], **ws[r]}.items())) for r in range(p))
    options = (("block", tuple(sorted((k, s, t) for (k, s), t in slot.items()))), ("gaps", gaps),
               ("interval", INTERVAL), ("cap", cap))
    return Schedule(name, layout, ops, options)


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Half (controllable-memory paper): building block with offsets ``(2, 1, 2, 1)``,
    repeated every 6 slots and squeezed. With ``F = I = W``: peak ``(P + 2) // 2``
    micro-batches of a rank's layers (1F1B: ``P``), bubble at most half of 1F1B's."""
    return v_block_schedule("v-half", num_ranks, num_microbatches)


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
    """V-Min (controllable-memory paper): building block with the least offsets
    ``(1, 1, 1, 1)``, repeated every 6 slots and squeezed. With ``F = I = W``: peak
    ``(P + 4) // 3`` micro-batches of a rank's layers, bubble at most 2/3 of 1F1B's."""
    return v_block_schedule("v-min", num_ranks, num_microbatches)


__all__ = ["INTERVAL", "OFFSETS", "building_block", "v_block_schedule", "v_half", "v_min"]
