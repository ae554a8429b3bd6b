"""Scan over layers: the decoder layers stacked per run of one kind, each run one ``lax.scan``.

The default params hold a list of per-layer dicts (``params["layers"][l]``) and the model
traces and compiles every layer: compile time grows with depth. :func:`stack_layers` turns
them into the *stacked* form, where every maximal run of consecutive layers of one kind
(dense MLP or MoE, by ``cfg.is_moe_layer``) is one layer dict whose leaves carry a leading
axis of the run's length::

  {"embed", "final_norm", "lm_head",                 # as in the per-layer form
   "layer_runs": (run_0, run_1, ...)}               # run_i: a layer dict, leaves [n_i, ...]

DeepSeek-V3 (61 layers, ``first_k_dense_replace=3``) has two runs: 3 dense, then 58 MoE, so
the model compiles two layer bodies whatever its depth. With ``moe_layer_freq > 1`` dense and
MoE layers alternate and every run is one layer long: the stacked form is still correct but
saves no compile time.

``pdjax.forward / prefill / decode_step / generate`` accept either form (the public functions
in :mod:`pdjax.model.transformer`). With stacked params the cache is a
:class:`StackedKVCache`: one ``[n_i, B, S, C+R]`` buffer per run. A decode step carries each
run's buffer through its scan and writes the new rows into it with cache.write_rows (in
place: the step donates the cache and the scan's carry aliases it), so a float32 step copies
no cache. Narrow floats (bf16, fp8) are scanned as their bits (:func:`_as_bits`: XLA:CPU
would slice and update them on float32 copies of whole stacks), at one copy of each stack
per step (the cache: one each way). MoE statistics (``moe.collect_stats``, ``return_stats``)
come out per MoE layer in layer order, as in the per-layer form.

Everything else in pdjax (``parallel/``, ``pipeline/``, ``disagg/``, ``save_hf``) takes the
per-layer form; :func:`unstack_layers` and :meth:`StackedKVCache.unstacked` convert back.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pdjax.model_config import ModelConfig
from pdjax.model import moe as moe_lib
from pdjax.model.cache import (KVCache, check_empty_cache, empty_lengths, is_narrow_float, to_cache_dtype,
                               write_rows)


class LayerRun(NamedTuple):
    """Layers ``start <= l < stop``, all MoE (``moe``) or all dense."""
    start: int
    stop: int
    moe: bool

    @property
    def length(self) -> int:
        return self.stop - self.start


def layer_runs(cfg: ModelConfig) -> tuple[LayerRun, ...]:
    """The maximal runs of consecutive same-kind layers, in layer order."""
    runs: list[LayerRun] = []
    for layer in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(layer)
        if runs and runs[-1].moe == moe:
            runs[-1] = runs[-1]._replace(stop=layer + 1)
        else:
            runs.append(LayerRun(layer, layer + 1, moe))
    return tuple(runs)


def is_stacked(params) -> bool:
    """Whether ``params`` are in the stacked form (a ``"layer_runs"`` entry)."""
    return isinstance(params, dict) and "layer_runs" in params


# ---- params: stack, unstack, check ----------------------------------------------------------

def stack_layers(params: dict, cfg: ModelConfig) -> dict:
    """Per-layer params -> the stacked form: each run of same-kind layers (dense, MoE) one layer
    dict with a leading layer axis, run as one ``lax.scan`` (compile time independent of depth).

    The layer weights are copied; the other entries are shared. Raises ValueError when the
    layers disagree with ``cfg`` (count or kind)."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if is_stacked(params):
        raise ValueError("params are already stacked (they hold 'layer_runs')")
    if not isinstance(params, dict) or "layers" not in params:
        raise ValueError("stack_layers takes per-layer params (a dict with 'layers')")
    layers = params["layers"]
    if len(layers) != cfg.num_hidden_layers:
        raise ValueError(f"params hold {len(layers)} layers, cfg.num_hidden_layers="
                         f"{cfg.num_hidden_layers}")
    for l, lp in enumerate(layers):
        if ("moe" in lp) != cfg.is_moe_layer(l):
            raise ValueError(f"layer {l} is {'MoE' if 'moe' in lp else 'dense'} in params but "
                             f"{'MoE' if cfg.is_moe_layer(l) else 'dense'} in cfg")
    runs = tuple(jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers[r.start:r.stop])
                 for r in layer_runs(cfg))
    out = {k: v for k, v in params.items() if k != "layers"}
    out["layer_runs"] = runs
    return out


