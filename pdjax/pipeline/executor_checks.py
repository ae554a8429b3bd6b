"""The checks of :class:`pdjax.pipeline.Executor`'s inputs, made before any compute: the
schedule, model and devices it is built for, a token batch, and a param tree. The checks a
token batch and a param tree share with the model's entry points are the model's
(:mod:`pdjax.model.checks`); the pipeline adds only its own (micro-batches, ranks, per-layer
params)."""

from __future__ import annotations

import jax

from pdjax.model_config import ModelConfig
from pdjax.model import checks, layer_scan
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
    checks.check_cfg(cfg)


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
    """A token batch [B,T]: the model's token checks (:func:`pdjax.model.checks.check_tokens`:
    a host array fully, shape, dtype and ids in ``[0, vocab_size)``, returned as int32 numpy;
    a jax.Array by shape and dtype only, as reading its values would wait for the device),
    then the pipeline's: a jax.Array must be fully addressable (its micro-batches are sliced
    on this host), and [B,T] must split (:func:`check_shape`)."""
    if isinstance(tokens, jax.Array) and not tokens.is_fully_addressable:
        raise ValueError("tokens must be fully addressable")
    tokens = checks.check_tokens(cfg, tokens, 2, host=True)
    check_shape(tokens.shape, cfg, num_microbatches, devices_per_rank)
    return tokens


def check_shape(batch_shape, cfg: ModelConfig, num_microbatches: int, devices_per_rank: int,
                mtp_weight: float = 0.0) -> None:
    """A batch [B,T] must split into the micro-batches and over a rank's devices."""
    B, T = (int(v) for v in batch_shape)
    m = num_microbatches
    if B < m or B % m:
        raise ValueError(f"batch of {B} sequences does not split into the schedule's {m} micro-batches")
    if (B // m) % devices_per_rank:
        raise ValueError(f"micro-batch of {B // m} sequences does not split over the "
                         f"{devices_per_rank} devices of a rank (data-parallel attention)")
    need = 2 + (cfg.num_nextn_predict_layers if mtp_weight else 0)
    if T < need:
        raise ValueError(f"next-token loss needs sequences of at least {need} tokens"
                         f"{' (num_nextn_predict_layers + 2 with mtp_weight)' if mtp_weight else ''}, got T={T}")
    if T > cfg.max_position_embeddings:
        raise ValueError(f"T={T} exceeds max_position_embeddings={cfg.max_position_embeddings}")


def check_params(params, cfg: ModelConfig) -> None:
    """The model's params of ``cfg`` (:func:`pdjax.model.checks.check_params`: structure,
    shapes, floating dtypes), per layer as ``init_params`` makes them: the executor splits
    ``params['layers']`` over its stages, so stacked layer runs and an EPLB placement's
    tables are refused."""
    if layer_scan.is_stacked(params):
        raise ValueError("the executor splits params['layers'] over its stages: stacked params "
                         "(pdjax.stack_layers) need pdjax.unstack_layers first")
    checks.check_params(params, cfg)
    for i, layer in enumerate(params["layers"]):
        if set(checks.EPLB_KEYS) & set(layer.get("moe", ())):
            raise ValueError(f"params['layers'][{i}]['moe'] holds an EPLB placement's tables "
                             f"{checks.EPLB_KEYS}: the executor runs the logical experts of init_params")
