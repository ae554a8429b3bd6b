"""Exact schedule search for small cases: a mixed-integer program (scipy.optimize.milp, HiGHS).

Search space: every schedule of a layout made of ``F``, ``I`` and ``W`` ops (no
overlapped pairs), in which, per stage, the ops of one kind run in micro-batch order
(every generator of the IR does so). For fixed per-rank op orders the best start times
are the as-soon-as-possible ones, which :func:`~pdjax.schedules.simulate` computes, so the
program's optimum is the least simulated makespan over all such orders within the memory
cap, and the tests check it against brute-force enumeration.

Formulation. A start time ``x_o >= 0`` per op and the makespan ``C``:

- dependencies: ``x_F(s,j) >= x_F(prev,j) + F(prev) (+ comm)``, ``x_I(s,j) >= x_F(s,j) + F``,
  ``x_I(s,j) >= x_I(next,j) + I(next) (+ comm)``, ``x_W(s,j) >= x_I(s,j) + I``; per stage and
  kind ``x(j+1) >= x(j) + d``; ``C >= x_o + d_o``;
- one op at a time per rank: for every pair ``a, b`` of a rank's ops whose order the
  rules above leave open, a binary ``y_ab`` (1: ``a`` first) with big-M disjunctions
  ``x_a + d_a <= x_b + M(1 - y_ab)`` and ``x_b + d_b <= x_a + M y_ab``;
- memory (the simulator's W-aware model), at the start of every allocating op ``o``:
  ``alloc(o) + sum_a alloc(a) [a before o] - sum_e free(e) [e before o] <= cap`` (ops on
  a rank do not overlap, so "before" is the order binary or a fixed 0/1);
- ``C <= upper_bound`` (the best greedy's makespan: the search starts from it).
"""

from __future__ import annotations

import numpy as np

from .layout import Layout
from .ops import Op
from .schedule import Schedule


def milp_schedule(layout: Layout, costs: dict, *, cap=np.inf, memory: dict | None = None,
                  upper_bound: float | None = None, time_limit_s: float = 10.0):
    """Solve the program above. Returns ``(schedule or None, status, objective, dual_bound)``;
    ``status`` is ``"optimal"``, ``"time limit"`` (``schedule`` the best found, if any) or
    ``"infeasible"``. ``costs``: per-stage arrays ``F, I, W, comm``; ``memory``: per-stage
    arrays ``F, I, I_free`` (default activation units); ``cap``: per rank or scalar."""
    S, R = layout.num_stages, layout.num_ranks
    dur = {"F": np.asarray(costs["F"], float), "I": np.asarray(costs["I"], float),
           "W": np.asarray(costs["W"], float)}
    comm = np.asarray(costs["comm"], float)
    mem = memory or {}
    mF = np.broadcast_to(np.asarray(mem.get("F", 1.0), float), (S,))
    mI = np.broadcast_to(np.asarray(mem.get("I", 0.0), float), (S,))
    mIf = np.broadcast_to(np.asarray(mem.get("I_free", 0.0), float), (S,))
    caps = np.broadcast_to(np.asarray(cap, float), (R,))
    sr = layout.stage_rank
    ops, index = _enumerate_ops(layout)
    n = len(ops)
    d = np.array([dur[k][s] for k, s, _ in ops])
    big_m = float(d.sum() + comm.sum() * max(layout.num_microbatches, 1) * 2 + 1.0)
    if upper_bound is not None:
        big_m = min(big_m, float(upper_bound) + 1.0)
    C = n
    rows, deps = _precedence_rows(layout, index, dur, comm, d, C)
    fixed_before = _fixed_order(layout, index)
    per_rank = [[o for o, (_, s, _) in enumerate(ops) if sr[s] == r] for r in range(R)]
    pair_var, nv = _order_rows(rows, per_rank, fixed_before, d, big_m, n + 1)
    if np.isfinite(caps).any():
        rows.extend(_memory_rows(ops, per_rank, caps, (mF, mI, mIf), fixed_before, pair_var))
    res = _solve(rows, nv, C, upper_bound, time_limit_s)
    dual = getattr(res, "mip_dual_bound", None)
    if res.x is None:
        return None, "infeasible" if res.status == 2 else "time limit", None, dual
    order = _op_order(res.x[:n], ops, deps, sr, R, d)
    sched = Schedule("milp", layout, tuple(tuple(Op(*ops[o]) for o in row) for row in order))
    status = "optimal" if res.status == 0 else "time limit"
    return sched, status, float(res.fun), dual


