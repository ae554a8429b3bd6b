"""pdjax: deployment architecture of DeepSeek-style MoE models, in JAX.

The model API is pure functions over param pytrees::

    cfg = pdjax.configs.tiny()
    params = pdjax.init_params(cfg, jax.random.key(0))
    logits = pdjax.forward(params, cfg, tokens)
    logits, cache = pdjax.prefill(params, cfg, tokens, max_len=64)
    logits, cache = pdjax.decode_step(params, cfg, next_tokens, cache)
    out = pdjax.generate(params, cfg, prompts, max_new_tokens=16)
"""

from pdjax import configs
from pdjax.config import ModelConfig, RopeScaling
from pdjax.model.cache import KVCache, init_cache
from pdjax.model.hf import load_hf, restore_params, save_hf, save_params
from pdjax.api import decode_step, forward, generate, prefill
from pdjax.model.transformer import init_params

__all__ = [
    "ModelConfig", "RopeScaling", "KVCache", "configs", "decode_step", "forward", "generate",
    "init_cache", "init_params", "load_hf", "prefill", "restore_params", "save_hf", "save_params",
]
