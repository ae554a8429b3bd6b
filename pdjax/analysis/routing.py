"""Where routed tokens go: group-limited top-k routing sampled over an expert placement,
and what it implies for the expert all-to-all and the expert load of each GPU.

DeepSeek-V3 routes a token to ``top_k`` of ``n_experts`` experts drawn from ``topk_group``
of ``n_group`` expert groups. With exchangeable scores (every expert equally likely, the
"absolutely balanced" routing of DeepSeek's profiles and the "simulated perfect EPLB" of
SGLang's), the chosen groups are a uniform ``topk_group``-subset and the experts a uniform
``top_k``-subset of the chosen groups' experts; :func:`route_stats` samples exactly that
(seeded, so a result is a pure function of its arguments) and reports:

* ``nodes_per_token``: mean distinct nodes a token's experts sit on (what DeepEP's
  internode kernels send over RDMA, once per node, the token's own node included);
* ``ranks_per_token``: mean distinct GPUs (what each GPU receives over NVLink: one row per
  token and destination GPU);
* ``rows_imbalance``: expected max / mean received (token, expert) rows per GPU: the load
  of the busiest GPU, which every GPU waits for.

Placement: physical expert slot ``s`` lives on GPU ``s // (slots / ep)``; with redundant
experts (``slots`` > ``n_experts``) a logical expert's replicas share its tokens evenly
(the "perfect" placement: replicas are given to the experts in slot order, so slots 256..287
repeat experts 0..31, and each token picks one of an expert's replicas at random).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics

import numpy as np

from pdjax.arguments import check_int



@dataclasses.dataclass(frozen=True)
class RouteStats:
    """Routing statistics of one placement; see the module docstring."""

    nodes_per_token: float
    ranks_per_token: float
    rows_imbalance: float
    local_node_share: float      # share of a token's (token, node) sends that stay on its own node


def _check(n_experts, top_k, n_group, topk_group, ep, gpus_per_node, slots):
    check_int("n_experts", n_experts)
    check_int("top_k", top_k, 1, n_experts)
    check_int("n_group", n_group, 1, n_experts)
    check_int("topk_group", topk_group, 1, n_group)
    check_int("ep", ep)
    check_int("gpus_per_node", gpus_per_node)
    check_int("slots", slots, n_experts)
    if n_experts % n_group:
        raise ValueError(f"n_experts={n_experts} is not a multiple of n_group={n_group}")
    if top_k > (n_experts // n_group) * topk_group:
        raise ValueError(f"top_k={top_k} exceeds the {(n_experts // n_group) * topk_group} experts of "
                         f"{topk_group} groups")
    if slots % ep:
        raise ValueError(f"{slots} expert slots do not split evenly over ep={ep} GPUs")


def sample_experts(rng: np.random.Generator, tokens: int, n_experts: int, top_k: int, n_group: int,
                   topk_group: int) -> np.ndarray:
    """[tokens, top_k] logical expert ids of uniform group-limited routing."""
    per_group = n_experts // n_group
    groups = np.argsort(rng.random((tokens, n_group)), axis=1)[:, :topk_group]           # [T, G']
    cand = (groups[:, :, None] * per_group + np.arange(per_group)).reshape(tokens, -1)   # [T, G' * per_group]
    pick = np.argpartition(rng.random(cand.shape), top_k - 1, axis=1)[:, :top_k]
    return np.take_along_axis(cand, pick, axis=1)


@functools.lru_cache(maxsize=256)
def route_stats(n_experts: int, top_k: int, n_group: int, topk_group: int, ep: int, gpus_per_node: int,
                tokens_per_rank: int, slots: int | None = None, samples: int = 2, seed: int = 0) -> RouteStats:
    """Routing statistics of ``ep`` GPUs (``gpus_per_node`` a node) each sending
    ``tokens_per_rank`` tokens, with ``slots`` physical expert slots (default: one per
    expert). The per-token figures are sampled (``samples`` x 8,192 tokens, seed ``seed``);
    the imbalance is E[max over GPUs] / mean of the received rows, each GPU's rows taken as
    Poisson around its expected load (the expected maximum of ``ep`` normals by Blom's
    formula), so it is exact in the placement's structure and cheap at any batch."""
    slots = n_experts if slots is None else slots
    _check(n_experts, top_k, n_group, topk_group, ep, gpus_per_node, slots)
    check_int("tokens_per_rank", tokens_per_rank)
    check_int("samples", samples)
    shape = _route_shape(n_experts, top_k, n_group, topk_group, ep, gpus_per_node, slots, samples, seed)
    nodes, ranks, local, share = shape
    mean_rows = tokens_per_rank * ep * top_k / ep
    mu = [tokens_per_rank * ep * top_k * s for s in share]
    z = _expected_max_normal(ep)
    busiest = max(m + z * math.sqrt(m) for m in mu)
    return RouteStats(nodes, ranks, busiest / mean_rows, local)


def _expected_max_normal(n: int) -> float:
    """E[max of n standard normals] by Blom's approximation (0 for n = 1)."""
    if n == 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


@functools.lru_cache(maxsize=256)
def _route_shape(n_experts, top_k, n_group, topk_group, ep, gpus_per_node, slots, samples, seed):
    """(nodes per token, GPUs per token, own-node share, per-GPU share of all rows)."""
    rng = np.random.default_rng(seed)
    per_gpu = slots // ep
    replicas = [np.arange(e, slots, n_experts) for e in range(n_experts)]
    share = np.zeros(ep)
    for e, r in enumerate(replicas):
        np.add.at(share, r // per_gpu, 1.0 / (n_experts * len(r)))
    n = 8192
    nodes = ranks = local = 0.0
    for _ in range(samples):
        experts = sample_experts(rng, n, n_experts, top_k, n_group, topk_group)
        gpu = _pick_replica(rng, experts, replicas, n_experts, slots) // per_gpu
        src_node = rng.integers(0, ep, n) // gpus_per_node
        node = gpu // gpus_per_node
        nodes += _distinct_per_row(node).sum()
        ranks += _distinct_per_row(gpu).sum()
        local += (node == src_node[:, None]).any(axis=1).sum()
    return nodes / (samples * n), ranks / (samples * n), local / nodes, tuple(share.tolist())


def _pick_replica(rng, experts, replicas, n_experts, slots):
    """Physical slot of each (token, expert): a uniformly chosen replica of the expert."""
    if slots == n_experts:
        return experts
    counts = np.array([len(r) for r in replicas])
    table = np.full((n_experts, counts.max()), -1)
    for e, r in enumerate(replicas):
        table[e, :len(r)] = r
    choice = (rng.random(experts.shape) * counts[experts]).astype(np.int64)
    return table[experts, choice]


def _distinct_per_row(a: np.ndarray) -> np.ndarray:
    """Number of distinct values in each row of a 2-D integer array."""
    s = np.sort(a, axis=1)
    return 1 + (np.diff(s, axis=1) != 0).sum(axis=1)
