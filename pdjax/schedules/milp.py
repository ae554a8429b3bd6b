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
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    S, R = layout.num_stages, layout.num_ranks
    dur = {"F": np.asarray(costs["F"], float), "I": np.asarray(costs["I"], float),
           "W": np.asarray(costs["W"], float)}
    comm = np.asarray(costs["comm"], float)
    mem = memory or {}
    mF = np.broadcast_to(np.asarray(mem.get("F", 1.0), float), (S,))
    mI = np.broadcast_to(np.asarray(mem.get("I", 0.0), float), (S,))
    mIf = np.broadcast_to(np.asarray(mem.get("I_free", 0.0), float), (S,))
    caps = np.broadcast_to(np.asarray(cap, float), (R,))
    sr, prev, nxt = layout.stage_rank, layout.prev_stage, layout.next_stage
    ops = []          # (kind, stage, mb)
    index = {}
    for s in range(S):
        for j in layout.pipeline_of_stage(s).microbatches:
            for k in "FIW":
                index[(k, s, j)] = len(ops)
                ops.append((k, s, j))
    n = len(ops)
    d = np.array([dur[k][s] for k, s, _ in ops])
    big_m = float(d.sum() + comm.sum() * max(layout.num_microbatches, 1) * 2 + 1.0)
    if upper_bound is not None:
        big_m = min(big_m, float(upper_bound) + 1.0)
    rows: list[tuple[dict, float, float]] = []   # ({var: coef}, lo, hi)
    C = n

    deps: list[tuple[int, int]] = []   # (a, b): b depends on a

    def prec(a: int, b: int, lag: float) -> None:   # x_b >= x_a + lag
        rows.append(({b: 1.0, a: -1.0}, lag, np.inf))
        deps.append((a, b))

    fixed_before = set()   # (a, b): a surely ends before b starts (same rank)
    for (k, s, j), o in index.items():
        lag_c = lambda a, b: comm[a] if sr[a] != sr[b] else 0.0  # noqa: E731
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
    # order facts implied by the chains above (same rank only): transitive closure of
    # F(s,j) < I(s,j) < W(s,j) and same-kind micro-batch order on a stage
    for s in range(S):
        mbs = list(layout.pipeline_of_stage(s).microbatches)
        for a_i, ja in enumerate(mbs):
            for jb in mbs[a_i:]:
                for ka, kb in (("F", "F"), ("I", "I"), ("W", "W"), ("F", "I"), ("F", "W"), ("I", "W")):
                    if ka == kb and ja == jb:
                        continue
                    fixed_before.add((index[(ka, s, ja)], index[(kb, s, jb)]))
    per_rank = [[o for o, (_, s, _) in enumerate(ops) if sr[s] == r] for r in range(R)]
    pair_var = {}
    nv = n + 1
    for r in range(R):
        lst = per_rank[r]
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

    if np.isfinite(caps).any():
        for r in range(R):
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
    A = lil_matrix((len(rows), nv))
    lo = np.empty(len(rows))
    hi = np.empty(len(rows))
    for i, (coef, a, b) in enumerate(rows):
        for v, cf in coef.items():
            A[i, v] = cf
        lo[i], hi[i] = a, b
    ub = np.full(nv, np.inf)
    ub[n + 1:] = 1.0
    if upper_bound is not None:
        ub[C] = float(upper_bound) + 1e-9
    integrality = np.zeros(nv)
    integrality[n + 1:] = 1
    obj = np.zeros(nv)
    obj[C] = 1.0
    res = milp(obj, constraints=LinearConstraint(A.tocsr(), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), ub),
               options={"time_limit": float(time_limit_s), "disp": False, "mip_rel_gap": 1e-9})
    dual = getattr(res, "mip_dual_bound", None)
    if res.x is None:
        return None, "infeasible" if res.status == 2 else "time limit", None, dual
    order = _op_order(res.x[:n], ops, deps, sr, R)
    sched = Schedule("milp", layout, tuple(tuple(Op(*ops[o]) for o in row) for row in order))
    status = "optimal" if res.status == 0 else "time limit"
    return sched, status, float(res.fun), dual


def _op_order(x: np.ndarray, ops: list, deps: list, stage_rank, num_ranks: int) -> list[list[int]]:
    """Per-rank op orders from the solver's start times ``x``, never against a dependency.

    The solver meets its constraints only to a tolerance (a W may start 1e-9 before its
    I), and zero-length ops tie with others, so sorting raw times can put an op before
    one it depends on. Kahn's order over the dependency graph, taking among the ready
    ops the earliest start (rounded to 1e-6), then F before I before W, keeps the
    solver's order wherever it is unambiguous and is valid by construction."""
    import heapq

    succ: list[list[int]] = [[] for _ in ops]
    indeg = [0] * len(ops)
    for a, b in deps:
        succ[a].append(b)
        indeg[b] += 1
    key = [(round(float(x[o]), 6), "FIW".index(k), s, j, o) for o, (k, s, j) in enumerate(ops)]
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
