"""Input checks of the model's public entry points (host side, before any compute): shapes,
dtypes, token ids and lengths, and the params' layer form against the config and cache.

Checks never wait for the device: a ``jax.Array`` input is checked for shape and dtype only
(its values would have to be fetched), host inputs (numpy, lists) for their values too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.model_config import ModelConfig
from pdjax.model import layer_scan
from pdjax.model.cache import KVCache
from pdjax.model.params import param_shapes


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def on_device(x) -> bool:
    """A concrete jax.Array: reading its values would copy them to the host and wait for them."""
    return isinstance(x, jax.Array) and not is_tracer(x)


def check_cfg(cfg) -> None:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig (e.g. pdjax.configs.tiny()), got {type(cfg).__name__}")


def check_mesh(mesh) -> None:
    """A ``mesh=`` argument: a jax.sharding.Mesh, or None (one device)."""
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (pdjax.parallel.make_mesh) or None, got {type(mesh).__name__}")


def check_tokens(cfg: ModelConfig, tokens, ndim: int, name: str = "tokens", *, host: bool = False):
    """The one check of a token batch (the model's entry points, the pipeline executor):
    ``ndim`` dims, none empty, integer ids, and for host inputs every id in
    ``[0, vocab_size)``; returns int32 tokens (a device array stays on its devices and its ids
    are not range-checked: that would fetch them and wait for the computation that makes
    them). ``host``: a host input comes back as int32 numpy, for a caller that places it
    itself (the pipeline executor), rather than as a jax array on the default device."""
    check_cfg(cfg)
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
    return arr.astype(np.int32) if host else jnp.asarray(arr, jnp.int32)


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


def check_layers(params, cfg: ModelConfig, cache=None, moe_impl=None) -> None:
    """Host-side: the params' layer form (per-layer or stacked per run, see
    :mod:`pdjax.model.layer_scan`) agrees with ``cfg``, the cache's form and ``moe_impl``;
    the params' structure and shapes are ``cfg``'s (:func:`check_params`), the cache's layers
    and latent width too (:func:`check_cache`)."""
    check_params(params, cfg)
    if cache is not None:
        check_cache(cache, cfg)
    if not layer_scan.is_stacked(params):
        if isinstance(cache, layer_scan.StackedKVCache):
            raise ValueError("a StackedKVCache needs stacked params (pdjax.stack_layers); "
                             "per-layer params take a KVCache (StackedKVCache.unstacked())")
        return
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
    arr = np.asarray(lengths)
    if arr.shape != (B,) or not np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool:
        raise ValueError(f"lengths must be [B={B}] integers in [1, {T}], got {lengths!r}")
    if arr.min() < 1 or arr.max() > T:
        raise ValueError(f"lengths must be [B={B}] values in [1, {T}], got {arr.tolist()}")
    return arr.astype(np.int32)


# ---- params and caches held against the config ---------------------------------------------------

_CHECKED: set = set()       # (cfg, tree structure, leaf shapes) already held against their cfg


def check_params(params, cfg: ModelConfig) -> None:
    """The params' tree and every leaf's shape are those ``init_params(cfg)`` makes (per-layer
    or stacked per layer run): a tree of another vocabulary, width, layer or expert count is a
    ValueError naming the first leaf that differs, its shape and the one ``cfg`` gives. Checked
    once per (cfg, structure, shapes); a leaf must be an array of a floating dtype."""
    check_cfg(cfg)
    leaves, treedef = jax.tree.flatten(params)
    key = (cfg, treedef, tuple((getattr(a, "shape", None), getattr(a, "dtype", None)) for a in leaves))
    if key in _CHECKED:
        return
    if not isinstance(params, dict):
        raise TypeError(f"params must be the dict init_params / load_hf give, got {type(params).__name__}")
    ref = param_shapes(cfg)
    if layer_scan.is_stacked(params):
        held = _stacked_layers(params)
        if held is not None and held != cfg.num_hidden_layers:
            raise ValueError(f"params['layer_runs'] hold {held} layers in all, cfg gives {cfg.num_hidden_layers} "
                             "(cfg.num_hidden_layers)")
        layer_scan.check_stacked(params, cfg)
        _compare({k: v for k, v in params.items() if k != "layer_runs"},
                 {k: v for k, v in ref.items() if k != "layers"}, "params")
        for i, (run, stack) in enumerate(zip(layer_scan.layer_runs(cfg), params["layer_runs"])):
            inner = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stack)
            _compare(inner, ref["layers"][run.start], f"params['layer_runs'][{i}] (per layer)")
    else:
        _compare(params, ref, "params")
    _CHECKED.add(key)


def _stacked_layers(params) -> int | None:
    """The layers stacked params hold in all: the sum of each run's leading dimension (None
    when a run's leaves disagree on it, which :func:`layer_scan.check_stacked` names)."""
    stacks, total = params["layer_runs"], 0
    if not isinstance(stacks, (list, tuple)):
        return None
    for stack in stacks:
        n = {tuple(getattr(leaf, "shape", ()))[:1] for leaf in jax.tree.leaves(stack)}
        if len(n) != 1 or n == {()}:
            return None
        total += n.pop()[0]
    return total