def unstack_layers(params: dict, cfg: ModelConfig) -> dict:
    """The stacked form -> per-layer params (``params["layers"][l]``), equal to what
    :func:`stack_layers` was given."""
    check_stacked(params, cfg)
    layers = []
    for run, stack in zip(layer_runs(cfg), params["layer_runs"]):
        layers += [jax.tree.map(lambda leaf, i=i: leaf[i], stack) for i in range(run.length)]
    out = {k: v for k, v in params.items() if k != "layer_runs"}
    out["layers"] = layers
    return out


def check_stacked(params, cfg: ModelConfig) -> None:
    """Host-side check that stacked params match ``cfg``'s runs (count, kind, length of each)."""
    if not is_stacked(params):
        raise ValueError("expected stacked params (from pdjax.stack_layers), got no 'layer_runs'")
    runs, stacks = layer_runs(cfg), params["layer_runs"]
    if len(stacks) != len(runs):
        raise ValueError(f"stacked params hold {len(stacks)} layer runs, cfg has {len(runs)} "
                         f"({_describe(runs)})")
    for i, (run, stack) in enumerate(zip(runs, stacks)):
        if ("moe" in stack) != run.moe:
            raise ValueError(f"layer run {i} is {'MoE' if 'moe' in stack else 'dense'} in params, "
                             f"{'MoE' if run.moe else 'dense'} in cfg ({_describe(runs)})")
        n = {leaf.shape[0] if leaf.ndim else None for leaf in jax.tree.leaves(stack)}
        if n != {run.length}:
            raise ValueError(f"layer run {i} stacks {sorted(n, key=str)} layers, cfg has "
                             f"{run.length} ({_describe(runs)})")


def _describe(runs) -> str:
    return ", ".join(f"{'MoE' if r.moe else 'dense'} layers {r.start}-{r.stop - 1}" for r in runs)


# ---- the cache --------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StackedKVCache:
    """The latent cache of stacked params: per layer run one ``[n_run, B, S_max, C+R]`` buffer
    (the rows of :class:`pdjax.model.cache.KVCache`, stacked as the run's layers are), and each
    sequence's length ``[B]`` int32."""

    kv: tuple            # per run: [n_run, B, S_max, C+R]
    lengths: jax.Array   # [B] int32

    @property
    def max_len(self) -> int:
        return self.kv[0].shape[2]

    @property
    def batch(self) -> int:
        return self.kv[0].shape[1]

    @property
    def dtype(self):
        return self.kv[0].dtype

    @property
    def num_layers(self) -> int:
        return sum(x.shape[0] for x in self.kv)

    def nbytes_per_token(self) -> int:
        """Bytes one token occupies across all layers (layers * (C+R) * itemsize)."""
        return sum(x.shape[0] * x.shape[3] * x.dtype.itemsize for x in self.kv)

    def layers(self) -> tuple:
        """What each layer run's scan carries (here: the [n,B,S,C+R] buffers)."""
        return self.kv

    def with_layers(self, layers, lengths) -> "StackedKVCache":
        return StackedKVCache(kv=tuple(layers), lengths=lengths)

    def unstacked(self) -> KVCache:
        """The per-layer :class:`KVCache` with the same rows (a copy)."""
        return KVCache(kv=tuple(x[i] for x in self.kv for i in range(x.shape[0])), lengths=self.lengths)

    def stacked(self) -> jax.Array:
        """All layers as one array [layers, B, S_max, C+R] (a copy)."""
        return jnp.concatenate(self.kv)


def stack_cache(cache: KVCache, cfg: ModelConfig) -> StackedKVCache:
    """A per-layer :class:`KVCache` -> the :class:`StackedKVCache` of ``cfg``'s runs (a copy)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"stack_cache takes a KVCache, got {type(cache).__name__}")
    if len(cache.kv) != cfg.num_hidden_layers:
        raise ValueError(f"cache holds {len(cache.kv)} layers, cfg.num_hidden_layers={cfg.num_hidden_layers}")
    return StackedKVCache(kv=tuple(jnp.stack(cache.kv[r.start:r.stop]) for r in layer_runs(cfg)),
                          lengths=cache.lengths)


def init_stacked_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> StackedKVCache:
    """An empty :class:`StackedKVCache` (as :func:`pdjax.init_cache`, stacked per layer run)."""
    dtype = check_empty_cache(cfg, batch, max_len, dtype, "init_stacked_cache")
    kv = tuple(jnp.zeros((r.length, batch, max_len, cfg.kv_latent_dim), dtype) for r in layer_runs(cfg))
    return StackedKVCache(kv=kv, lengths=empty_lengths(batch))


def fresh_cache(new_kv, lengths_B, max_len: int, cfg: ModelConfig) -> StackedKVCache:
    """Traced: a fresh prefill's per-run latents [n,B,T,C+R] laid into a cache of max_len."""
    kv = tuple(jnp.pad(to_cache_dtype(k, cfg.kv_cache_dtype), ((0, 0), (0, 0), (0, max_len - k.shape[2]), (0, 0)))
               for k in new_kv)
    return StackedKVCache(kv=kv, lengths=lengths_B.astype(jnp.int32))


