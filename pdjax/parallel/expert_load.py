"""Expert loads: measuring them (routing statistics from real forward passes), comparing
a placement's per-GPU loads with the identity placement, and DeepSeek-V3's aux-loss-free
bias update. The placement policy that balances them is :mod:`pdjax.parallel.eplb`, which
re-exports every name here.

Shapes: ``weight`` [layers, num_logical] (or [num_logical] for one layer) non-negative loads;
``phy2log`` [layers, num_replicas] and ``logcnt`` [layers, num_logical] as
:func:`pdjax.parallel.eplb.rebalance_experts` returns them.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.arguments import check_int
from pdjax.model_config import ModelConfig
from pdjax.model import mla, moe as moe_lib, transformer


# ---- validation -----------------------------------------------------------------------------

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
    num_gpus = check_int("num_gpus", num_gpus)
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
    num_gpus = check_int("num_gpus", num_gpus)
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
    num_experts = check_int("num_experts", num_experts)
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
    :func:`~pdjax.parallel.eplb.rebalance_experts`.
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
