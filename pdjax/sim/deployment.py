"""Deployment descriptions: colocated, PD-disaggregated, AF-disaggregated.

Sizes are per *instance*: the cost model gives one instance's step time (an instance may
span several accelerators: see ``LinearStepCost.from_roofline(ep_size=...)``). Capacities
are in KV tokens per instance (None: the cost model's ``kv_capacity`` /
``kv_capacity_attention`` when it has one, else unlimited). Bandwidths are bytes/s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from pdjax.arguments import check_int, check_positive
from pdjax.sim.controller import ControllerConfig
from pdjax.sim.policies import DEFAULT_BUCKET_EDGES, check_edges


def _pos(owner, name, v, allow_none=False):
    if not (v is None and allow_none):
        check_positive(f"{owner}.{name}", v)


@dataclasses.dataclass(frozen=True)
class Colocated:
    """``num_instances`` instances each doing prefill and decode with continuous batching.

    ``step_policy``: ``"mixed"`` (Sarathi-style: a step carries the running decodes, one
    token of ``token_budget`` each, and prefill chunks filling the rest, or the largest
    chunks fitting ``time_budget`` seconds) or ``"alternate"`` (a step is either prefill
    chunks of at most ``token_budget`` tokens or a decode step of the running batch; when
    both wait they take turns, as pdjax's ``ColocatedEngine`` does with its FIFO pool lock).
    ``prefill_max_requests``: at most that many requests' chunks per prefill step (None: no
    limit; 1: one request per call, as pdjax's prefill pools run).

    ``decode_loop`` (alternate steps only): the scheduler is the decode loop of pdjax's
    engines, which looks at its queues only between decode steps. While requests decode: an
    arrival is seen at the end of the next decode step, and its prefill waits one more decode
    step (the loop claims the pool for its own step first); a prefill's first token comes at
    the end of the decode step after it (the pool lock covers the prefill's dispatch; its
    compute finishes under that step); the loop sees the first token at the end of the next
    decode step after it and the request joins the step after that. With nothing decoding
    the loop waits for events and sees each at once."""

    num_instances: int
    token_budget: int = 2048
    time_budget: Optional[float] = None
    kv_capacity: Optional[float] = None
    max_batch: Optional[int] = None
    step_policy: str = "mixed"
    prefill_max_requests: Optional[int] = None
    decode_loop: bool = False

    kind = "colocated"

    def __post_init__(self):
        check_int("Colocated.num_instances", self.num_instances)
        check_int("Colocated.token_budget", self.token_budget)
        _pos("Colocated", "time_budget", self.time_budget, allow_none=True)
        _pos("Colocated", "kv_capacity", self.kv_capacity, allow_none=True)
        if self.max_batch is not None:
            check_int("Colocated.max_batch", self.max_batch)
        if self.step_policy not in ("mixed", "alternate"):
            raise ValueError(f"Colocated.step_policy must be 'mixed' or 'alternate', got {self.step_policy!r}")
        if self.prefill_max_requests is not None:
            check_int("Colocated.prefill_max_requests", self.prefill_max_requests)
        if self.decode_loop and self.step_policy != "alternate":
            raise ValueError("Colocated.decode_loop models the engines' alternating steps: "
                             "it needs step_policy='alternate'")

    @property
    def num_instances_total(self) -> int:
        return self.num_instances


@dataclasses.dataclass(frozen=True)
class PDDisaggregated:
    """``num_prefill`` prefill and ``num_decode`` decode instances.

    Prefill: ``dp_ranks`` ranks per instance, ``token_budget`` tokens per rank per step (or
    ``time_budget`` seconds), length buckets ``bucket_edges`` with ``bucket_instances``
    (per bucket, the prefill instance indices serving it; None: all serve all), compute
    ``quotas`` per instance. KV leaves each prefill instance over a link of ``link_bw``
    bytes/s, layer by layer (``layerwise``) over ``num_layers`` layers (None: the cost
    model's). Decode: ``kv_capacity`` tokens and ``max_batch`` requests per instance,
    reserved at the handshake before prefill; requests of >= ``long_threshold`` tokens are
    balanced by KV length, shorter ones by running count. ``controller``: dynamic P:D.
    ``prefill_max_requests``: at most that many requests' chunks per prefill step and rank
    (None: no limit; 1: one request per call, as pdjax's prefill pools run).
    ``decode_loop`` (one decode instance): the handshake is done by the decode loop of
    pdjax's engines, which looks at its queues only between decode steps: a request that
    arrives during a decode step is placed when the step ends.
    ``contention``: (prefill factor, decode factor) >= 1 for pools that share one host's
    cores (pdjax's PDEngine on CPU devices): a prefill step that starts while a decode step
    is in flight takes the first factor times its cost, a decode step that starts while a
    prefill step is in flight the second.
    """

    num_prefill: int
    num_decode: int
    link_bw: float
    token_budget: int = 16384
    time_budget: Optional[float] = None
    dp_ranks: int = 1
    layerwise: bool = True
    num_layers: Optional[int] = None
    kv_capacity: Optional[float] = None
    max_batch: Optional[int] = None
    bucket_edges: tuple = DEFAULT_BUCKET_EDGES
    bucket_instances: Optional[tuple] = None
    quotas: Optional[tuple] = None
    long_threshold: int = DEFAULT_BUCKET_EDGES[0]
    controller: Optional[ControllerConfig] = None
    prefill_max_requests: Optional[int] = None
    decode_loop: bool = False
    contention: Optional[tuple] = None

    kind = "pd"

    def __post_init__(self):
        o = type(self).__name__
        check_int(f"{o}.num_prefill", self.num_prefill)
        check_int(f"{o}.num_decode", self.num_decode)
        _pos(o, "link_bw", self.link_bw)
        check_int(f"{o}.token_budget", self.token_budget)
        _pos(o, "time_budget", self.time_budget, allow_none=True)
        check_int(f"{o}.dp_ranks", self.dp_ranks)
        if self.num_layers is not None:
            check_int(f"{o}.num_layers", self.num_layers)
        _pos(o, "kv_capacity", self.kv_capacity, allow_none=True)
        if self.max_batch is not None:
            check_int(f"{o}.max_batch", self.max_batch)
        object.__setattr__(self, "bucket_edges", check_edges(self.bucket_edges))
        check_int(f"{o}.long_threshold", self.long_threshold)
        if self.prefill_max_requests is not None:
            check_int(f"{o}.prefill_max_requests", self.prefill_max_requests)
        if self.contention is not None:
            c = tuple(self.contention)
            if len(c) != 2 or not all(isinstance(f, (int, float)) and not isinstance(f, bool)
                                      and math.isfinite(f) and f >= 1 for f in c):
                raise ValueError(f"{o}.contention must be (prefill factor, decode factor), each >= 1, got "
                                 f"{self.contention!r}")
            object.__setattr__(self, "contention", (float(c[0]), float(c[1])))
        if self.decode_loop and (self.num_decode != 1 or self.controller is not None):
            raise ValueError(f"{o}.decode_loop models one engine's decode loop: it needs num_decode=1 "
                             "and no controller")
        if self.quotas is not None:
            if len(self.quotas) != self.num_prefill or min(self.quotas) <= 0:
                raise ValueError(f"{o}.quotas needs {self.num_prefill} positive numbers, got {self.quotas}")
        if self.bucket_instances is not None:
            bi = tuple(tuple(int(i) for i in b) for b in self.bucket_instances)
            if len(bi) != len(self.bucket_edges) + 1:
                raise ValueError(f"{o}.bucket_instances needs {len(self.bucket_edges) + 1} lists "
                                 f"(one per length bucket), got {len(bi)}")
            for b, members in enumerate(bi):
                if not members or any(not 0 <= i < self.num_prefill for i in members):
                    raise ValueError(f"{o}.bucket_instances[{b}] must list prefill instance indices "
                                     f"in [0, {self.num_prefill}), got {members}")
            if self.controller is not None:
                raise ValueError(f"{o}: bucket_instances and a dynamic controller cannot be combined")
            object.__setattr__(self, "bucket_instances", bi)

    @property
    def num_instances_total(self) -> int:
        return self.num_prefill + self.num_decode


@dataclasses.dataclass(frozen=True)
class AFDisaggregated(PDDisaggregated):
    """PD with the decode pool made of ``num_decode`` AF units, each ``num_attention`` (M)
    attention instances (DP ranks holding the KV: ``kv_capacity`` and ``max_batch`` are per
    attention instance) and ``num_ffn`` (N) FFN instances, with ``microbatches`` ping-pong
    micro-batches and an exchange link of ``exchange_bw`` bytes/s per attention instance
    (None: ``link_bw``)."""

    num_attention: int = 1
    num_ffn: int = 1
    microbatches: int = 2
    exchange_bw: Optional[float] = None
    exchange_bytes: Optional[float] = None

    kind = "afd"

    def __post_init__(self):
        super().__post_init__()
        check_int("AFDisaggregated.num_attention", self.num_attention)
        check_int("AFDisaggregated.num_ffn", self.num_ffn)
        check_int("AFDisaggregated.microbatches", self.microbatches)
        _pos("AFDisaggregated", "exchange_bw", self.exchange_bw, allow_none=True)
        _pos("AFDisaggregated", "exchange_bytes", self.exchange_bytes, allow_none=True)
        if self.controller is not None:
            raise ValueError("AFDisaggregated: the dynamic P:D controller is for PD deployments")

    @property
    def num_instances_total(self) -> int:
        return self.num_prefill + self.num_decode * (self.num_attention + self.num_ffn)
