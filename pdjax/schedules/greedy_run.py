"""One run of the greedy list scheduler of :func:`~pdjax.schedules.greedy.greedy_schedule`
(see that module's docstring for the rules): the per-rank state, the choice of each rank's
next op under the memory cap, and the loop that commits the earliest choice over all ranks."""

from __future__ import annotations

import heapq

from .layout import Layout
from .ops import Op, OverlapFB


class GreedyRun:
    """The state of one greedy run over ``layout``: ``costs`` the per-stage ``(F, I, W, FB,
    comm)`` lists, ``memory`` the per-stage ``(mem_F, mem_I, mem_I_free)`` lists, ``caps``
    one memory cap per rank, ``policy`` a :class:`~pdjax.schedules.greedy.Policy`.
    :meth:`run` returns the per-rank op lists (None when the caps let no rank progress);
    ``binding`` then says whether the cap ever refused an op (if not, a larger cap changes
    nothing)."""

    # slots: the hot loop reads these often (as fast as the closures of a single function)
    __slots__ = ("f", "i_", "w", "fb", "cm", "mf", "mi", "mif", "caps", "policy", "sr", "prev", "nxt", "mbs",
                 "need_total", "inflight", "rank_stages", "f_done", "g_done", "nf", "nb", "wq", "free", "mem",
                 "ops", "left_total", "binding", "choice", "version", "heap")

    def __init__(self, layout: Layout, costs: tuple, memory: tuple, caps: list, policy):
        S, R = layout.num_stages, layout.num_ranks
        self.f, self.i_, self.w, self.fb, self.cm = costs
        self.mf, self.mi, self.mif = memory
        self.caps, self.policy = caps, policy
        sr = self.sr = layout.stage_rank
        self.prev, self.nxt = layout.prev_stage, layout.next_stage
        self.mbs = mbs = [list(layout.pipeline_of_stage(s).microbatches) for s in range(S)]
        # deadlock avoidance (banker's rule): an allocation is allowed only if afterwards the
        # rank's micro-batches, oldest first, can each still allocate all they will need here
        # (their remaining forwards and input-grads) once the older ones have freed theirs
        self.need_total = [sum(self.mf[q] + self.mi[q] for q in layout.pipeline_of_stage(s).stages
                               if sr[q] == sr[s]) for s in range(S)]
        self.inflight: list[dict] = [{} for _ in range(R)]   # rank -> {mb: [held, remaining]} by age
        depth = [layout.pipeline_of_stage(s).stages.index(s) for s in range(S)]
        self.rank_stages = [sorted(layout.stages_on_rank(r),
                                   key=lambda s: -depth[s] if policy.deep_first else depth[s])
                            for r in range(R)]
        self.f_done: dict = {}   # (stage, mb) -> end of its forward
        self.g_done: dict = {}   # (stage, mb) -> end of its input-grad backward
        self.nf, self.nb = [0] * S, [0] * S        # next forward / backward index per stage
        self.wq: list[list[tuple[int, int]]] = [[] for _ in range(R)]
        self.free = [0.0] * R
        self.mem = [0.0] * R
        self.ops: list[list] = [[] for _ in range(R)]
        self.left_total = sum(sum(3 * len(mbs[s]) for s in layout.stages_on_rank(r)) for r in range(R))
        self.binding = False   # whether the cap ever refused an op
        # one cached choice per rank, valid until the rank or a neighbour feeding it commits
        # an op (its inputs, memory and W queue change only then); heap entries carry the
        # version of the choice they were made for, and older ones are skipped
        self.choice: list = [None] * R
        self.version = [0] * R
        self.heap: list = []

    # ---- readiness and memory ---------------------------------------------------------
    def arrival(self, stage: int, src: int, table: dict, mb: int):
        """When ``src``'s output for ``mb`` reaches ``stage`` (None: not produced yet)."""
        t = table.get((src, mb))
        if t is None:
            return None
        sr = self.sr
        return t + (self.cm[src] if sr[src] != sr[stage] else 0.0)

    def f_ready(self, s: int):
        """When stage s's next forward has its input (None: none left or not produced)."""
        k, mbs, p = self.nf[s], self.mbs[s], self.prev[s]
        if k >= len(mbs):
            return None
        return 0.0 if p < 0 else self.arrival(s, p, self.f_done, mbs[k])

    def b_ready(self, s: int):
        """When stage s's next input-grad has its forward and output gradient (or None)."""
        k, mbs, n = self.nb[s], self.mbs[s], self.nxt[s]
        if k >= len(mbs):
            return None
        mb = mbs[k]
        t = self.f_done.get((s, mb))
        if t is None:
            return None
        if n >= 0:
            g = self.arrival(s, n, self.g_done, mb)
            if g is None:
                return None
            t = max(t, g)
        return t

    def fits(self, r: int, s: int, mb: int, amount: float) -> bool:
        """Whether rank r can allocate ``amount`` for ``mb`` at stage s (records a refusal)."""
        if not self._fits(r, s, mb, amount):
            self.binding = True
            return False
        return True

    def _fits(self, r: int, s: int, mb: int, amount: float) -> bool:
        """The cap and the banker's rule (see ``__init__``) after the allocation."""
        inflight, cap = self.inflight[r], self.caps[r]
        entry = inflight.get(mb)
        held, rem = entry if entry is not None else (0.0, self.need_total[s])
        running = self.mem[r] + amount
        if running > cap + 1e-9:
            return False
        for k, (h, q) in inflight.items():
            if k == mb:
                h, q = held + amount, rem - amount
            if running + q > cap + 1e-9:
                return False
            running -= h
        if entry is None and running + rem - amount > cap + 1e-9:
            return False
        return True

    def take(self, r: int, s: int, mb: int, alloc: float, freed: float) -> None:
        """Book ``alloc`` allocated and ``freed`` freed by ``mb`` at stage s on rank r."""
        entry = self.inflight[r].setdefault(mb, [0.0, self.need_total[s]])
        entry[0] += alloc - freed
        entry[1] -= alloc
        self.mem[r] += alloc - freed

    # ---- choosing -----------------------------------------------------------------------
    def choose(self, r: int):
        """(start, kind, stage, partner stage) of rank r's next op, or None."""
        policy, mbs, wq, fits = self.policy, self.mbs, self.wq, self.fits
        t0 = self.free[r]
        cands = []   # (ready time, priority, kind, stage)
        for s in self.rank_stages[r]:
            tf = self.f_ready(s)
            if tf is not None and fits(r, s, mbs[s][self.nf[s]], self.mf[s]):
                cands.append((max(tf, t0), 1 if not policy.forward_first else 0, "F", s))
            tb = self.b_ready(s)
            if tb is not None and fits(r, s, mbs[s][self.nb[s]], self.mi[s]):
                cands.append((max(tb, t0), 0 if not policy.forward_first else 1, "I", s))
        if wq[r]:
            lag = policy.w_lag
            urgent = lag is not None and len(wq[r]) > lag
            cands.append((t0, -1 if urgent else 2, "W", wq[r][0][0]))
        if not cands:
            return None
        start = min(c[0] for c in cands)
        ready = [c for c in cands if c[0] <= start]
        best = min(ready, key=lambda c: c[1])   # stable: rank_stages order breaks ties
        if policy.overlap and best[2] in "FI":
            fwd = next((c[3] for c in ready if c[2] == "F"), None)
            bwd = next((c[3] for c in ready if c[2] == "I" and c[3] != fwd), None)
            if fwd is not None and bwd is not None:
                return start, "P", fwd, bwd
        return start, best[2], best[3], -1

    def refresh(self, q: int) -> None:
        """Recompute rank q's choice and queue it under a new version."""
        self.version[q] += 1
        self.choice[q] = c = self.choose(q)
        if c is not None:
            heapq.heappush(self.heap, (c[0], q, self.version[q]))

    # ---- committing -----------------------------------------------------------------------
    def run(self) -> list[list] | None:
        """Commit the earliest choice over all ranks until every op ran; the per-rank op
        lists, or None when no rank can make progress."""
        heap, version = self.heap, self.version
        for r in range(len(self.free)):
            self.refresh(r)
        while self.left_total:
            while heap and heap[0][2] != version[heap[0][1]]:
                heapq.heappop(heap)
            if not heap:
                return None
            _, r, _ = heapq.heappop(heap)
            start, kind, s, s2 = self.choice[r]
            if kind == "W":
                end, touched = self._commit_w(r, start)
            else:
                end, touched = self._commit_f_i(r, start, kind, s, s2)
            self.free[r] = end
            touched.add(r)
            for q in touched:
                self.refresh(q)
        return self.ops

    def _commit_w(self, r: int, start: float) -> tuple[float, set]:
        """Run rank r's oldest queued W from ``start``: it frees the rest of its memory."""
        mf, mi, mif = self.mf, self.mi, self.mif
        s_w, mb = self.wq[r].pop(0)
        end = start + self.w[s_w]
        entry = self.inflight[r][mb]
        entry[0] -= mf[s_w] + mi[s_w] - mif[s_w]
        self.mem[r] -= mf[s_w] + mi[s_w] - mif[s_w]
        if entry[1] <= 1e-12 and entry[0] <= 1e-9:
            del self.inflight[r][mb]
        self.ops[r].append(Op("W", s_w, mb))
        self.left_total -= 1
        return end, set()

    def _commit_f_i(self, r: int, start: float, kind: str, s: int, s2: int) -> tuple[float, set]:
        """Run an F, an I, or an overlapped pair (``kind`` "P": forward of ``s``, input-grad
        of ``s2``) on rank r from ``start``; returns its end and the ranks it feeds."""
        mbs, nf, nb, sr, touched = self.mbs, self.nf, self.nb, self.sr, set()
        if kind == "P":   # an overlapped pair: forward of stage s, input-grad of s2
            dur = max(self.fb[s] - self.w[s2], 0.0)
            parts = [("F", s), ("I", s2)]
        else:
            dur = self.f[s] if kind == "F" else self.i_[s]
            parts = [(kind, s)]
        end = start + dur
        made = []
        for k, st in parts:
            if k == "F":
                mb = mbs[st][nf[st]]
                nf[st] += 1
                self.f_done[(st, mb)] = end
                self.take(r, st, mb, self.mf[st], 0.0)
                made.append(Op("F", st, mb))
                if self.nxt[st] >= 0:
                    touched.add(sr[self.nxt[st]])
            else:
                mb = mbs[st][nb[st]]
                nb[st] += 1
                self.g_done[(st, mb)] = end
                self.take(r, st, mb, self.mi[st], self.mif[st])
                self.wq[r].append((st, mb))
                made.append(Op("I", st, mb))
                if self.prev[st] >= 0:
                    touched.add(sr[self.prev[st]])
            self.left_total -= 1
        self.ops[r].append(made[0] if len(made) == 1 else OverlapFB(made[0], made[1]))
        return end, touched
