"""Expert-parallel load balancing (EPLB): redundant experts and their placement on GPUs.

The placement policy follows deepseek-ai/EPLB (``eplb.py``), re-derived in NumPy:

* **hierarchical** (``num_groups % num_nodes == 0``): expert groups are packed onto nodes so
  node loads balance (every node gets ``num_groups / num_nodes`` whole groups); inside each
  node the hottest experts get the node's redundant slots one at a time (each time the expert
  with the highest load per replica); the node's physical experts are then packed onto its
  GPUs so GPU loads balance (every GPU gets ``num_replicas / num_gpus`` slots).
* **global** (otherwise): the same with one group and one node, i.e. replicate across all
  experts and pack all physical experts onto all GPUs.

Packing is greedy: items in order of decreasing weight, each to the lightest pack that still
has room (the lowest index among equally light packs). Ties in the weight order keep the
lower index first (a stable descending sort); replication picks the lowest index among
equal per-replica loads. Loads are float32, as in the reference (it calls ``.float()``).

Shapes: ``weight`` [layers, num_logical] (tokens per logical expert, any non-negative unit);
``phy2log`` [layers, num_replicas] int64 (physical slot ``p`` lives on GPU
``p // (num_replicas / num_gpus)``, GPU ``g`` on node ``g // (num_gpus / num_nodes)``);
``log2phy`` [layers, num_logical, max_count] int64, padded with -1, the r-th replica of a
logical expert in column r; ``logcnt`` [layers, num_logical] int64.

Also importable here (they live in :mod:`pdjax.parallel.expert_load`): per-GPU load reports,
DeepSeek-V3's aux-loss-free bias update, and routing statistics from real forward passes
(:func:`expert_load_from_routing`, :func:`collect_routing_stats`).
"""

from __future__ import annotations

import numpy as np

# the expert loads (validation, reports, routing statistics, bias update) live in expert_load
from pdjax.arguments import check_int
from pdjax.parallel.expert_load import (LoadReport, _load_matrix,  # noqa: F401
                                        _routing_stats_core, aux_free_bias_update, collect_routing_stats,
                                        expert_load_from_routing, gpu_loads, load_report, moe_layer_indices)

__all__ = [
    "LoadReport", "aux_free_bias_update", "balanced_packing", "collect_routing_stats",
    "expert_load_from_routing", "gpu_loads", "load_report", "moe_layer_indices", "rebalance_experts",
    "replicate_experts",
]


# ---- the two building blocks -----------------------------------------------------------------

def _descending_order(w: np.ndarray) -> np.ndarray:
    """Indices of ``w`` (1-D, non-negative) by decreasing value, equal values lower index first."""
    return np.argsort(-w, kind="stable")


