"""pdjax: deployment architecture of DeepSeek-style MoE models, in JAX.

The model API is pure functions over param pytrees::

    cfg = pdjax.configs.tiny()
    params = pdjax.init_params(cfg, jax.random.key(0))
    logits = pdjax.forward(params, cfg, tokens)
    logits, cache = pdjax.prefill(params, cfg, tokens, max_len=64)
    logits, cache = pdjax.decode_step(params, cfg, next_tokens, cache)
    out = pdjax.generate(params, cfg, prompts, max_new_tokens=16)     # speculative="mtp": MTP drafts
    loss = pdjax.loss(params, cfg, tokens, mtp_weight=0.3)            # + lambda * the MTP loss

Every subpackage is an attribute (``pdjax.analysis``, ``pdjax.pipeline``, ``pdjax.sim``,
``pdjax.disagg``, ``pdjax.parallel``, ``pdjax.model``, ``pdjax.experiments``), imported on
first use: ``import pdjax`` itself loads no jax, and the pure-Python parts (schedules,
analysis, the serving simulator) never do. ``import pdjax`` turns on jax's persistent
compilation cache in ``~/.cache/pdjax/jax`` unless a cache directory is set or
``PDJAX_NO_COMPILATION_CACHE=1`` (:mod:`pdjax.compilation`).
"""

import importlib

from pdjax import compilation, configs
from pdjax.model_config import ModelConfig, RopeScaling

# jax's persistent compilation cache in the user's cache directory, unless they chose one or
# opted out (PDJAX_NO_COMPILATION_CACHE=1): see pdjax.compilation
compilation.enable_default_cache()

SUBPACKAGES = ("analysis", "api", "cluster", "disagg", "experiments", "model", "parallel", "pipeline", "schedules", "sim")

# public name -> the module that defines it (imported on first use)
_LAZY = {
    "KVCache": "pdjax.model.cache", "init_cache": "pdjax.model.cache",
    "load_hf": "pdjax.model.hf", "restore_params": "pdjax.model.hf", "save_hf": "pdjax.model.hf",
    "save_params": "pdjax.model.hf",
    "decode_step": "pdjax.api", "forward": "pdjax.api", "generate": "pdjax.api", "prefill": "pdjax.api",
    "init_params": "pdjax.model.transformer", "loss": "pdjax.model.loss",
    "stack_layers": "pdjax.model.layer_scan", "unstack_layers": "pdjax.model.layer_scan",
}


def __getattr__(name):
    if name in SUBPACKAGES:
        return importlib.import_module(f"pdjax.{name}")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pdjax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(SUBPACKAGES) | set(_LAZY))


__all__ = [
    "ModelConfig", "RopeScaling", "KVCache", "configs", "decode_step", "forward", "generate",
    "init_cache", "init_params", "load_hf", "loss", "prefill", "restore_params", "save_hf", "save_params",
    "stack_layers", "unstack_layers",
]
