"""Input checks of the model's public entry points (host side, before any compute): shapes,
dtypes, token ids and lengths, and the params' layer form against the config and cache.

Checks never wait for the device: a ``jax.Array`` input is checked for shape and dtype only
(its values would have to be fetched), host inputs (numpy, lists) for their values too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.config import ModelConfig
from pdjax.model import layer_scan


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def on_device(x) -> bool:
    """A concrete jax.Array: reading its values would copy them to the host and wait for them."""
    return isinstance(x, jax.Array) and not is_tracer(x)


def check_tokens(cfg: ModelConfig, tokens, ndim: int, name: str = "tokens"):
    """Shape and dtype checks, and for host inputs the range of the ids; returns int32 tokens
    (a device array stays on its devices and its ids are not range-checked: that would fetch
    them and wait for the computation that makes them)."""
    if is_tracer(tokens):
        return tokens
    device = on_device(tokens)
    arr = tokens if device else np.asarray(tokens)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be integer token ids, got dtype {arr.dtype}")
    if 0 in arr.shape:
        raise ValueError(f"{name} is empty (shape {arr.shape})")
    if device:
        return arr if arr.dtype == jnp.int32 else arr.astype(jnp.int32)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= cfg.vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds token id {bad}, outside [0, vocab_size={cfg.vocab_size})")
    return jnp.asarray(arr, jnp.int32)


def prompt_problem(prompt, vocab_size: int):
    """``(TypeError or ValueError, why)`` when ``prompt`` is not a flat, non-empty sequence of
    integer token ids in ``[0, vocab_size)`` (``why`` a phrase: "is empty", "holds token id
    300, outside [0, vocab_size=256)", ...), else None. Nothing is coerced: floats, strings,
    bools and nested lists are refused."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
        return TypeError, f"must be a list of integer token ids, got {type(prompt).__name__}"
    if len(prompt) == 0:
        return ValueError, "is empty"
    try:
        arr = np.asarray(prompt)
    except ValueError:
        return TypeError, "must be a flat list of integer token ids, got a ragged nested sequence"
    if arr.ndim != 1:
        return TypeError, f"must be a flat list of integer token ids, got {arr.ndim} dims (shape {arr.shape})"
    if arr.dtype == bool or (not isinstance(prompt, np.ndarray)
                             and any(isinstance(t, (bool, np.bool_)) for t in prompt)):
        return TypeError, "holds a bool, not a token id"
    if not np.issubdtype(arr.dtype, np.integer):
        return TypeError, f"must hold integer token ids, got {arr.dtype} values (nothing is rounded or parsed)"
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        return ValueError, f"holds token id {lo if lo < 0 else hi}, outside [0, vocab_size={vocab_size})"
    return None


def check_count(name: str, value) -> int:
    """A positive integer count (not a bool, not a float): ``value`` as an int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_layers(params, cfg: ModelConfig, cache=None, moe_impl=None) -> None:
    """Host-side: the params' layer form (per-layer or stacked per run, see
    :mod:`pdjax.model.layer_scan`) agrees with ``cfg``, the cache's form and ``moe_impl``."""
    if not layer_scan.is_stacked(params):
        if isinstance(cache, layer_scan.StackedKVCache):
            raise ValueError("a StackedKVCache needs stacked params (pdjax.stack_layers); "
                             "per-layer params take a KVCache (StackedKVCache.unstacked())")
        return
    layer_scan.check_stacked(params, cfg)
    if cache is not None and not isinstance(cache, layer_scan.StackedKVCache):
        raise ValueError(f"stacked params need a StackedKVCache, got {type(cache).__name__} "
                         "(pdjax.model.layer_scan.stack_cache converts a KVCache)")
    if cache is not None and cache.num_layers != cfg.num_hidden_layers:
        raise ValueError(f"cache holds {cache.num_layers} layers, cfg.num_hidden_layers={cfg.num_hidden_layers}")
    if hasattr(moe_impl, "run_layers"):
        raise ValueError(f"moe_impl {type(moe_impl).__name__} runs its own layer loop over per-layer "
                         "params; stacked params cannot use it (unstack_layers first)")


def check_lengths(lengths, B: int, T: int):
    """Per-row valid tokens of a [B,T] chunk: default T; a device array is checked for shape
    and dtype only, host values also for the range [1, T]."""
    if lengths is None:
        return np.full((B,), T, np.int32)
    if is_tracer(lengths):
        return lengths
    if on_device(lengths):
        if lengths.shape != (B,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"lengths must be [B={B}] integers, got shape {lengths.shape} dtype {lengths.dtype}")
        return lengths.astype(jnp.int32)
    lengths = np.asarray(lengths, np.int32)
    if lengths.shape != (B,) or lengths.min() < 1 or lengths.max() > T:
        raise ValueError(f"lengths must be [B={B}] values in [1, {T}], got {lengths.tolist()}")
    return lengths
