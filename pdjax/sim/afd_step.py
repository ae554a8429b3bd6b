"""AF-disaggregated decode: step time of M attention instances and N FFN instances with m
ping-pong micro-batches (MegaScale-Infer style).

Per layer and micro-batch: the attention side takes T_a (the slowest attention instance on
its 1/m share of the batch), the FFN pool takes T_f (the FFN work of all attention
instances' micro-batches, expert-parallel over N instances: 1/N of the weights and of the
tokens each), and each direction of the exchange takes T_c (the micro-batch's hidden states
over the attention instance's link).

The model is a program on the one overlap model's streams (:func:`afd_program`:
:func:`pdjax.analysis.overlap.af_program` scheduled by :func:`pdjax.analysis.streams.schedule`):
streams "attention", "a2f", "ffn", "f2a", each serving the m micro-batches round-robin, one
at a time; per layer a micro-batch runs attention -> a2f -> ffn -> f2a, and its next layer's
attention waits for its f2a. A micro-batch's next attention can start only after its round
trip T_a + T_c + T_f + T_c, while each side serves m micro-batches per layer, so one layer
of all m micro-batches takes, in the scheduled steady state (:func:`afd_scheduled_cycle`),

    cycle = max(m * T_a, m * T_f, m * T_c, T_a + T_f + 2 * T_c)

(:func:`afd_layer_cycle`, the closed form the simulator's event loop uses; the m * T_c term is
the links, each serving one micro-batch at a time, which binds only when T_c > max(T_a, T_f)
and m >= 3). tests/sim/test_afd_program.py proves it equal to the schedule over random times
and m. A decode step of L
layers takes L * cycle (pipeline fill and drain left out). With T_a = T_f the exchange is
hidden exactly when m >= 2 * (1 + T_c / T_f), the bound of
:func:`pdjax.analysis.afd_min_microbatches`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from pdjax.arguments import check_int
from pdjax.analysis.overlap import AFStages, af_program
from pdjax.analysis.streams import Op, schedule
from pdjax.sim.cost import has_totals


def afd_program(t_attn: float, t_ffn: float, t_comm: float, microbatches: int, layers: int, *,
                t_back: Optional[float] = None) -> list[Op]:
    """The AF ping-pong of ``microbatches`` micro-batches through ``layers`` layers as a
    program for :func:`pdjax.analysis.streams.schedule` (see the module docstring): per
    layer and micro-batch attention ``t_attn``, A2F ``t_comm``, FFN ``t_ffn``, F2A ``t_back``
    (default ``t_comm``) seconds."""
    t_back = t_comm if t_back is None else t_back
    for name, n in (("microbatches", microbatches), ("layers", layers)):
        check_int(name, n)
    for name, v in (("t_attn", t_attn), ("t_ffn", t_ffn), ("t_comm", t_comm), ("t_back", t_back)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite time >= 0, got {v!r}")
    return af_program([AFStages(t_attn, t_comm, t_ffn, t_back)] * layers, microbatches)


def afd_scheduled_cycle(t_attn: float, t_ffn: float, t_comm: float, microbatches: int, *,
                        t_back: Optional[float] = None) -> float:
    """Seconds per layer of the scheduled :func:`afd_program` in its steady state: how much
    the makespan grows from 2 to 3 layers. (The growth is the same from the first layer on:
    the ping-pong reaches its steady state at once; tests/sim/test_afd_program.py checks it.)"""
    ends = [max(s.end_s for s in schedule(afd_program(t_attn, t_ffn, t_comm, microbatches, n, t_back=t_back)))
            for n in (2, 3)]
    return ends[1] - ends[0]


def afd_layer_cycle(t_attn: float, t_ffn: float, t_comm: float, microbatches: int) -> float:
    """Seconds for one layer of all ``microbatches`` micro-batches (per-micro-batch,
    per-layer times in): max(m T_a, m T_f, m T_c, T_a + T_f + 2 T_c), the closed form of
    :func:`afd_scheduled_cycle` for the simulator's event loop (equal to it: the module docstring)."""
    m = microbatches                          # checked inline: the event loop calls this every step
    check_int("microbatches", m)
    for name, v in (("t_attn", t_attn), ("t_ffn", t_ffn), ("t_comm", t_comm)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite time >= 0, got {v!r}")
    return max(m * t_attn, m * t_ffn, m * t_comm, t_attn + t_ffn + 2 * t_comm)


def exchange_hidden(t_attn: float, t_ffn: float, t_comm: float, microbatches: int) -> bool:
    """Whether the exchange is fully hidden (the cycle is compute-bound on one side)."""
    return afd_layer_cycle(t_attn, t_ffn, t_comm, microbatches) <= microbatches * max(t_attn, t_ffn) + 1e-15


class AFDStepModel:
    """Decode step time of one AF unit from a cost model with an attention/FFN split.

    ``num_ffn`` FFN instances, ``microbatches`` m, ``exchange_bw`` bytes/s per attention
    instance link, ``exchange_bytes`` one-way bytes per token per layer (default: the cost
    model's ``afd_exchange_bytes(num_ffn)``), ``num_layers`` L.
    """

    def __init__(self, cost, num_ffn: int, microbatches: int, exchange_bw: float,
                 num_layers: int, exchange_bytes: float | None = None):
        check_int("num_ffn", num_ffn)
        check_int("microbatches", microbatches)
        if not (exchange_bw > 0 and math.isfinite(exchange_bw)):
            raise ValueError(f"exchange_bw must be a positive number of bytes/s, got {exchange_bw!r}")
        if exchange_bytes is None:
            fn = getattr(cost, "afd_exchange_bytes", None)
            if fn is None:
                raise ValueError(f"cost model {type(cost).__name__} has no afd_exchange_bytes(); "
                                 "pass exchange_bytes (one-way bytes per token per layer)")
            exchange_bytes = fn(num_ffn)
        self.cost, self.num_ffn, self.m = cost, num_ffn, microbatches
        self.exchange_bw, self.L, self.exchange_bytes = exchange_bw, max(1, num_layers), exchange_bytes
        self._fast = has_totals(cost, "decode_attention_time_totals")
        self.last = (0.0, 0.0, 0.0)   # (T_a, T_f, T_c) of the last step, per layer

    def step_time_totals(self, loads: Sequence[tuple[int, float]]) -> float:
        """Step time from per-attention-instance ``(num_requests, sum_kv)``."""
        m, L = self.m, self.L
        t_a = 0.0
        tokens = 0
        busiest = 0
        for n, kv in loads:
            if n:
                tokens += n
                busiest = max(busiest, n)
                mb_n = math.ceil(n / m)
                a = (self.cost.decode_attention_time_totals(mb_n, kv * mb_n / n) if self._fast else
                     self.cost.decode_attention_time([kv / n] * mb_n))
                t_a = max(t_a, a / L)
        return self._cycle(t_a, tokens, busiest)

    def _cycle(self, t_a: float, tokens: int, busiest: int) -> float:
        """The step from the slowest attention time per layer, the decode tokens in all and the
        most on one attention instance: FFN time, exchange time, the m-micro-batch cycle."""
        if not tokens:
            return 0.0
        m, L = self.m, self.L
        t_f = self.cost.decode_ffn_time(math.ceil(tokens / m)) / self.num_ffn / L
        t_c = math.ceil(busiest / m) * self.exchange_bytes / self.exchange_bw
        self.last = (t_a, t_f, t_c)
        return L * afd_layer_cycle(t_a, t_f, t_c, m)

    def step_time(self, kv_lens_per_rank: Sequence[Sequence[int]]) -> float:
        """Step time from per-attention-instance lists of KV lengths (generic cost models):
        micro-batch j of a rank holds its requests j, j+m, j+2m, ..."""
        m, L = self.m, self.L
        t_a, tokens, busiest = 0.0, 0, 0
        for lens in kv_lens_per_rank:
            if len(lens):
                tokens += len(lens)
                busiest = max(busiest, len(lens))
                t_a = max(t_a, max(self.cost.decode_attention_time(list(lens[j::m]))
                                   for j in range(min(m, len(lens)))) / L)
        return self._cycle(t_a, tokens, busiest)
