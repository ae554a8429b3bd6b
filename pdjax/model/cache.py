"""The latent KV cache.

Per token and layer MLA caches ``kv_lora_rank + qk_rope_head_dim`` values:
``[RMSNorm(c_kv) | RoPE(k_pe)]``. ``kv`` is a tuple with one array ``[B, S, C+R]`` per layer
(separate buffers: each layer is read in place, written in place under donation, and can be
handed off on its own), and ``lengths [B]`` counts the valid tokens of each row (rows may differ: continuous
batching and ragged prompts). Positions >= lengths[b] hold garbage and are masked.

The cache's dtype is ``cfg.kv_cache_dtype`` (``cache_dtype``, else the compute dtype): rows
are rounded to it when written (float8 saturates at its largest finite value, no scale) and
attention reads them back in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.model_config import ModelConfig, dtype_name


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """The contiguous latent cache of a batch: per layer ``[B, S_max, C+R]`` rows (the
    compressed latent ``c_KV`` of width ``kv_lora_rank`` = C and the shared RoPE key of width
    ``qk_rope_head_dim`` = R, in ``cfg.kv_cache_dtype``) and each sequence's length."""

    kv: tuple            # per layer: [B, S_max, C+R]
    lengths: jax.Array   # [B] int32

    @property
    def max_len(self) -> int:
        return self.kv[0].shape[1]

    @property
    def batch(self) -> int:
        return self.kv[0].shape[0]

    @property
    def dtype(self):
        return self.kv[0].dtype

    def nbytes_per_token(self) -> int:
        """Bytes one token occupies across all layers (layers * (C+R) * itemsize)."""
        return sum(x.shape[2] * x.dtype.itemsize for x in self.kv)

    def layers(self) -> tuple:
        """What each layer's attention reads and writes (here: the [B,S,C+R] arrays)."""
        return self.kv

    def with_layers(self, layers, lengths) -> "KVCache":
        return KVCache(kv=tuple(layers), lengths=lengths)

    def stacked(self) -> jax.Array:
        """All layers as one array [layers, B, S_max, C+R] (a copy)."""
        return jnp.stack(self.kv)


