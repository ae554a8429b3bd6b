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

Also here: per-GPU load reports, DeepSeek-V3's aux-loss-free bias update, and routing
statistics from real forward passes (:func:`expert_load_from_routing`,
:func:`collect_routing_stats`).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.config import ModelConfig
from pdjax.model import mla, moe as moe_lib, transformer

__all__ = [
    "LoadReport", "aux_free_bias_update", "balanced_packing", "collect_routing_stats",
    "expert_load_from_routing", "gpu_loads", "load_report", "moe_layer_indices", "rebalance_experts",
    "replicate_experts",
]


# ---- validation -----------------------------------------------------------------------------

def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def _load_matrix(weight, name: str = "weight") -> tuple[np.ndarray, bool]:
    """[layers, experts] float32 copy of ``weight`` and whether it was 1-D."""
    arr = np.asarray(weight)
    if arr.ndim not in (1, 2):
        raise ValueError(f"{name} must be [num_logical_experts] or [layers, num_logical_experts], "
                         f"got shape {arr.shape}")
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer)
                                 or np.issubdtype(arr.dtype, np.floating)):
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    if 0 in arr.shape:
        raise ValueError(f"{name} is empty (shape {arr.shape})")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds non-finite values")
    if np.any(arr < 0):
        raise ValueError(f"{name} holds negative loads (min {arr.min()})")
    one_layer = arr.ndim == 1
    return arr.reshape(1, -1).astype(np.float32) if one_layer else arr.astype(np.float32), one_layer


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
    num_replicas = _positive_int("num_replicas", num_replicas)
    num_groups = _positive_int("num_groups", num_groups)
    num_nodes = _positive_int("num_nodes", num_nodes)
    num_gpus = _positive_int("num_gpus", num_gpus)
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


# ---- load reports ------------------------------------------------------------------------------

