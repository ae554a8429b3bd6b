"""Serving instances of the simulator: prefill, decode (plain or AF unit) and colocated.

An instance runs one step at a time; the simulator asks it for a step plan
(``plan(t)``, returning the step's duration or None when idle) and applies it when the
step ends (``complete(t)``). Step times come from the cost model only.

* :class:`DecodeState`: continuous batching bookkeeping for one or more DP ranks (an AF
  unit's attention instances are its ranks): KV reservations, running requests, the KV
  total per rank kept incrementally, and the step at which each request finishes.
* :class:`PrefillInstance`: DP ranks with FIFO queues, chunked prefill by token budget or
  by time budget, and the outgoing KV link (layer-wise transfer, FIFO).
* :class:`DecodeInstance`: a decode pool member (plain, or an AF unit with M ranks).
* :class:`~pdjax.sim.colocated.ColocatedInstance` (its own module): prefill and decode on
  one instance.
"""

from __future__ import annotations

import math
from collections import deque

from pdjax.sim.cost import has_totals
from pdjax.sim.policies import chunk_for_budget, pick_by_quota


def handoff_overhead(cost, st: "DecodeState", joins: bool = True, leaves: bool = True) -> float:
    """The cost model's ``decode_overhead(joined, left)`` for the step about to run (0 when
    the model has none). The caller drops what its driver does off the critical path:
    ``leaves`` only for a step right after the previous decode step (a loop that went idle
    freed the blocks while idle); neither after a prefill step during which the loop had a
    batch (it did that work while the prefill held the pool)."""
    f = getattr(cost, "decode_overhead", None)
    if f is None:
        return 0.0
    return f(len(st.joined) if joins else 0, st.left if leaves else 0)


class Instance:
    pool = ""
    decode_step = False                 # the step planned last is a decode step

    def __init__(self, sim, iid: int, t: float):
        self.sim, self.iid = sim, iid
        self.busy = False
        self.draining = False
        self.busy_time = 0.0
        self.t_created, self.t_retired = t, math.nan
        self.steps = 0

    def alive_time(self, t_end: float) -> float:
        end = self.t_retired if not math.isnan(self.t_retired) else t_end
        return max(0.0, end - self.t_created)


class DecodeState:
    """Continuous-batching state of ``ranks`` DP ranks, each holding at most
    ``capacity`` KV tokens and ``max_batch`` requests (reserved ahead of arrival)."""

    def __init__(self, ranks: int, capacity: float, max_batch: float):
        self.R = ranks
        self.capacity, self.max_batch = capacity, max_batch
        self.n = [0] * ranks                # running requests
        self.kv = [0] * ranks               # their cached tokens before this step
        self.res_tokens = [0] * ranks       # reserved tokens (running + promised)
        self.res_count = [0] * ranks
        self.running = [dict() for _ in range(ranks)]
        self.promised: dict = {}            # rid -> request reserved here, not yet joined
        self.joining: list = []
        self.finish_at: dict[int, list] = {}
        self.step_idx = 0
        self.joined: list = []              # joiners of the step in flight
        self.left = 0                       # requests that left at the end of the last step

    def fits(self, rank: int, need: int) -> bool:
        return (self.res_tokens[rank] + need <= self.capacity
                and self.res_count[rank] + 1 <= self.max_batch)

    def reserve(self, req, rank: int) -> None:
        req.rank = rank
        self.res_tokens[rank] += req.context_len
        self.res_count[rank] += 1
        self.promised[req.rid] = req

    def release(self, req) -> None:
        self.res_tokens[req.rank] -= req.context_len
        self.res_count[req.rank] -= 1
        self.promised.pop(req.rid, None)

    @property
    def active(self) -> bool:
        return bool(self.joining) or any(self.n)

    @property
    def total_running(self) -> int:
        return sum(self.n)

    def start(self) -> None:
        """Move joiners into the batch of the step about to run."""
        k = self.step_idx
        self.joined = self.joining
        for req in self.joining:
            r = req.rank
            self.promised.pop(req.rid, None)
            req.join_step = k
            self.n[r] += 1
            self.kv[r] += req.input_len
            self.running[r][req.rid] = req
            self.finish_at.setdefault(k + req.output_len - 2, []).append(req)
        self.joining = []

    def kv_lens(self, rank: int) -> list:
        k = self.step_idx
        return [q.input_len + k - q.join_step for q in self.running[rank].values()]

    def advance(self) -> list:
        """End of the current step: every running request gains a token; returns the
        requests that produced their last token."""
        for r in range(self.R):
            self.kv[r] += self.n[r]
        done = self.finish_at.pop(self.step_idx, [])
        self.left = len(done)
        for req in done:
            r = req.rank
            self.n[r] -= 1
            self.kv[r] -= req.input_len + req.output_len - 1
            del self.running[r][req.rid]
        self.step_idx += 1
        return done