def check_empty_cache(cfg: ModelConfig, batch: int, max_len: int, dtype, what: str):
    """The dtype of a new empty cache (default ``cfg.kv_cache_dtype``), after checking its
    batch and length; ``what`` names the caller in the errors."""
    dtype = cfg.kv_cache_dtype if dtype is None else dtype_name(dtype, f"{what} dtype")
    if batch <= 0:
        raise ValueError(f"cache batch must be positive, got {batch}")
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if max_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_len={max_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    return dtype


def empty_lengths(batch: int):
    """Zero lengths [batch] int32 on device, their host copy recorded (:func:`remember_lengths`)."""
    return remember_lengths(jnp.zeros((batch,), jnp.int32), np.zeros(batch, np.int32))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of ``batch`` rows and ``max_len`` positions; ``dtype`` default
    ``cfg.kv_cache_dtype``."""
    dtype = check_empty_cache(cfg, batch, max_len, dtype, "init_cache")
    kv = tuple(jnp.zeros((batch, max_len, cfg.kv_latent_dim), dtype)
               for _ in range(cfg.num_hidden_layers))
    return KVCache(kv=kv, lengths=empty_lengths(batch))


# ---- the host's copy of the lengths -----------------------------------------------------------
# The host chose every row length of a cache that init_cache / prefill / decode_step made, so
# their bound checks (a full cache, a chunk past the end) read this copy instead of fetching
# cache.lengths from the device: a fetch would wait for the step that computes it and stop a
# decode loop from dispatching ahead. Keyed by the device array's id, dropped when the array is.
_HOST_LENGTHS: dict[int, np.ndarray] = {}


def remember_lengths(lengths, host_B):
    """Record that the device array ``lengths`` holds ``host_B`` (numpy [B]); returns ``lengths``.
    Tracers and host arrays are returned unrecorded."""
    if isinstance(lengths, jax.Array) and not isinstance(lengths, jax.core.Tracer):
        key = id(lengths)
        _HOST_LENGTHS[key] = np.asarray(host_B, np.int32)
        weakref.finalize(lengths, _HOST_LENGTHS.pop, key, None)
    return lengths


def host_lengths(lengths):
    """``lengths`` as numpy [B] without a device-to-host copy: a host array as it is, a device
    array the host recorded (:func:`remember_lengths`), else None (a tracer, or a device array
    made elsewhere)."""
    if isinstance(lengths, jax.core.Tracer):
        return None
    if isinstance(lengths, jax.Array):
        return _HOST_LENGTHS.get(id(lengths))
    return np.asarray(lengths)


def to_cache_dtype(x, dtype):
    """``x`` rounded to the cache dtype; float8 formats saturate (clip to their largest finite
    value) rather than overflow to NaN."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1:
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def is_narrow_float(dtype) -> bool:
    """A float narrower than float32 (bf16, fp16, fp8): XLA:CPU runs a slice, an update or a
    scatter of such an array on a float32 (fp8: float16) copy of the whole array."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4


def write_rows(kv_BSL, new_BTL, start_B, layer=None):
    """Write new_BTL [B,T,W] into kv_BSL [B,S,W] at per-row offsets start_B [B]; with
    ``layer`` (an int, traced or not), kv is a stack [n,B,S,W] and its layer ``layer`` is written.

    Callers check start + T <= S on the host first (starts are >= 0).

    A float32 cache is written by one dynamic_update_slice per row, in a loop: in place under
    donation, and with a batch-sharded cache each device updates its own rows. (A scatter is in
    place too, but XLA's cost analysis counts its whole operand read and written, twice the
    cache per layer, and on XLA:CPU it ran about 5x slower.) The loop runs B times, but its
    trip count is traced (B + min(start_B[0], 0)): with a constant count of 1, XLA removes
    the loop and fuses the lone update into the cache's readers, each then copying the whole
    layer (B=1 decode read 4 extra copies of the cache per layer).

    A narrow-float layer (bf16, fp8) is written by one select over it (:func:`_select_rows`):
    XLA:CPU runs any update of a narrow-float array on a float32 (fp8: float16) copy of the
    whole array, and writing it as bits (unsigned integers) costs a copy at each
    reinterpretation. The select reads and writes the layer once, elementwise (so a
    batch-sharded cache stays local): a bf16 [64, 8K, 48] layer written in 2.3 ms and 2x its
    bytes, as bits 25.7 ms and 4x; [8, 8K, 528]: 1.8 against 35.7 ms. A stack written by
    ``layer`` is updated in place instead, so a narrow float's stack is passed as its bits
    (unsigned integers, the rows too; :mod:`pdjax.model.layer_scan` carries it so)."""
    if jnp.issubdtype(kv_BSL.dtype, jnp.floating):          # not a stack's bits
        new_BTL = to_cache_dtype(new_BTL, kv_BSL.dtype)
    if layer is None and is_narrow_float(kv_BSL.dtype):
        return _select_rows(kv_BSL, new_BTL, start_B)
    lead = () if layer is None else (layer,)

    def row(b, kv):
        rows = jax.lax.dynamic_slice_in_dim(new_BTL, b, 1)
        return jax.lax.dynamic_update_slice(kv, rows.reshape((1,) * len(lead) + rows.shape), lead + (b, start_B[b], 0))
    trips = new_BTL.shape[0] + jnp.minimum(start_B[0], 0)
    return jax.lax.fori_loop(0, trips, row, kv_BSL)


def _select_rows(kv_BSL, new_BTL, start_B):
    """kv_BSL with rows [start_b, start_b + T) of each row b replaced by new_BTL[b] (same
    dtype): ``where(inside, new row s - start_b, old)`` over the whole layer, one fused pass."""
    S, T = kv_BSL.shape[1], new_BTL.shape[1]
    offset_BS = jnp.arange(S, dtype=jnp.int32)[None, :] - start_B.astype(jnp.int32)[:, None]
    inside_BS1 = ((offset_BS >= 0) & (offset_BS < T))[:, :, None]
    if T == 1:
        rows_BSW = jnp.broadcast_to(new_BTL, kv_BSL.shape)
    else:
        rows_BSW = jnp.take_along_axis(new_BTL, jnp.clip(offset_BS, 0, T - 1)[:, :, None], axis=1)
    return jnp.where(inside_BS1, rows_BSW, kv_BSL)


def scatter_rows(buf, index, rows):
    """``buf.at[index].set(rows)`` (``index`` one integer array, or int, per leading axis of
    ``buf [..., W]``; ``rows [..., W]``), the rows rounded to the buffer's dtype as every cache
    write rounds them (:func:`to_cache_dtype`: float8 saturates): the paged pool's write and the
    decode pool's insert.

    A float32 buffer is scattered into in place. A narrow float (bf16, fp8) is written by one
    select over it, as :func:`write_rows` writes a layer: XLA:CPU would scatter into a float32
    copy of the whole buffer, and as bits it copies the buffer at each reinterpretation (4
    passes). Here a small integer map of the buffer's positions records which row lands where
    (an in-place int32 scatter), and the select reads and writes the buffer once (2 passes;
    bf16 [1024, 64, 144] pool, 64 rows: 2.0-3.1 ms as bits, 0.7-1.4 ms)."""
    rows = to_cache_dtype(rows, buf.dtype)
    if not is_narrow_float(buf.dtype):
        return buf.at[index].set(rows)
    ids = jnp.arange(math.prod(rows.shape[:-1]), dtype=jnp.int32).reshape(rows.shape[:-1])
    owner = jnp.full(buf.shape[:-1], -1, jnp.int32).at[index].set(ids)
    flat = rows.reshape(-1, rows.shape[-1])
    return jnp.where((owner >= 0)[..., None], flat[jnp.maximum(owner, 0)], buf)
