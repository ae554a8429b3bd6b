"""AF-disaggregated decode: step time of M attention instances and N FFN instances with m
ping-pong micro-batches (MegaScale-Infer style).

Per layer and micro-batch: the attention side takes T_a (the slowest attention instance on
its 1/m share of the batch), the FFN pool takes T_f (the FFN work of all attention
instances' micro-batches, expert-parallel over N instances: 1/N of the weights and of the
tokens each), and each direction of the exchange takes T_c (the micro-batch's hidden states
over the attention instance's link). A micro-batch's next attention can start only after
its round trip T_a + T_c + T_f + T_c, while each side serves m micro-batches per layer, so
one layer of all m micro-batches takes

    cycle = max(m * T_a, m * T_f, T_a + T_f + 2 * T_c)

and a decode step of L layers takes L * cycle (pipeline fill and drain left out). With
T_a = T_f the exchange is hidden exactly when m >= 2 * (1 + T_c / T_f), the bound of
:func:`pdjax.analysis.afd_min_microbatches`.
"""

from __future__ import annotations

import math
from typing import Sequence


def afd_layer_cycle(t_attn: float, t_ffn: float, t_comm: float, microbatches: int) -> float:
    """Seconds for one layer of all ``microbatches`` micro-batches (per-micro-batch,
    per-layer times in; see the module docstring)."""
    m = microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"microbatches must be a positive integer, got {m!r}")
    for name, v in (("t_attn", t_attn), ("t_ffn", t_ffn), ("t_comm", t_comm)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite time >= 0, got {v!r}")
    return max(m * t_attn, m * t_ffn, t_attn + t_ffn + 2 * t_comm)


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
        if isinstance(num_ffn, bool) or not isinstance(num_ffn, int) or num_ffn < 1:
            raise ValueError(f"num_ffn must be a positive integer, got {num_ffn!r}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
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
        self._fast = hasattr(cost, "decode_attention_time_totals")
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
