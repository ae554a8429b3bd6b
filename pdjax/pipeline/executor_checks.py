"""The checks of :class:`pdjax.pipeline.Executor`'s inputs, made before any compute: the
schedule, model and devices it is built for, a token batch, and a param tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.config import ModelConfig
from pdjax.schedules.schedule import Schedule

LOSSES = ("next_token",)


def check_schedule_and_config(schedule, cfg) -> None:
    """The schedule first, then the model config (``Executor(schedule, cfg, ...)``,
    ``train(schedule, cfg, ...)``): a TypeError naming the order when they are swapped."""
    if isinstance(schedule, ModelConfig) and isinstance(cfg, Schedule):
        raise TypeError("the schedule comes first, then the model config: (schedule, cfg, ...), "
                        "got (ModelConfig, Schedule)")
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a pdjax.schedules.Schedule (e.g. pdjax.pipeline.build(...)), "
                        f"got {type(schedule).__name__}")
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")


def check_setup(schedule, cfg: ModelConfig, devices, loss: str) -> tuple[list, int, int]:
    """The arguments of ``Executor(schedule, cfg, devices, loss)``: a valid schedule whose
    pipelines all have the same length and whose micro-batch ids are ``0..m-1``, ranks that
    split ``devices`` (default: all) evenly, and a per-rank sub-mesh that divides the routed
    experts. Returns ``(devices, devices per rank, stages per pipeline)``."""
    check_schedule_and_config(schedule, cfg)
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    schedule.validate()
    layout = schedule.layout
    lengths = {len(p.stages) for p in layout.pipelines}
    if len(lengths) != 1:
        raise ValueError(f"every pipeline must have the same number of stages to hold the whole "
                         f"model, got {sorted(len(p.stages) for p in layout.pipelines)}")
    ids = sorted(m for p in layout.pipelines for m in p.microbatches)
    if ids != list(range(schedule.num_microbatches)):
        raise ValueError(f"the executor needs micro-batch ids 0..{schedule.num_microbatches - 1} "
                         f"(micro-batch i is rows i*b..(i+1)*b of the batch), got {ids[:8]}...")
    devices = list(jax.devices() if devices is None else devices)
    n = schedule.num_ranks
    if n > len(devices):
        raise ValueError(f"the schedule has {n} ranks but only {len(devices)} devices were given (on a CPU, "
                         f"simulate {n} or more with XLA_FLAGS=--xla_force_host_platform_device_count={n}, "
                         "set before jax starts)")
    if len(devices) % n:
        raise ValueError(f"{len(devices)} devices do not split evenly into {n} ranks")
    k = len(devices) // n
    if k > 1 and cfg.n_routed_experts and cfg.n_routed_experts % k:
        raise ValueError(f"each rank's sub-mesh has {k} devices, which do not divide the "
                         f"{cfg.n_routed_experts} routed experts (expert parallelism inside a stage)")
    return devices, k, lengths.pop()


def check_batch(tokens, cfg: ModelConfig, num_microbatches: int, devices_per_rank: int):
    """A token batch [B,T]: a host array is checked fully (shape, dtype, ids in
    ``[0, vocab_size)``) and returned as int32 numpy; a jax.Array only by shape and dtype
    (reading its values would wait for the device). [B,T] is checked by :func:`check_shape`."""
    vocab_size = cfg.vocab_size
    if isinstance(tokens, jax.Array):
        if not tokens.is_fully_addressable:
            raise ValueError("tokens must be fully addressable")
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be integer ids [B, T], got {tokens.dtype} {tokens.shape}")
        check_shape(tokens.shape, cfg, num_microbatches, devices_per_rank)
        return tokens.astype(jnp.int32)
    arr = np.asarray(tokens)
    if arr.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {arr.dtype}")
    check_shape(arr.shape, cfg, num_microbatches, devices_per_rank)
    if arr.min() < 0 or arr.max() >= vocab_size:
        bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
        raise ValueError(f"tokens hold id {bad}, outside [0, vocab_size={vocab_size})")
    return arr.astype(np.int32)


def check_shape(batch_shape, cfg: ModelConfig, num_microbatches: int, devices_per_rank: int) -> None:
    """A batch [B,T] must split into the micro-batches and over a rank's devices."""
    B, T = (int(v) for v in batch_shape)
    m = num_microbatches
    if B < m or B % m:
        raise ValueError(f"batch of {B} sequences does not split into the schedule's {m} micro-batches")
    if (B // m) % devices_per_rank:
        raise ValueError(f"micro-batch of {B // m} sequences does not split over the "
                         f"{devices_per_rank} devices of a rank (data-parallel attention)")
    if T < 2:
        raise ValueError(f"next-token loss needs sequences of at least 2 tokens, got T={T}")
    if T > cfg.max_position_embeddings:
        raise ValueError(f"T={T} exceeds max_position_embeddings={cfg.max_position_embeddings}")


def check_param_layers(params, cfg: ModelConfig) -> None:
    """``params`` is the model's param dict with ``cfg``'s number of layers."""
    if not isinstance(params, dict) or "layers" not in params:
        raise ValueError("params must be the model's param dict (pdjax.init_params / load_hf)")
    if len(params["layers"]) != cfg.num_hidden_layers:
        raise ValueError(f"params hold {len(params['layers'])} layers, the config "
                         f"{cfg.num_hidden_layers}")


def param_shapes(cfg: ModelConfig):
    """The shapes of ``init_params(cfg)`` (abstract: nothing is allocated)."""
    from pdjax.model.transformer import init_params

    return jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))


def check_param_shapes(params, shapes) -> None:
    """``params`` has the structure and the leaf shapes of ``shapes`` (:func:`param_shapes`)."""
    want, got = jax.tree.structure(shapes), jax.tree.structure(params)
    if want != got:
        raise ValueError(f"params do not have the model's structure: expected {want}, got {got}")
    for path, a, b in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree.leaves(params), jax.tree.leaves(shapes)):
        if tuple(np.shape(a)) != tuple(b.shape):
            raise ValueError(f"param {jax.tree_util.keystr(path[0])} has shape {np.shape(a)}, "
                             f"the config gives {b.shape}")
