"""Attention-FFN disaggregation (AFD): ping-pong micro-batch bound and the speedup model.

* Ping-pong (MegaScale-Infer): with attention time T_a ~ FFN time T_f and one-way
  exchange time T_c < T_f, the exchange is hidden when the number of in-flight
  micro-batches m >= 2 * (1 + T_c / T_f): 3 at T_c = T_f / 2, 4 as T_c -> T_f.
* Dual-batch overlap (two micro-batches) hides the FFN when
  T_attn(ub2) >= T_ffn(ub1) + T_comm (T_comm: the exchange's round trip).

Both bounds are formulas from the literature, and consequences of the one overlap model:
the AF ping-pong program :func:`pdjax.analysis.overlap.af_program` scheduled by
:func:`pdjax.analysis.streams.schedule` hides the exchange exactly when they hold
(tests/analysis/test_afd_bounds_model.py checks both against the schedule).
* Speedup model (FastAFD, per accelerator):
  (B_AFD / B_base) * (T_base / T_AFD) * M / (M + N), M attention and N extra FFN
  accelerators; the worked example 1.50 * 1.15 * 0.85 ~ 1.47.
"""

from __future__ import annotations

import math

from pdjax.arguments import check_int, check_nonnegative, check_positive


def afd_min_microbatches(comm_time: float, ffn_time: float) -> float:
    """Lower bound on ping-pong micro-batches: 2 * (1 + T_c / T_f) (a real number; see
    :func:`afd_min_microbatches_int`). Needs 0 <= T_c <= T_f: a one-way exchange slower
    than the FFN cannot be hidden by any number of micro-batches (ValueError). In the
    scheduled AF program with T_a = T_f, a layer of m micro-batches takes m T_f (the
    exchange hidden) exactly when m is at least this bound."""
    check_nonnegative("comm_time", comm_time)
    check_positive("ffn_time", ffn_time)
    if comm_time > ffn_time:
        raise ValueError(f"comm_time={comm_time!r} exceeds ffn_time={ffn_time!r}: ping-pong "
                         "pipelining cannot hide the exchange (needs T_c <= T_f)")
    return 2 * (1 + comm_time / ffn_time)


def afd_min_microbatches_int(comm_time: float, ffn_time: float) -> int:
    """Smallest integer m satisfying :func:`afd_min_microbatches`."""
    return math.ceil(afd_min_microbatches(comm_time, ffn_time) - 1e-12)


def dbo_hides_ffn(attn_time_ub2: float, ffn_time_ub1: float, comm_time: float) -> bool:
    """Whether dual-batch overlap hides micro-batch 1's FFN and exchange under
    micro-batch 2's attention: T_attn(ub2) >= T_ffn(ub1) + T_comm, ``comm_time`` the
    exchange's round trip (A2F + F2A). In the scheduled AF program with two micro-batches
    the attention side never waits exactly when this holds."""
    check_nonnegative("attn_time_ub2", attn_time_ub2)
    check_nonnegative("ffn_time_ub1", ffn_time_ub1)
    check_nonnegative("comm_time", comm_time)
    return attn_time_ub2 >= ffn_time_ub1 + comm_time


def attention_share(num_attention: int, num_ffn: int) -> float:
    """M / (M + N): the per-accelerator discount for the N extra FFN accelerators."""
    m = check_int("num_attention", num_attention)
    if isinstance(num_ffn, bool) or not isinstance(num_ffn, int) or num_ffn < 0:
        raise ValueError(f"num_ffn must be an integer >= 0, got {num_ffn!r}")
    return m / (m + num_ffn)


def afd_speedup(batch_gain: float, step_time_gain: float, attention_share: float) -> float:
    """Per-accelerator decode throughput of AFD over the colocated baseline:
    (B_AFD / B_base) * (T_base / T_AFD) * M / (M + N).

    ``batch_gain`` = B_AFD / B_base (resident requests per attention accelerator),
    ``step_time_gain`` = T_base / T_AFD (step latency ratio), ``attention_share`` =
    M / (M + N) in (0, 1] (see :func:`attention_share`). Above 1 AFD wins."""
    check_positive("batch_gain", batch_gain)
    check_positive("step_time_gain", step_time_gain)
    check_positive("attention_share", attention_share)
    if attention_share > 1:
        raise ValueError(f"attention_share must be <= 1 (it is M/(M+N)), got {attention_share!r}")
    return batch_gain * step_time_gain * attention_share


def afd_exchange_bytes(hidden_size: int, experts_per_token: int, num_ffn: int, act_bytes: float = 2) -> float:
    """One-way bytes per token per layer of the attention -> FFN exchange: the hidden state
    (``act_bytes`` per element) goes to the min(top-k, N) FFN instances holding its experts."""
    check_int("hidden_size", hidden_size)
    check_int("experts_per_token", experts_per_token)
    check_int("num_ffn", num_ffn)
    check_positive("act_bytes", act_bytes)
    return hidden_size * act_bytes * min(experts_per_token, num_ffn)