class _RunLayerCache:
    """Layer ``index`` of a run's cache buffer [n,B,S,C+R], as the attention sees it: it writes
    the new rows into the whole buffer (:func:`pdjax.model.cache.write_rows`, in place in the
    scan's carry) and reads the layer's rows back. A narrow-float buffer is carried as its bits
    (:func:`_as_bits`; ``dtype`` is the cache's)."""

    def __init__(self, buffer_NBSL, index, dtype):
        self.buffer, self.index, self.dtype = buffer_NBSL, index, dtype

    def write_and_view(self, new_BTL, start_B):
        buf = write_rows(self.buffer, _as_bits(to_cache_dtype(new_BTL, self.dtype)), start_B, self.index)
        return buf, _from_bits(jax.lax.dynamic_index_in_dim(buf, self.index, 0, keepdims=False), self.dtype)


def _as_bits(x):
    """A narrow-float (bf16, fp8) array as unsigned integers (the same bits). XLA:CPU runs any
    slice or update of a narrow float on a float32 (fp8: float16) copy of the whole array; a
    scan that slices a layer out of a stack each step copies the stack first (hoisted out of
    the loop: 3x the stack's bytes, then 3x each layer's), and an update of a layer of the
    cache stack copies the stack each layer. As bits a slice is read as it is and an update is
    in place; the reinterpretation costs one copy of the stack (2x its bytes) each way.
    Anything else is returned as it is."""
    if not is_narrow_float(x.dtype):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _from_bits(x, dtype):
    """:func:`_as_bits` undone (``dtype``: the original's)."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


# ---- the layer loop ----------------------------------------------------------------------------

def run_layers(layer_fn, params, cfg, x_BTD, q_pos_BT, kv_runs=None, start_B=None, absorbed=False,
               moe_impl=None, valid_BT=None):
    """All decoder layers of stacked params, one ``lax.scan`` per layer run; ``layer_fn`` is
    :func:`pdjax.model.transformer.layer`. Returns (x, per-run kv): the new latents
    [n,B,T,C+R] without a cache, the updated run buffers [n,B,S,C+R] with one."""
    stacks = params["layer_runs"]
    if kv_runs is not None and (len(kv_runs) != len(stacks)
                                or any(getattr(k, "ndim", None) != 4 for k in kv_runs)):
        raise TypeError("stacked params need a StackedKVCache (one [n,B,S,C+R] buffer per layer run)")
    new_kv = []
    for i, stack in enumerate(stacks):
        # the weights are sliced as bits: each layer's are reinterpreted back inside the scan
        stack_bits, dtypes = jax.tree.map(_as_bits, stack), jax.tree.map(lambda w: w.dtype, stack)
        if kv_runs is None:
            def body(x, bits):
                with moe_lib.collect_stats() as stats:
                    x, new = layer_fn(jax.tree.map(_from_bits, bits, dtypes), cfg, x, q_pos_BT, None, None, absorbed,
                                      moe_impl, valid_BT)
                return x, (new, moe_lib.stacked_stats(stats))
            x_BTD, (kv, stats) = jax.lax.scan(body, x_BTD, stack_bits)
        else:
            dtype = kv_runs[i].dtype

            def body(carry, xs):
                x, buf = carry
                bits, index = xs
                with moe_lib.collect_stats() as stats:
                    x, buf = layer_fn(jax.tree.map(_from_bits, bits, dtypes), cfg, x, q_pos_BT,
                                      _RunLayerCache(buf, index, dtype), start_B, absorbed, moe_impl, valid_BT)
                return (x, buf), moe_lib.stacked_stats(stats)
            n = kv_runs[i].shape[0]
            (x_BTD, kv), stats = jax.lax.scan(body, (x_BTD, _as_bits(kv_runs[i])),
                                              (stack_bits, jnp.arange(n, dtype=jnp.int32)))
            kv = _from_bits(kv, dtype)
        if stats.shape[1]:                 # [n, stats per layer]: re-recorded in layer order
            for layer_stats in stats:
                for value in layer_stats:
                    moe_lib.record_stat(value)
        new_kv.append(kv)
    return x_BTD, tuple(new_kv)