class PrefillInstance(Instance):
    pool = "prefill"

    def __init__(self, sim, iid, t, *, dp_ranks=1, token_budget=8192, time_budget=None,
                 link_bw=None, layerwise=True, num_layers=1, quota=1.0, max_requests=math.inf):
        super().__init__(sim, iid, t)
        self.max_requests = max_requests
        self.queues = [deque() for _ in range(dp_ranks)]
        self.pending = [0.0] * dp_ranks     # predicted seconds of queued work per rank
        self.token_budget, self.time_budget = token_budget, time_budget
        self.link_bw, self.layerwise, self.L = link_bw, layerwise, max(1, num_layers)
        self.quota = quota
        self.link_free = 0.0
        self.link_busy = 0.0
        self.bytes_sent = 0.0
        self.plan_chunks: list = []
        self.t_step = 0.0
        self.dur = 0.0

    @property
    def pending_total(self) -> float:
        return sum(self.pending)

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self.queues)

    def enqueue(self, req, t: float) -> None:
        rank = pick_by_quota(self.pending)
        req.prank = rank
        req.pred_cost = self.sim.cost.prefill_step_time([(req.input_len - req.prefilled, req.prefilled)])
        self.pending[rank] += req.pred_cost
        self.queues[rank].append(req)

    def _rank_chunks(self, queue) -> list:
        cost = self.sim.cost.prefill_step_time
        chunks, pairs = [], []
        left = self.token_budget
        for req in queue:
            remaining = req.input_len - req.prefilled
            if self.time_budget is not None:
                q = chunk_for_budget(cost, pairs, req.prefilled, min(remaining, left), self.time_budget)
            else:
                q = min(remaining, left)
            if q <= 0:
                break
            chunks.append((req, q))
            pairs.append((q, req.prefilled))
            left -= q
            if q < remaining or left <= 0 or len(chunks) >= self.max_requests:
                break
        return chunks

    def plan(self, t: float):
        if not any(self.queues):
            return None
        cost = self.sim.cost.prefill_step_time
        self.plan_chunks, dur = [], 0.0
        for queue in self.queues:
            chunks = self._rank_chunks(queue)
            if chunks:
                for req, _ in chunks:
                    if math.isnan(req.t_prefill_start):
                        req.t_prefill_start = t
                dur = max(dur, cost([(q, req.prefilled) for req, q in chunks]))
                self.plan_chunks.extend(chunks)
        self.t_step, self.dur = t, dur
        return dur

    def _push_kv(self, tokens: int) -> float:
        """Layer-wise FIFO transfer of ``tokens`` tokens of KV computed in the step that
        just ended; returns when the last byte lands. Layer l's share (1/L of the bytes)
        is ready at t0 + (l+1) T / L, so the finish is
        max(link_free + x, t0 + T/L + x, t0 + T + x/L) with x the whole transfer time."""
        if tokens <= 0:
            return self.t_step + self.dur
        x = self.sim.cost.kv_transfer_time(tokens, self.link_bw)
        t0, T, L = self.t_step, self.dur, self.L
        if self.layerwise:
            end = max(self.link_free + x, t0 + T / L + x, t0 + T + x / L)
        else:
            end = max(self.link_free, t0 + T) + x
        self.link_free = end
        self.link_busy += x
        self.bytes_sent += tokens * self.sim.kv_bytes
        return end

    def complete(self, t: float) -> None:
        done = []
        tokens = 0
        for req, q in self.plan_chunks:
            if req.output_len > 1:
                tokens += q + (req.cached if req.prefilled == req.cached else 0)
            req.prefilled += q
            if req.prefilled >= req.input_len:
                done.append(req)
        kv_ready = self._push_kv(tokens) if self.link_bw else t
        for req in done:
            queue = self.queues[req.prank]
            if queue[0] is req:
                queue.popleft()
            else:
                queue.remove(req)
            self.pending[req.prank] -= req.pred_cost
            if not queue:
                self.pending[req.prank] = 0.0
            self.sim.prefill_done(req, t, kv_ready)
        self.plan_chunks = []

    @property
    def empty(self) -> bool:
        return not any(self.queues) and not self.busy


class DecodeInstance(Instance):
    """A decode pool member; ``afd`` (an AFDStepModel) makes it an AF unit whose ranks are
    its M attention instances."""

    pool = "decode"
    decode_step = True

    def __init__(self, sim, iid, t, *, capacity, max_batch=math.inf, ranks=1, afd=None):
        super().__init__(sim, iid, t)
        self.state = DecodeState(ranks, capacity, max_batch)
        self.afd = afd
        self._fast = has_totals(sim.cost, "decode_step_time_totals")
        self.t_step = 0.0
        self.t_end = -1.0               # when the last step ended
        self.unseen: list = []          # arrivals the decode loop sees when this step ends

    def join(self, req) -> None:
        self.state.joining.append(req)

    def plan(self, t: float):
        st = self.state
        if not st.active:
            return None
        st.start()
        back_to_back = t == self.t_end
        self.t_step = t
        if self.afd is not None:
            if self.afd._fast:
                return self.afd.step_time_totals(list(zip(st.n, st.kv)))
            return self.afd.step_time([st.kv_lens(r) for r in range(st.R)])
        return self._step_time() + handoff_overhead(self.sim.cost, st, leaves=back_to_back)

    def _step_time(self) -> float:
        st = self.state
        if self._fast:
            return self.sim.cost.decode_step_time_totals(st.n[0], st.kv[0])
        return self.sim.cost.decode_step_time(st.kv_lens(0))

    def complete(self, t: float) -> None:
        st = self.state
        n = st.total_running
        self.sim.record_itl(t - self.t_step, n - len(st.joined))
        for req in st.joined:
            self.sim.record_itl(t - req.t_first, 1)
        self.sim.tokens_out += n
        for req in st.advance():
            self.sim.finish(req, t)
        self.t_end = t
        seen, self.unseen = self.unseen, []
        for req in seen:
            self.sim.place(req, t)

    @property
    def empty(self) -> bool:
        st = self.state
        return not self.busy and not st.active and not any(st.res_count) and not self.unseen
