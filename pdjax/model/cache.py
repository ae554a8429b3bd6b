"""The latent KV cache.

Per token and layer MLA caches ``kv_lora_rank + qk_rope_head_dim`` values:
``[RMSNorm(c_kv) | RoPE(k_pe)]``. ``kv`` is a tuple with one array ``[B, S, C+R]`` per layer
(separate buffers: each layer is read in place, written in place under donation, and can be
handed off on its own), and ``lengths [B]`` counts the valid tokens of each row (rows may differ: continuous
batching and ragged prompts). Positions >= lengths[b] hold garbage and are masked.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
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


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    if batch <= 0:
        raise ValueError(f"cache batch must be positive, got {batch}")
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if max_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_len={max_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    kv = tuple(jnp.zeros((batch, max_len, cfg.kv_latent_dim), dtype)
               for _ in range(cfg.num_hidden_layers))
    return KVCache(kv=kv, lengths=jnp.zeros((batch,), jnp.int32))


def write_rows(kv_BSL, new_BTL, start_B):
    """Write new_BTL into kv_BSL at per-row offsets start_B (one scatter, in place under
    donation). Callers check start + T <= S on the host first."""
    B, T = new_BTL.shape[:2]
    rows = jnp.arange(B)[:, None]
    cols = start_B[:, None] + jnp.arange(T)[None, :]
    return kv_BSL.at[rows, cols].set(new_BTL.astype(kv_BSL.dtype), unique_indices=True)