def gpu_loads(weight, phy2log, logcnt, num_gpus: int) -> np.ndarray:
    """Per-GPU load [layers, num_gpus] (float64) of a placement: each replica of a logical
    expert serves load / logcnt; slots are split over GPUs in contiguous equal blocks."""
    w, one_layer = _load_matrix(weight)
    w = np.asarray(weight, np.float64).reshape(w.shape)
    phy2log, logcnt = np.asarray(phy2log), np.asarray(logcnt)
    if phy2log.ndim != np.ndim(weight) or phy2log.shape[:-1] != np.shape(weight)[:-1]:
        raise ValueError(f"phy2log shape {phy2log.shape} does not match weight shape {np.shape(weight)}")
    if logcnt.shape != np.shape(weight):
        raise ValueError(f"logcnt shape {logcnt.shape} does not match weight shape {np.shape(weight)}")
    phy2log, logcnt = phy2log.reshape(w.shape[0], -1), logcnt.reshape(w.shape)
    if (logcnt < 1).any():
        raise ValueError("logcnt must be >= 1 for every logical expert")
    num_gpus = _positive_int("num_gpus", num_gpus)
    R = phy2log.shape[1]
    if R % num_gpus:
        raise ValueError(f"num_gpus={num_gpus} does not divide the {R} physical slots of phy2log")
    if phy2log.min() < 0 or phy2log.max() >= w.shape[1]:
        raise ValueError(f"phy2log holds expert ids outside [0, {w.shape[1]})")
    per_slot = np.take_along_axis(w / logcnt, phy2log, -1)
    loads = per_slot.reshape(w.shape[0], num_gpus, R // num_gpus).sum(-1)
    return loads[0] if one_layer else loads


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """Per-GPU loads [layers, num_gpus] before (identity placement: logical expert e alone on
    GPU ``e * num_gpus // num_logical``) and after rebalancing, with max/mean summaries."""

    before: np.ndarray
    after: np.ndarray

    @property
    def max_before(self) -> np.ndarray:
        return self.before.max(-1)

    @property
    def max_after(self) -> np.ndarray:
        return self.after.max(-1)

    @property
    def mean(self) -> np.ndarray:
        return self.after.mean(-1)

    @property
    def imbalance_before(self) -> np.ndarray:
        """max / mean per-GPU load per layer (1.0 is perfect balance)."""
        return self.max_before / np.maximum(self.before.mean(-1), 1e-30)

    @property
    def imbalance_after(self) -> np.ndarray:
        return self.max_after / np.maximum(self.mean, 1e-30)

    def table(self) -> str:
        head = (f"{'layer':>5} {'mean/GPU':>10} {'max before':>11} {'max after':>10} "
                f"{'max/mean before':>16} {'max/mean after':>15}")
        rows = [head, "-" * len(head)]
        for i in range(self.before.shape[0]):
            rows.append(f"{i:>5} {self.mean[i]:>10.1f} {self.max_before[i]:>11.1f} "
                        f"{self.max_after[i]:>10.1f} {self.imbalance_before[i]:>16.3f} "
                        f"{self.imbalance_after[i]:>15.3f}")
        rows.append(f"{'all':>5} {self.mean.mean():>10.1f} {self.max_before.mean():>11.1f} "
                    f"{self.max_after.mean():>10.1f} {self.imbalance_before.mean():>16.3f} "
                    f"{self.imbalance_after.mean():>15.3f}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def load_report(weight, phy2log, logcnt, num_gpus: int) -> LoadReport:
    """Compare per-GPU loads of ``phy2log``/``logcnt`` with the identity placement (no
    redundant experts, logical experts in contiguous blocks over the GPUs)."""
    w, _ = _load_matrix(weight)
    num_gpus = _positive_int("num_gpus", num_gpus)
    L = w.shape[1]
    if L < num_gpus:
        raise ValueError(f"num_gpus={num_gpus} exceeds the {L} logical experts of weight")
    home = np.arange(L) * num_gpus // L
    before = np.zeros((w.shape[0], num_gpus))
    np.add.at(before.T, home, np.asarray(weight, np.float64).reshape(w.shape).T)
    after = gpu_loads(weight, phy2log, logcnt, num_gpus)
    return LoadReport(before=before, after=np.asarray(after).reshape(before.shape))


# ---- training-time balancing ------------------------------------------------------------------

def aux_free_bias_update(bias, load, rate: float):
    """DeepSeek-V3 auxiliary-loss-free balancing: ``bias + rate * sign(mean(load) - load)``.

    ``bias`` [..., E] is the routing bias added to the scores for expert *selection* only
    (``router_bias`` with ``topk_method="noaux_tc"``); ``load`` [..., E] the tokens each
    expert received in the step; the mean is over the experts (last axis). Overloaded experts
    are pushed down by ``rate``, underloaded ones up, balanced ones unchanged. NumPy in, NumPy
    out; jax in, jax out (jit-safe).
    """
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not np.isfinite(rate) or rate < 0:
        raise ValueError(f"rate must be a finite number >= 0, got {rate!r}")
    if np.shape(bias) != np.shape(load):
        raise ValueError(f"bias shape {np.shape(bias)} does not match load shape {np.shape(load)}")
    if np.ndim(bias) == 0:
        raise ValueError("bias must have an expert axis, got a scalar")
    xp = jnp if isinstance(bias, jax.Array) or isinstance(load, jax.Array) else np
    load = xp.asarray(load, xp.float32)
    step = xp.sign(load.mean(-1, keepdims=True) - load)
    return (bias + rate * step).astype(xp.asarray(bias).dtype)


# ---- routing statistics ---------------------------------------------------------------------

def expert_load_from_routing(idx, num_experts: int, mask=None):
    """Tokens per expert [E] from routing indices ``idx`` [N, k] (or any shape).

    ``mask`` (optional, broadcastable to idx's leading [N]) excludes padding tokens. NumPy
    in: int64 NumPy out, ids checked to lie in [0, E). jax in: int32 jax out (jit-safe).
    """
    num_experts = _positive_int("num_experts", num_experts)
    if isinstance(idx, jax.Array) or isinstance(mask, jax.Array):
        idx = jnp.asarray(idx)
        if not isinstance(idx, jax.core.Tracer) and idx.size and (
                int(idx.min()) < 0 or int(idx.max()) >= num_experts):
            raise ValueError(f"idx holds expert ids outside [0, num_experts={num_experts})")
        ones = jnp.ones(idx.shape, jnp.int32)
        if mask is not None:
            ones = ones * jnp.asarray(mask, jnp.int32).reshape(
                jnp.shape(mask) + (1,) * (idx.ndim - jnp.ndim(mask)))
        return jnp.zeros(num_experts, jnp.int32).at[idx.reshape(-1)].add(ones.reshape(-1))
    arr = np.asarray(idx)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"idx must hold integer expert ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        raise ValueError(f"idx holds expert ids outside [0, num_experts={num_experts})")
    counts_of = np.ones(arr.shape, np.int64)
    if mask is not None:
        m = np.asarray(mask, bool)
        counts_of = counts_of * m.reshape(m.shape + (1,) * (arr.ndim - m.ndim))
    return np.bincount(arr.reshape(-1).astype(np.int64), weights=counts_of.reshape(-1),
                       minlength=num_experts).astype(np.int64)


def moe_layer_indices(cfg: ModelConfig) -> list[int]:
    """Indices of the MoE layers: the rows of :func:`collect_routing_stats`."""
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _routing_stats_core(params, cfg: ModelConfig, tokens_BT, mask_BT):
    """(counts [moe_layers, E] int32, logits [B,T,V]) of one causal forward pass."""
    B, T = tokens_BT.shape
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = transformer.embed(params, tokens_BT, cfg)
    counts = []
    for lp in params["layers"]:
        h, _ = transformer.attention(lp, cfg, mla.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), q_pos)
        x = x + h
        x_norm = mla.rms_norm(x, lp["ffn_norm"], cfg.rms_norm_eps)
        if "moe" in lp:
            _, idx = moe_lib.gate(lp["moe"], cfg, x_norm.reshape(B * T, -1))
            counts.append(expert_load_from_routing(idx, cfg.n_routed_experts, mask_BT.reshape(-1)))
        x = x + transformer.ffn(lp, cfg, x_norm)
    stats = jnp.stack(counts) if counts else jnp.zeros((0, cfg.n_routed_experts), jnp.int32)
    return stats, transformer.head(params, cfg, x)


def collect_routing_stats(params, cfg: ModelConfig, tokens, mask=None) -> np.ndarray:
    """Tokens routed to each expert in each MoE layer during a causal forward of ``tokens``
    [B,T]: int64 [num_moe_layers, n_routed_experts] (rows in :func:`moe_layer_indices`
    order), each row summing to (unmasked tokens) * num_experts_per_tok. ``mask`` [B,T]
    (bool, optional) leaves out padding. Feed a (moving average of) this to
    :func:`rebalance_experts`.
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if not cfg.n_routed_experts:
        raise ValueError("cfg has no routed experts (n_routed_experts=0)")
    tokens = transformer.check_tokens(cfg, tokens, 2)
    if mask is None:
        mask = np.ones(tokens.shape, bool)
    mask = np.asarray(mask)
    if mask.shape != tokens.shape:
        raise ValueError(f"mask shape {mask.shape} does not match tokens shape {tokens.shape}")
    stats, _ = _routing_stats_core(params, cfg, tokens, jnp.asarray(mask, bool))
    return np.asarray(stats, np.int64)