def balanced_packing(weight, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the n items of each row into ``num_packs`` packs of exactly n / num_packs items,
    balancing the pack weights greedily (heaviest item first, into the lightest open pack).

    ``weight`` [X, n] -> (pack_index [X, n], rank_in_pack [X, n]), int64; an item's rank is
    the order in which it entered its pack.
    """
    w = np.asarray(weight, np.float32)
    X, n = w.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split evenly into num_packs={num_packs}")
    per_pack = n // num_packs
    if per_pack == 1:
        return (np.broadcast_to(np.arange(n, dtype=np.int64), (X, n)).copy(),
                np.zeros((X, n), np.int64))
    pack_index = np.full((X, n), -1, np.int64)
    rank_in_pack = np.full((X, n), -1, np.int64)
    for row in range(X):
        load = np.zeros(num_packs, np.float32)
        count = np.zeros(num_packs, np.int64)
        for item in _descending_order(w[row]):
            open_load = np.where(count < per_pack, load, np.inf)
            pack = int(np.argmin(open_load))          # first of the lightest open packs
            pack_index[row, item] = pack
            rank_in_pack[row, item] = count[pack]
            load[pack] += w[row, item]
            count[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give the ``num_physical - num_logical`` extra slots of each row, one at a time, to the
    expert with the highest load per replica (lowest index among equals).

    ``weight`` [X, num_logical] -> (phy2log [X, num_physical], replica rank [X, num_physical],
    logcnt [X, num_logical]), int64. Slot i < num_logical holds expert i (rank 0).
    """
    w = np.asarray(weight, np.float32)
    X, num_logical = w.shape
    if num_physical < num_logical:
        raise ValueError(f"num_physical={num_physical} < num_logical={num_logical}")
    phy2log = np.broadcast_to(np.arange(num_physical, dtype=np.int64), (X, num_physical)).copy()
    rank = np.zeros((X, num_physical), np.int64)
    logcnt = np.ones((X, num_logical), np.int64)
    rows = np.arange(X)
    for slot in range(num_logical, num_physical):
        hottest = np.argmax(w / logcnt.astype(np.float32), axis=-1)
        phy2log[:, slot] = hottest
        rank[:, slot] = logcnt[rows, hottest]
        logcnt[rows, hottest] += 1
    return phy2log, rank, logcnt


# ---- the policy ---------------------------------------------------------------------------------

def _hierarchical(w: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                  num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(phy2log, replica rank, logcnt) for float32 loads ``w`` [layers, L]."""
    layers, L = w.shape
    group_size = L // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = L // num_nodes
    phy_per_node = num_replicas // num_nodes
    phy_per_gpu = num_replicas // num_gpus

    # 1. whole groups onto nodes. A group's node-major position orders the experts of a node:
    #    node_order[l, j] = logical id of the j-th expert of the node-major layout.
    group_load = w.reshape(layers, num_groups, group_size).sum(-1, dtype=np.float32)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    group_pos = group_node * groups_per_node + group_rank                # [layers, groups]
    node_major = (group_pos[:, :, None] * group_size + np.arange(group_size)).reshape(layers, L)
    node_order = np.argsort(node_major, axis=-1)                         # inverse permutation

    # 2. redundant experts inside each node: rows are (layer, node).
    node_w = np.take_along_axis(w, node_order, -1).reshape(layers * num_nodes, log_per_node)
    phy2local, phy_rank, local_cnt = replicate_experts(node_w, phy_per_node)

    # 3. each node's physical experts onto its GPUs.
    phy_load = np.take_along_axis(node_w / local_cnt.astype(np.float32), phy2local, -1)
    gpu, rank_on_gpu = balanced_packing(phy_load, num_gpus // num_nodes)
    slot = gpu * phy_per_gpu + rank_on_gpu                                # where each phy goes
    slot_to_phy = np.argsort(slot, axis=-1)

    local = np.take_along_axis(phy2local, slot_to_phy, -1).reshape(layers, num_nodes, phy_per_node)
    node_major_id = (local + (np.arange(num_nodes) * log_per_node)[None, :, None]).reshape(layers, -1)
    phy2log = np.take_along_axis(node_order, node_major_id, -1)
    rank = np.take_along_axis(phy_rank, slot_to_phy, -1).reshape(layers, num_replicas)
    logcnt = np.take_along_axis(local_cnt.reshape(layers, L), node_major, -1)
    return phy2log, rank, logcnt


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate and place experts so per-GPU loads balance (deepseek-ai/EPLB semantics).

    Args:
      weight: [layers, num_logical] (or [num_logical] for one layer) non-negative loads,
        e.g. tokens routed to each logical expert (a moving average of recent batches).
      num_replicas: physical expert slots per layer, a multiple of ``num_gpus`` and
        >= num_logical.
      num_groups: expert groups (DeepSeek's ``n_group``); must divide num_logical. The
        hierarchical policy is used when ``num_nodes`` divides it, the global one otherwise.
      num_nodes: server nodes (fast interconnect inside a node); must divide ``num_gpus``.
      num_gpus: GPUs (EP ranks) in all.

    Returns:
      (phy2log [layers, num_replicas], log2phy [layers, num_logical, max_count] padded with -1,
      logcnt [layers, num_logical]), int64; without the layers axis for a 1-D ``weight``.
    """
    w, one_layer = _load_matrix(weight)
    num_replicas = check_int("num_replicas", num_replicas)
    num_groups = check_int("num_groups", num_groups)
    num_nodes = check_int("num_nodes", num_nodes)
    num_gpus = check_int("num_gpus", num_gpus)
    layers, L = w.shape
    if L % num_groups:
        raise ValueError(f"num_groups={num_groups} does not divide the {L} logical experts of weight")
    if num_gpus % num_nodes:
        raise ValueError(f"num_nodes={num_nodes} does not divide num_gpus={num_gpus}")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} is not a multiple of num_gpus={num_gpus}")
    if num_replicas < L:
        raise ValueError(f"num_replicas={num_replicas} < the {L} logical experts of weight: "
                         "every expert needs a slot")

    if num_groups % num_nodes == 0:
        phy2log, rank, logcnt = _hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, logcnt = _hierarchical(w, num_replicas, 1, 1, num_gpus)

    max_count = int(logcnt.max())
    log2phy = np.full((layers, L, max_count), -1, np.int64)
    layer_ix = np.broadcast_to(np.arange(layers)[:, None], phy2log.shape)
    log2phy[layer_ix, phy2log, rank] = np.arange(num_replicas)
    if one_layer:
        return phy2log[0], log2phy[0], logcnt[0]
    return phy2log, log2phy, logcnt
