"""The discrete-event serving simulator: the event loop and the request lifecycle
(:class:`Simulator`, :func:`simulate_serving`); what a run returns is in :mod:`pdjax.sim.result`.

Events (a heap ordered by time, then by insertion order, so runs are deterministic):
request arrival, instance step done, KV transfer done, controller tick.

Request lifecycle, PD: arrival -> handshake (a decode instance with room reserves
input + output KV tokens; none has room: the request waits in FIFO order, back-pressure) ->
prefix-cache lookup (cached tokens skip prefill) -> length bucket -> prefill instance by
compute quota -> DP rank by predicted cost -> chunked prefill -> first token at the end of
the last chunk -> layer-wise KV transfer -> joins the decode batch at its next step ->
finishes -> frees its reservation (waiting requests are retried). Colocated: arrival ->
prefix lookup -> instance with the least pending prefill work -> admitted when its KV fits
-> mixed prefill/decode steps -> finishes.

Every request ends "finished" or "rejected" with a reason (context larger than an
instance's KV capacity, waited longer than ``max_wait`` for a slot, or unfinished at the
``horizon``); the totals are asserted.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from typing import Optional, Sequence

import numpy as np

from pdjax.sim.afd_step import AFDStepModel
from pdjax.sim.colocated import ColocatedInstance
from pdjax.sim.controller import PDController
from pdjax.sim.cost import check_cost_model, num_layers_of
from pdjax.sim.instances import DecodeInstance, PrefillInstance
from pdjax.sim.metrics import SLO
from pdjax.sim.policies import length_bucket, pick_by_quota, pick_decode
from pdjax.sim.prefix_cache import PrefixCache, extend_chain
from pdjax.sim.result import SimResult, collect_result

ARRIVAL, STEP, KV_READY, CONTROL = 0, 1, 2, 3


class Simulator:
    """One simulation of ``requests`` through ``deployment`` with step times from ``cost``
    (``prefix_cache``, ``slo``, ``horizon``, ``max_wait`` optional); ``run()`` returns a
    :class:`SimResult`. :func:`simulate_serving` is the one-call form.

    ``decode_jitter``: multiplicative factors (> 0), e.g. measured decode step times over
    the fitted ones; each decode step's time is multiplied by one drawn uniformly from them
    (``numpy.random.default_rng(jitter_seed)``: deterministic), for a platform whose steps
    vary (shared cores, noisy neighbours) so that latency percentiles carry the spread."""

    SESSION_MEMO = 4096       # sessions whose last context chain is kept for the next turn
    def __init__(self, deployment, cost, requests: Sequence, *, prefix_cache: Optional[PrefixCache] = None,
                 slo: Optional[SLO] = None, horizon: Optional[float] = None,
                 max_wait: Optional[float] = None, decode_jitter: Optional[Sequence[float]] = None,
                 jitter_seed: int = 0):
        self.dep = deployment
        self.mode = deployment.kind
        self.cost = check_cost_model(cost, afd=self.mode == "afd")
        self.kv_bytes = cost.kv_bytes_per_token()
        if slo is not None and not isinstance(slo, SLO):
            raise TypeError(f"slo must be an SLO, got {type(slo).__name__}")
        for name, v in (("horizon", horizon), ("max_wait", max_wait)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite time > 0 seconds, got {v!r}")
        self.slo, self.horizon, self.max_wait = slo, horizon, max_wait
        self.jitter = None
        if decode_jitter is not None:
            factors = [float(f) for f in decode_jitter]
            if not factors or not all(f > 0 and math.isfinite(f) for f in factors):
                raise ValueError("decode_jitter must be a non-empty sequence of finite factors > 0")
            self.jitter = (np.asarray(factors), np.random.default_rng(jitter_seed))
        self.cache = prefix_cache
        self._sessions: OrderedDict = OrderedDict()   # session -> (context segments, chain, state)
        self.requests = [r.fresh() for r in requests]
        self.heap: list = []
        self.seq = 0
        self.events = 0
        self.outstanding = len(self.requests)
        self.itl_v: list = []
        self.itl_w: list = []
        self.tokens_out = 0
        self.pending: deque = deque()
        self.prefill: list = []
        self.decode: list = []
        self.colo: list = []
        self.all_prefill: list = []
        self.all_decode: list = []
        self.draining: list = []
        self.controller = None
        self._next_iid = 0
        self._build()

    # ---- construction ---------------------------------------------------------------
    def _capacity(self, attention=False):
        if self.dep.kv_capacity is not None:
            return self.dep.kv_capacity
        cap = getattr(self.cost, "kv_capacity_attention" if attention else "kv_capacity", None)
        return cap if cap is not None else math.inf

    def _build(self):
        d = self.dep
        if self.mode == "colocated":
            cap = self._capacity()
            self.capacity = cap
            for _ in range(d.num_instances):
                self.colo.append(ColocatedInstance(
                    self, self._iid(), 0.0, capacity=cap, token_budget=d.token_budget,
                    time_budget=d.time_budget,
                    max_batch=d.max_batch if d.max_batch is not None else math.inf,
                    alternate=d.step_policy == "alternate",
                    max_requests=d.prefill_max_requests or math.inf, decode_loop=d.decode_loop))
            return
        self.num_layers = d.num_layers or num_layers_of(self.cost)
        if d.controller is not None and d.quotas is not None:
            raise ValueError("PDDisaggregated: quotas and a dynamic controller cannot be combined")
        self.capacity = self._capacity(attention=self.mode == "afd")
        for _ in range(d.num_prefill):
            self.new_instance("prefill", 0.0)
        for _ in range(d.num_decode):
            self.new_instance("decode", 0.0)
        if d.controller is not None:
            self.controller = PDController(d.controller)

    def _iid(self) -> int:
        self._next_iid += 1
        return self._next_iid - 1

    def new_instance(self, role: str, t: float):
        d = self.dep
        if role == "prefill":
            inst = PrefillInstance(self, self._iid(), t, dp_ranks=d.dp_ranks, token_budget=d.token_budget,
                                   time_budget=d.time_budget, link_bw=d.link_bw,
                                   layerwise=d.layerwise, num_layers=self.num_layers,
                                   max_requests=d.prefill_max_requests or math.inf)
            self.prefill.append(inst)
            self.all_prefill.append(inst)
        else:
            afd = None
            if self.mode == "afd":
                afd = AFDStepModel(self.cost, d.num_ffn, d.microbatches, d.exchange_bw or d.link_bw,
                                   self.num_layers, d.exchange_bytes)
            inst = DecodeInstance(self, self._iid(), t, capacity=self.capacity,
                                  max_batch=d.max_batch if d.max_batch is not None else math.inf,
                                  ranks=d.num_attention if self.mode == "afd" else 1, afd=afd)
            self.decode.append(inst)
            self.all_decode.append(inst)
        return inst

    # ---- event machinery ------------------------------------------------------------
    def schedule(self, t: float, kind: int, obj) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

    def kick(self, inst, t: float) -> None:
        if inst.busy:
            return
        dur = inst.plan(t)
        if dur is None:
            return
        if not (dur >= 0 and math.isfinite(dur)):
            raise ValueError(f"cost model returned an invalid step time {dur!r} for {inst.pool} "
                             f"instance {inst.iid}")
        if self.jitter is not None and inst.decode_step:
            factors, rng = self.jitter
            dur *= float(factors[rng.integers(len(factors))])
        contention = getattr(self.dep, "contention", None)
        if contention is not None:
            if inst.pool == "prefill" and any(d.busy for d in self.decode):
                dur *= contention[0]
            elif inst.pool == "decode" and any(p.busy for p in self.prefill):
                dur *= contention[1]
        inst.busy = True
        inst.busy_time += dur
        self.schedule(t + dur, STEP, inst)

    def record_itl(self, value: float, weight: int) -> None:
        if weight > 0:
            self.itl_v.append(value)
            self.itl_w.append(weight)

    def run(self) -> SimResult:
        for req in self.requests:
            self.schedule(req.arrival, ARRIVAL, req)
        if self.controller is not None:
            self.schedule(self.controller.cfg.interval, CONTROL, None)
        heap = self.heap
        t = 0.0
        while heap:
            t, _, kind, obj = heapq.heappop(heap)
            if self.horizon is not None and t > self.horizon:
                t = self.horizon
                break
            self.events += 1
            if kind == STEP:
                obj.complete(t)
                obj.steps += 1
                obj.busy = False
                self.kick(obj, t)
            elif kind == ARRIVAL:
                self.arrive(obj, t)
            elif kind == KV_READY:
                self.kv_ready(obj, t)
            else:
                self.controller.tick(self, t)
                if self.outstanding:
                    self.schedule(t + self.controller.cfg.interval, CONTROL, None)
        for req in self.requests:
            if req.status is None:
                self.reject(req, t, "not finished by the simulation horizon" if self.horizon
                            else "stranded (simulator bug)")
        return collect_result(self)

    # ---- request lifecycle ----------------------------------------------------------
    def reject(self, req, t: float, reason: str) -> None:
        req.status, req.reason = "rejected", reason
        self.outstanding -= 1

    def _prompt_chain(self, req) -> None:
        """Hash chain of the prompt; a session's next turn extends the chain its previous
        turn left (its context), so multi-turn prompts are not rehashed from the start."""
        bs = self.cache.block_size
        base = self._sessions.get(req.session_id) if req.session_id >= 0 else None
        if base is not None and req.segments[:len(base[0])] == base[0]:
            hashes = list(base[1])
            state = extend_chain(base[2], req.segments[len(base[0]):], bs, hashes)
        else:
            hashes = []
            state = extend_chain(None, req.segments, bs, hashes)
        req._hashes = (hashes, state)

    def _lookup_prefix(self, req, t: float) -> None:
        if self.cache is None:
            return
        bs = self.cache.block_size
        if req._hashes is None:
            self._prompt_chain(req)
        hit = self.cache.lookup(req._hashes[0], t) * bs
        req.cached = req.prefilled = min(hit, req.input_len - 1)

    def arrive(self, req, t: float) -> None:
        if req.context_len > self.capacity:
            self.reject(req, t, f"context of {req.context_len} tokens exceeds the KV capacity of "
                                f"one instance ({self.capacity:.0f} tokens)")
            return
        if self.mode == "colocated":
            self._lookup_prefix(req, t)
            inst = min(self.colo, key=lambda c: (c.pending, sum(c.state.res_count), c.iid))
            inst.enqueue(req, t)
            self.kick(inst, t)
            return
        if self.dep.decode_loop and self.decode[0].busy:   # seen when the loop's step ends
            self.decode[0].unseen.append(req)
            return
        self.place(req, t)

    def place(self, req, t: float) -> None:
        """A PD request enters the handshake queue (FIFO behind any waiting one)."""
        if self.pending or not self.try_place(req, t):
            self.pending.append(req)

    def try_place(self, req, t: float) -> bool:
        """Handshake (reserve decode KV), then hand the request to a prefill instance."""
        d, need = self.dep, req.context_len
        best, best_rank = None, -1
        if self.mode == "afd":
            cands = [(inst, r) for inst in self.decode for r in range(inst.state.R)]
        else:
            cands = [(inst, 0) for inst in self.decode]
        counts = [inst.state.res_count[r] for inst, r in cands]
        kvs = [inst.state.res_tokens[r] for inst, r in cands]
        fits = [inst.state.fits(r, need) for inst, r in cands]
        i = pick_decode(counts, kvs, need, d.long_threshold, fits)
        if i < 0:
            return False
        best, best_rank = cands[i]
        best.state.reserve(req, best_rank)
        req.decode_inst = best
        req.t_handshake = t
        self._lookup_prefix(req, t)
        allowed = None
        if d.bucket_instances is not None:
            allowed = d.bucket_instances[length_bucket(req.input_len, d.bucket_edges)]
        p = self.prefill[pick_by_quota([x.pending_total for x in self.prefill], d.quotas, allowed)]
        req.prefill_inst = p
        p.enqueue(req, t)
        self.kick(p, t)
        return True

    def migrate_reservations(self, inst, t: float) -> int:
        """Move the reservations of requests still in prefill off ``inst`` (being drained)
        to other decode instances with room; returns how many moved."""
        moved = 0
        for req in list(inst.state.promised.values()):
            if not math.isnan(req.t_first):
                continue                     # its KV is already on the way to inst
            cands = [(d, r) for d in self.decode for r in range(d.state.R)]
            fits = [d.state.fits(r, req.context_len) for d, r in cands]
            i = pick_decode([d.state.res_count[r] for d, r in cands],
                            [d.state.res_tokens[r] for d, r in cands], req.context_len,
                            self.dep.long_threshold, fits)
            if i < 0:
                continue
            inst.state.release(req)
            d, r = cands[i]
            d.state.reserve(req, r)
            req.decode_inst = d
            moved += 1
        return moved

    def retry_pending(self, t: float) -> None:
        while self.pending:
            head = self.pending[0]
            if self.max_wait is not None and t - head.arrival > self.max_wait:
                self.pending.popleft()
                self.reject(head, t, f"waited more than max_wait={self.max_wait:g} s for a decode slot")
                continue
            if not self.try_place(head, t):
                break
            self.pending.popleft()

    def prefill_done(self, req, t: float, kv_ready: float) -> None:
        req.t_first = t
        if self.cache is not None and req._hashes is not None:
            self.cache.insert(req._hashes[0], t, req.retention)
        if req.output_len == 1:
            self.finish(req, t)
        elif self.mode != "colocated":
            self.schedule(kv_ready, KV_READY, req)

    def kv_ready(self, req, t: float) -> None:
        req.t_kv_ready = t
        req.kv_wait = t - req.t_first
        if self.controller is not None:
            self.controller.on_join(req.kv_wait)
        req.decode_inst.join(req)
        self.kick(req.decode_inst, t)

    def finish(self, req, t: float) -> None:
        req.status = "finished"
        req.t_finish = t
        self.outstanding -= 1
        req.decode_inst.state.release(req)
        if self.cache is not None and req._hashes is not None:
            full = list(req._hashes[0])
            out_seg = ((req.out_segment, req.output_len),)
            state = extend_chain(req._hashes[1], out_seg, self.cache.block_size, full)
            self.cache.insert(full, t, req.retention)
            if req.session_id >= 0:
                self._sessions[req.session_id] = (tuple(req.segments) + out_seg, full, state)
                self._sessions.move_to_end(req.session_id)
                if len(self._sessions) > self.SESSION_MEMO:
                    self._sessions.popitem(last=False)
            req._hashes = None
        if self.controller is not None and req.output_len > 1:
            self.controller.on_finish((t - req.t_first) / (req.output_len - 1))
        if self.mode != "colocated":
            self.retry_pending(t)


def simulate_serving(deployment, cost, requests, **kwargs) -> SimResult:
    """Run ``requests`` (a list of :class:`~pdjax.sim.workload.SimRequest`, left untouched)
    through ``deployment`` with step times from ``cost``. Keyword arguments: ``prefix_cache``,
    ``slo``, ``horizon``, ``max_wait``, ``decode_jitter``, ``jitter_seed`` (see
    :class:`Simulator`)."""
    return Simulator(deployment, cost, requests, **kwargs).run()
