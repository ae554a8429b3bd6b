"""The latent KV cache.

Per token and layer MLA caches ``kv_lora_rank + qk_rope_head_dim`` values:
``[RMSNorm(c_kv) | RoPE(k_pe)]``. One array holds every layer, ``kv [layers, B, S, C+R]``,
and ``lengths [B]`` counts the valid tokens of each row (rows may differ: continuous
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
    kv: jax.Array        # [layers, B, S_max, C+R]
    lengths: jax.Array   # [B] int32

    @property
    def max_len(self) -> int:
        return self.kv.shape[2]

    @property
    def batch(self) -> int:
        return self.kv.shape[1]

    def nbytes_per_token(self) -> int:
        """Bytes one token occupies across all layers (layers * (C+R) * itemsize)."""
        return self.kv.shape[0] * self.kv.shape[3] * self.kv.dtype.itemsize


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    if batch <= 0:
        raise ValueError(f"cache batch must be positive, got {batch}")
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if max_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_len={max_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    kv = jnp.zeros((cfg.num_hidden_layers, batch, max_len, cfg.kv_latent_dim), dtype)
    return KVCache(kv=kv, lengths=jnp.zeros((batch,), jnp.int32))


def write_rows(kv_BSL, new_BTL, start_B):
    """Write new_BTL into kv_BSL at per-row offsets start_B (in place under donation)."""
    def one(row_SL, new_TL, s):
        return jax.lax.dynamic_update_slice(row_SL, new_TL.astype(row_SL.dtype), (s, 0))
    return jax.vmap(one)(kv_BSL, new_BTL, start_B)