def _enumerate_ops(layout: Layout) -> tuple[list, dict]:
    """The program's ops ``(kind, stage, mb)`` (variable ``o`` is the start of ``ops[o]``)
    and their index by op."""
    ops = []          # (kind, stage, mb)
    index = {}
    for s in range(layout.num_stages):
        for j in layout.pipeline_of_stage(s).microbatches:
            for k in "FIW":
                index[(k, s, j)] = len(ops)
                ops.append((k, s, j))
    return ops, index


def _precedence_rows(layout: Layout, index: dict, dur: dict, comm: np.ndarray, d: np.ndarray,
                     C: int) -> tuple[list, list]:
    """Rows ``({var: coef}, lo, hi)`` of the dependencies, the per-stage micro-batch order
    and the makespan (``C >= x_o + d_o``), op by op; and the dependency pairs ``(a, b)``
    (``b`` depends on ``a``)."""
    sr, prev, nxt = layout.stage_rank, layout.prev_stage, layout.next_stage
    rows: list[tuple[dict, float, float]] = []   # ({var: coef}, lo, hi)
    deps: list[tuple[int, int]] = []   # (a, b): b depends on a

    def prec(a: int, b: int, lag: float) -> None:   # x_b >= x_a + lag
        rows.append(({b: 1.0, a: -1.0}, lag, np.inf))
        deps.append((a, b))

    def lag_c(a: int, b: int) -> float:
        return comm[a] if sr[a] != sr[b] else 0.0

    for (k, s, j), o in index.items():
        if k == "F" and prev[s] >= 0:
            prec(index[("F", prev[s], j)], o, dur["F"][prev[s]] + lag_c(prev[s], s))
        if k == "I":
            prec(index[("F", s, j)], o, dur["F"][s])
            if nxt[s] >= 0:
                prec(index[("I", nxt[s], j)], o, dur["I"][nxt[s]] + lag_c(nxt[s], s))
        if k == "W":
            prec(index[("I", s, j)], o, dur["I"][s])
        mbs = layout.pipeline_of_stage(s).microbatches
        if j + 1 in mbs:
            prec(o, index[(k, s, j + 1)], d[o])
        rows.append(({C: 1.0, o: -1.0}, d[o], np.inf))
    return rows, deps


def _fixed_order(layout: Layout, index: dict) -> set:
    """``(a, b)`` pairs where ``a`` surely ends before ``b`` starts (same rank): the
    transitive closure of F(s,j) < I(s,j) < W(s,j) and same-kind micro-batch order on a stage."""
    fixed_before = set()
    for s in range(layout.num_stages):
        mbs = list(layout.pipeline_of_stage(s).microbatches)
        for a_i, ja in enumerate(mbs):
            for jb in mbs[a_i:]:
                for ka, kb in (("F", "F"), ("I", "I"), ("W", "W"), ("F", "I"), ("F", "W"), ("I", "W")):
                    if ka == kb and ja == jb:
                        continue
                    fixed_before.add((index[(ka, s, ja)], index[(kb, s, jb)]))
    return fixed_before


def _order_rows(rows: list, per_rank: list, fixed_before: set, d: np.ndarray, big_m: float,
                nv: int) -> tuple[dict, int]:
    """Append to ``rows`` the big-M disjunctions of every same-rank pair whose order is
    open, each with a new binary (numbered from ``nv``); returns ``({(a, b): binary}, the
    variable count)``."""
    pair_var = {}
    for lst in per_rank:
        for x, a in enumerate(lst):
            for b in lst[x + 1:]:
                if (a, b) in fixed_before or (b, a) in fixed_before:
                    continue
                y = nv
                nv += 1
                pair_var[(a, b)] = y
                # y = 1: a first; y = 0: b first
                rows.append(({b: 1.0, a: -1.0, y: -big_m}, d[a] - big_m, np.inf))
                rows.append(({a: 1.0, b: -1.0, y: big_m}, d[b], np.inf))
    return pair_var, nv