EPLB_KEYS = ("log2phy", "logcnt")       # an EPLB placement's tables (pdjax.parallel.eplb)
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def _compare(got, want, where: str) -> None:
    if isinstance(want, dict) and isinstance(got, dict) and set(EPLB_KEYS) <= set(got) - set(want):
        got, want = _physical(got, want, where)
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            have = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise ValueError(f"{where} holds {have}, cfg gives {sorted(want)}")
        for k in want:
            _compare(got[k], want[k], f"{where}[{k!r}]")
        return
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            n = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
            what = " (cfg.num_hidden_layers)" if where.endswith("['layers']") else ""
            raise ValueError(f"{where} holds {n} entries, cfg gives {len(want)}{what}")
        for i, (g, w) in enumerate(zip(got, want)):
            _compare(g, w, f"{where}[{i}]")
        return
    shape = getattr(got, "shape", None)
    if shape is None or tuple(shape) != tuple(want.shape):
        raise ValueError(f"{where} has shape {None if shape is None else tuple(shape)}, cfg gives {tuple(want.shape)}")
    if not jnp.issubdtype(got.dtype, jnp.floating):
        raise TypeError(f"{where} must be a floating array, got dtype {got.dtype}")


def _physical(got: dict, want: dict, where: str):
    """A MoE layer placed by EPLB holds its physical experts (replicas included) and the
    placement's tables: the expert weights are held against the logical ones but for their
    expert count, which the three share."""
    counts = {k: got[k].shape[0] for k in EXPERT_WEIGHTS if hasattr(got.get(k), "shape")}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{where}: the expert weights hold different expert counts {counts}")
    got = {k: v for k, v in got.items() if k not in EPLB_KEYS}
    want = dict(want)
    for k, n in counts.items():
        if k in want:
            want[k] = jax.ShapeDtypeStruct((n, *want[k].shape[1:]), want[k].dtype)
    return got, want


def check_cache(cache, cfg: ModelConfig) -> None:
    """A KVCache (or StackedKVCache) of ``cfg``: one buffer per layer (per layer run) of
    latent width ``kv_lora_rank + qk_rope_head_dim`` and one length per row."""
    if not isinstance(cache, (KVCache, layer_scan.StackedKVCache)):
        raise TypeError(f"cache must be a KVCache (or StackedKVCache), got {type(cache).__name__}")
    width = cfg.kv_latent_dim
    stacked = isinstance(cache, layer_scan.StackedKVCache)
    layers = cache.num_layers if stacked else len(cache.kv)
    if layers != cfg.num_hidden_layers:
        raise ValueError(f"the cache holds {layers} layers, cfg.num_hidden_layers={cfg.num_hidden_layers}")
    for i, buf in enumerate(cache.kv):
        if buf.ndim != (4 if stacked else 3) or buf.shape[-1] != width:
            raise ValueError(f"cache.kv[{i}] has shape {tuple(buf.shape)}: its last dim must be the latent width "
                             f"kv_lora_rank + qk_rope_head_dim = {width}")
        if buf.shape[-3] != cache.kv[0].shape[-3] or buf.shape[-2] != cache.kv[0].shape[-2]:
            raise ValueError(f"cache.kv[{i}] has shape {tuple(buf.shape)}, cache.kv[0] {tuple(cache.kv[0].shape)}: "
                             "every layer needs the same batch and length")
    if tuple(cache.lengths.shape) != (cache.batch,):
        raise ValueError(f"cache.lengths has shape {tuple(cache.lengths.shape)}, the cache's batch is {cache.batch}")
