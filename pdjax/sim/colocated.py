"""The colocated serving instance of the simulator: prefill and decode on one instance.

Sarathi-style mixed steps (running decodes take one token of the step's token budget each
and prefill chunks fill the rest), or alternating steps (a step is either prefill chunks or
a decode step; they take turns when both wait), optionally scheduled by an engine's decode
loop that looks at its queues only between decode steps (see :class:`pdjax.sim.Colocated`).
"""

from __future__ import annotations

import math
from collections import deque

from pdjax.sim.cost import has_totals
from pdjax.sim.instances import DecodeState, Instance, handoff_overhead
from pdjax.sim.policies import chunk_for_budget


class ColocatedInstance(Instance):
    """Prefill and decode on one instance. Mixed steps (default): each step runs the decode
    batch plus prefill chunks filling the token budget. ``alternate``: a step is either
    prefill chunks (at most ``token_budget`` tokens of at most ``max_requests`` requests) or
    a decode step; when both wait, they take turns. ``decode_loop`` (with ``alternate``):
    the scheduler looks at its queues only between decode steps while requests decode (see
    :class:`pdjax.sim.Colocated`)."""

    pool = "colocated"

    def __init__(self, sim, iid, t, *, capacity, max_batch=math.inf, token_budget=2048,
                 time_budget=None, alternate=False, max_requests=math.inf, decode_loop=False):
        super().__init__(sim, iid, t)
        self.state = DecodeState(1, capacity, max_batch)
        self.waiting: deque = deque()
        self.prefilling: list = []
        self.token_budget, self.time_budget = token_budget, time_budget
        self.alternate, self.max_requests, self.loop = alternate, max_requests, decode_loop
        self.decoding = True            # the step in flight (or the last one) is a decode step
        self.t_tokens = 0.0             # when the last decode step ended (its tokens' time)
        # decode_loop: what the loop has not looked at yet
        self.unseen: list = []          # arrivals
        self.held: set = set()          # admitted at its last look: prefill after its next step
        self.tailing: list = []         # prefilled: first token at the end of the next decode step
        self.unseen_ready: list = []    # first token out: joins after the loop's next look
        self.pending = 0.0
        self.plan_chunks: list = []
        self.t_step = 0.0
        self._fast_d = has_totals(sim.cost, "decode_step_time_totals")
        self._fast_p = has_totals(sim.cost, "prefill_step_time_totals")

    @property
    def _loop_running(self) -> bool:
        """The decode loop has admitted requests to decode (it then looks between steps)."""
        return self.loop and self.state.active

    def enqueue(self, req, t: float) -> None:
        req.pred_cost = self.sim.cost.prefill_step_time([(req.input_len - req.prefilled, req.prefilled)])
        self.pending += req.pred_cost
        (self.unseen if self._loop_running else self.waiting).append(req)

    def _admit(self, t: float) -> list:
        st = self.state
        admitted = []
        while self.waiting and st.fits(0, self.waiting[0].context_len):
            req = self.waiting.popleft()
            st.reserve(req, 0)
            req.decode_inst = self
            req.t_handshake = t
            self.prefilling.append(req)
            admitted.append(req)
        return admitted

    def _chunks(self, t: float, left: int, dec_pairs) -> tuple[list, list]:
        """Prefill chunks of the step starting at ``t`` within ``left`` tokens (and the time
        budget, counting ``dec_pairs`` decode rows already in the step)."""
        cost = self.sim.cost.prefill_step_time
        chunks, pairs = [], []
        for req in self.prefilling:
            if req.rid in self.held:
                continue
            remaining = req.input_len - req.prefilled
            if self.time_budget is not None:
                q = chunk_for_budget(cost, (dec_pairs or []) + pairs, req.prefilled,
                                     min(remaining, left), self.time_budget)
            else:
                q = min(remaining, left)
            if q <= 0:
                break
            if math.isnan(req.t_prefill_start):
                req.t_prefill_start = t
            chunks.append((req, q))
            pairs.append((q, req.prefilled))
            left -= q
            if q < remaining or left <= 0 or len(chunks) >= self.max_requests:
                break
        return chunks, pairs

    def _decode_time(self, t_start: float, after_prefill: bool) -> float:
        st = self.state
        if self._fast_d:
            t = self.sim.cost.decode_step_time_totals(st.n[0], st.kv[0])
        else:
            t = self.sim.cost.decode_step_time(st.kv_lens(0))
        if after_prefill and st.n[0] > len(st.joined):   # the loop ran: its work hid under the prefill
            return t
        return t + handoff_overhead(self.sim.cost, st, leaves=t_start == self.t_tokens)

    def plan(self, t: float):
        if not self._loop_running:
            self._admit(t)
        st = self.state
        if not st.active and not self.prefilling:
            return None
        self.t_step = t
        if self.alternate:
            eligible = any(r.rid not in self.held for r in self.prefilling)
            after_prefill = not self.decoding
            self.decoding = self.decode_step = st.active and (not eligible or not self.decoding)
            if self.decoding:
                st.start()
                self.plan_chunks = []
                return self._decode_time(t, after_prefill)
            self.plan_chunks, pairs = self._chunks(t, self.token_budget, None)
            if not self.plan_chunks:
                return None
            return self.sim.cost.prefill_step_time(pairs)
        st.start()
        n_dec = st.n[0]
        left = self.token_budget - n_dec
        chunks, pairs, dec_pairs = [], [], None
        if self.prefilling and left > 0:
            if self.time_budget is not None:
                dec_pairs = [(1, k) for k in st.kv_lens(0)]
            chunks, pairs = self._chunks(t, left, dec_pairs)
        self.plan_chunks = chunks
        self.decode_step = not chunks
        if not chunks:
            return self._decode_time(t, False)
        if self._fast_p and dec_pairs is None:   # decode tokens are (1, kv) chunks
            sq = sum(q for q, _ in pairs)
            return self.sim.cost.prefill_step_time_totals(
                sq + n_dec, sum(q * c for q, c in pairs) + st.kv[0],
                sum(q * q for q, _ in pairs) + n_dec, sum(c for _, c in pairs) + st.kv[0])
        cost = self.sim.cost.prefill_step_time
        return cost(pairs + (dec_pairs if dec_pairs is not None else [(1, k) for k in st.kv_lens(0)]))

    def _first_token(self, req, t: float, joining: list) -> None:
        self.sim.prefill_done(req, t, t)
        if req.output_len > 1:
            joining.append(req)

    def _loop_looks(self, t: float) -> None:
        """decode_loop: the loop looks at its queues at the end of a decode step."""
        st = self.state
        seen_ready, self.unseen_ready = self.unseen_ready, []
        for req in self.tailing:                 # their compute finished under this step
            self._first_token(req, t, self.unseen_ready)
        self.tailing = []
        st.joining.extend(seen_ready)
        self.waiting.extend(self.unseen)
        self.unseen = []
        self.held = {r.rid for r in self._admit(t)}
        if not st.active:                        # idle: the loop waits for events, sees them at once
            st.joining.extend(self.unseen_ready)
            self.unseen_ready, self.held = [], set()

    def complete(self, t: float) -> None:
        st = self.state
        if self.decoding or not self.alternate:
            n = st.total_running
            if n:   # the batch's previous tokens came at the last decode step's end (alternate:
                    # a prefill step may lie between; mixed: that is this step's start)
                self.sim.record_itl(t - (self.t_tokens if self.alternate else self.t_step), n - len(st.joined))
                for req in st.joined:
                    self.sim.record_itl(t - req.t_first, 1)
            self.sim.tokens_out += n
            for req in st.advance():
                self.sim.finish(req, t)
            self.t_tokens = t
            if self.loop:
                self._loop_looks(t)
        tail = self._loop_running
        for req, q in self.plan_chunks:
            req.prefilled += q
            if req.prefilled >= req.input_len:
                self.prefilling.remove(req)
                self.pending -= req.pred_cost
                if tail:
                    self.tailing.append(req)
                else:
                    self._first_token(req, t, st.joining)
        if not self.prefilling and not self.waiting and not self.unseen:
            self.pending = 0.0
        self.plan_chunks = []

    @property
    def empty(self) -> bool:
        return (not self.busy and not self.prefilling and not self.waiting and not self.state.active
                and not self.unseen and not self.tailing and not self.unseen_ready)