def _memory_rows(ops: list, per_rank: list, caps: np.ndarray, memory: tuple, fixed_before: set,
                 pair_var: dict) -> list:
    """Rows of the memory cap of each rank with a finite one, at the start of every
    allocating op (``memory``: per-stage ``(F, I, I_free)`` amounts)."""
    mF, mI, mIf = memory

    def before(a: int, b: int):
        """(constant, {var: coef}): 1 when a runs before b on their rank."""
        if (a, b) in fixed_before:
            return 1.0, {}
        if (b, a) in fixed_before:
            return 0.0, {}
        if (a, b) in pair_var:
            return 0.0, {pair_var[(a, b)]: 1.0}
        return 1.0, {pair_var[(b, a)]: -1.0}

    def alloc(o):
        k, s, _ = ops[o]
        return mF[s] if k == "F" else (mI[s] if k == "I" else 0.0)

    def free(o):
        k, s, _ = ops[o]
        return mIf[s] if k == "I" else (mF[s] + mI[s] - mIf[s] if k == "W" else 0.0)

    rows = []
    for r in range(len(per_rank)):
        if not np.isfinite(caps[r]):
            continue
        for o in per_rank[r]:
            if alloc(o) <= 0:
                continue
            coef: dict = {}
            const = alloc(o)
            for a in per_rank[r]:
                if a == o:
                    continue
                amount = alloc(a) - free(a)
                if amount == 0:
                    continue
                c0, terms = before(a, o)
                const += amount * c0
                for v, cf in terms.items():
                    coef[v] = coef.get(v, 0.0) + amount * cf
            rows.append((coef, -np.inf, caps[r] - const))
    return rows


def _solve(rows: list, nv: int, C: int, upper_bound: float | None, time_limit_s: float):
    """Minimise the makespan ``C`` subject to ``rows`` (the variables after ``C`` binary)
    with scipy's HiGHS; returns its result."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    A = lil_matrix((len(rows), nv))
    lo = np.empty(len(rows))
    hi = np.empty(len(rows))
    for i, (coef, a, b) in enumerate(rows):
        for v, cf in coef.items():
            A[i, v] = cf
        lo[i], hi[i] = a, b
    ub = np.full(nv, np.inf)
    ub[C + 1:] = 1.0
    if upper_bound is not None:
        ub[C] = float(upper_bound) + 1e-9
    integrality = np.zeros(nv)
    integrality[C + 1:] = 1
    obj = np.zeros(nv)
    obj[C] = 1.0
    return milp(obj, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
                bounds=Bounds(np.zeros(nv), ub),
                options={"time_limit": float(time_limit_s), "disp": False, "mip_rel_gap": 1e-9})


def _op_order(x: np.ndarray, ops: list, deps: list, stage_rank, num_ranks: int,
              durations=None) -> list[list[int]]:
    """Per-rank op orders from the solver's start times ``x``, never against a dependency.

    The solver meets its constraints only to a tolerance (a W may start 1e-9 before its
    I), and zero-length ops tie with others, so sorting raw times can put an op before
    one it depends on. Kahn's order over the dependency graph, taking among the ready
    ops the earliest start (rounded to 1e-6), then the earliest end (``durations``: a
    zero-length op starting where a longer one does ran before it), then F before I
    before W, keeps the solver's order wherever it is unambiguous and is valid by
    construction."""
    import heapq

    succ: list[list[int]] = [[] for _ in ops]
    indeg = [0] * len(ops)
    for a, b in deps:
        succ[a].append(b)
        indeg[b] += 1
    d = np.zeros(len(ops)) if durations is None else np.asarray(durations, float)
    key = [(round(float(x[o]), 6), round(float(x[o] + d[o]), 6), "FIW".index(k), s, j, o)
           for o, (k, s, j) in enumerate(ops)]
    ready = [key[o] for o in range(len(ops)) if indeg[o] == 0]
    heapq.heapify(ready)
    order: list[list[int]] = [[] for _ in range(num_ranks)]
    while ready:
        o = heapq.heappop(ready)[-1]
        order[stage_rank[ops[o][1]]].append(o)
        for b in succ[o]:
            indeg[b] -= 1
            if indeg[b] == 0:
                heapq.heappush(ready, key[b])
    return order
