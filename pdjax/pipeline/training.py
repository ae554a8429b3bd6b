"""Resumable optax training of the pdjax model over any pipeline schedule.

    s = pdjax.pipeline.build("dualpipe", num_ranks=4, num_microbatches=8)
    state = pdjax.pipeline.train(s, cfg, data, optimizer=optax.adamw(1e-3), steps=1000,
                                 devices=jax.devices()[:4], checkpoint_dir="/tmp/run",
                                 checkpoint_every=100)
    state.losses, state.step, state.params

Every step runs the schedule on the devices (:class:`pdjax.pipeline.Executor`, without
per-op timing), then applies the optimizer's update in one jitted program that donates the
old params and optimizer state. The loop never waits for the devices: each step's loss stays
a device array until a checkpoint is written or the run ends.

With ``checkpoint_dir`` the run is resumable: it saves the whole :class:`TrainState` with
orbax (every ``checkpoint_every`` steps and at the end), and a later call with the same
directory restores the latest checkpoint and goes on until ``steps`` steps are done in all.
A resumed run computes exactly what an uninterrupted one does (same batches, same keys).

Across processes (a ``pdjax launch``, every process calling ``train`` alike with
``devices`` spanning them): the ranks run where their devices are, the state is replicated
over one device per process (:attr:`Executor.replicated`), every process writes its part of
a checkpoint (the directory must be shared), and a checkpoint resumes with another process
count (placed like the new run's fresh state).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import numpy as np
import optax

from pdjax.arguments import check_int
from pdjax.model.loss import check_mtp_weight
from pdjax.model_config import ModelConfig
from pdjax.pipeline import executor_checks as ec
from pdjax.pipeline.executor import Executor

CHECKPOINTS_KEPT = 3
DEFAULT_OPTIMIZER = optax.adamw(1e-3)   # one object, so its jitted update compiles once


@dataclasses.dataclass(eq=False)
class TrainState:
    """Everything a training run needs to go on.

    ``params``: the model's params; ``opt_state``: the optimizer's state; ``step``: the
    steps done; ``data_position``: the batches consumed (one per step); ``rng``: a typed jax
    PRNG key, split once per step (the split-off key goes to a callable data source);
    ``losses``: the loss of every step done, as floats.
    """

    params: dict
    opt_state: Any
    step: int
    data_position: int
    rng: jax.Array
    losses: list[float] = dataclasses.field(default_factory=list)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def _apply(optimizer, params, opt_state, grads):
    """One optimizer update, applied; the old params and state are donated."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def train(schedule, cfg: ModelConfig, data, optimizer=None, steps: int = 20, *, devices=None,
          params=None, seed: int = 0, executor: Executor | None = None, layers_per_stage=None,
          checkpoint_dir: str | os.PathLike | None = None,
          checkpoint_every: int | None = None, mtp_weight: float = 0.0) -> TrainState:
    """Train the model ``cfg`` for ``steps`` steps in all, each a step of ``schedule`` (the
    schedule first, as in :class:`Executor`); returns the final :class:`TrainState`.

    ``data``: an array [N, B, T] of token batches, consumed in order (batch ``i`` at step
    ``i``; N must cover ``steps``, it does not wrap), or a callable ``data(position, key)``
    returning the batch [B, T] at ``position`` (``key``: the step's key split off the state's
    rng). ``optimizer``: an optax GradientTransformation (default ``optax.adamw(1e-3)``).
    ``params``: the initial params (copied, never modified; default
    ``pdjax.init_params(cfg, jax.random.key(seed))``); ``seed`` also seeds the rng.
    ``executor``: an Executor of ``schedule`` and ``cfg`` to reuse (then ``devices`` and
    ``layers_per_stage`` must be None); else one is built on ``devices`` (default: all) with
    ``layers_per_stage``. ``checkpoint_dir``: where to save and resume (orbax); a checkpoint
    there is restored, placed like fresh params, and a run whose checkpoint already has
    ``steps`` steps or more returns it as it is. ``checkpoint_every``: save every that many
    steps (default: only at the end). ``mtp_weight``: the loss is ``pdjax.loss(...,
    mtp_weight=)`` (DeepSeek-V3's lambda; an ``executor`` given must have the same).

    Every argument and every array batch is checked before any compute (ValueError naming
    the problem); a callable's batches are checked as they come, before their step runs.
    """
    ec.check_schedule_and_config(schedule, cfg)
    optimizer = DEFAULT_OPTIMIZER if optimizer is None else optimizer
    _check_args(steps, optimizer, checkpoint_dir, checkpoint_every)
    check_int("seed", seed, 0)
    ex = _executor(cfg, schedule, executor, devices, layers_per_stage, mtp_weight)
    _check_data(ex, data, steps)
    if params is not None:
        ex.check_params(params)
    manager = None if checkpoint_dir is None else _manager(checkpoint_dir)
    try:
        state = _initial_state(cfg, optimizer, params, seed, ex.replicated)
        if manager is not None and manager.latest_step() is not None:
            state = _restore(manager, state)
        if state.step >= steps:
            return state
        return _loop(ex, optimizer, data, state, steps, manager, checkpoint_every)
    finally:
        if manager is not None:
            manager.close()


# ---- checks ---------------------------------------------------------------------------------

def _check_args(steps, optimizer, checkpoint_dir, checkpoint_every) -> None:
    check_int("steps (the total number of steps to reach)", steps)
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ValueError(f"optimizer must be an optax GradientTransformation (e.g. optax.adamw(1e-3)), "
                         f"got {type(optimizer).__name__}")
    if checkpoint_dir is not None:
        if isinstance(checkpoint_dir, bytes) or not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise ValueError(f"checkpoint_dir must be a str or os.PathLike, got {type(checkpoint_dir).__name__} "
                             f"{checkpoint_dir!r}")
        if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
            raise ValueError(f"checkpoint_dir {os.fspath(checkpoint_dir)!r} exists and is not a directory")
    if checkpoint_every is not None:
        check_int("checkpoint_every", checkpoint_every)
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir to save into")


def _executor(cfg, schedule, executor, devices, layers_per_stage, mtp_weight=0.0) -> Executor:
    """The given executor, checked against ``cfg`` and ``schedule``, or a new one."""
    if executor is None:
        return Executor(schedule, cfg, devices, layers_per_stage=layers_per_stage, measure=False,
                        mtp_weight=mtp_weight)
    if not isinstance(executor, Executor):
        raise ValueError(f"executor must be a pdjax.pipeline.Executor, got {type(executor).__name__}")
    if devices is not None or layers_per_stage is not None:
        raise ValueError("with an executor, devices and layers_per_stage come from it: pass None")
    if executor.mtp_weight != check_mtp_weight(mtp_weight, cfg):
        raise ValueError(f"the executor's mtp_weight is {executor.mtp_weight}, train was given {mtp_weight!r}")
    if executor.measure:
        raise ValueError("the executor measures every op (a host sync per op): pass one built with "
                         "measure=False for training")
    if executor.schedule is not schedule or executor.cfg != cfg:
        raise ValueError("the executor runs another schedule or model config than the one given")
    return executor


def _check_data(ex: Executor, data, steps: int) -> None:
    """An array of batches: its shape, and every batch the run may use, checked up front."""
    if callable(data):
        return
    shape = np.shape(data)
    if len(shape) != 3:
        raise ValueError(f"data must be an array [N, B, T] of token batches or a callable "
                         f"data(position, key) -> [B, T], got shape {shape}")
    if shape[0] < steps:
        raise ValueError(f"data holds {shape[0]} batches, fewer than the {steps} steps to train "
                         f"(one batch per step; data does not wrap)")
    for i in range(steps):
        ex.check_batch(data[i])


def _batch(data, position: int, key, shape):
    """The batch at ``position``; a callable's batches must all have one shape."""
    if not callable(data):
        return data[position]
    tokens = data(position, key)
    if shape is not None and np.shape(tokens) != shape:
        raise ValueError(f"data({position}, key) returned a batch of shape {np.shape(tokens)}, "
                         f"earlier batches had {shape}")
    return tokens


# ---- state ------------------------------------------------------------------------------------

def _initial_state(cfg, optimizer, params, seed: int, where=None) -> TrainState:
    """Step 0: the params (own copies, since updates donate them), fresh optimizer state.
    ``where``: a sharding every process of a launch holds a copy on (the executor's
    :attr:`~pdjax.pipeline.Executor.replicated` when its ranks span processes): the params,
    the optimizer state and the rng go there, so the update and the checkpoints are global."""
    key = jax.random.key(seed)
    if params is None:
        from pdjax.model.transformer import init_params

        params = init_params(cfg, key)
    else:
        params = jax.tree.map(lambda a: a.copy(), params)
    rng, opt_state = jax.random.fold_in(key, 1), optimizer.init(params)
    if where is not None:      # the same values in every process: placed from the host
        params, opt_state = jax.device_put(jax.tree.map(np.asarray, (params, opt_state)), where)
        rng = jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(rng)), where),
                                       impl=jax.random.key_impl(rng))
    return TrainState(params=params, opt_state=opt_state, step=0, data_position=0, rng=rng, losses=[])


def _loop(ex, optimizer, data, state: TrainState, steps: int, manager, every) -> TrainState:
    """Steps ``state.step`` .. ``steps - 1``; losses stay on the devices until a checkpoint."""
    params, opt_state, rng = state.params, state.opt_state, state.rng
    pending, shape = [], None
    for step in range(state.step, steps):
        rng, key = jax.random.split(rng)
        tokens = _batch(data, state.data_position + len(pending), key, shape)
        shape = np.shape(tokens)
        loss, grads = ex.step(params, tokens)
        params, opt_state = _apply(optimizer, params, opt_state, grads)
        pending.append(loss)
        if step + 1 == steps or (every is not None and (step + 1) % every == 0):
            state = TrainState(params, opt_state, step + 1, state.data_position + len(pending), rng,
                               state.losses + [float(x) for x in jax.device_get(pending)])
            pending = []
            if manager is not None:
                _save(manager, state)
    return state


# ---- checkpoints ------------------------------------------------------------------------------

def _manager(checkpoint_dir):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=CHECKPOINTS_KEPT, create=True)
    return ocp.CheckpointManager(os.path.abspath(os.fspath(checkpoint_dir)), options=options)


def _save(manager, state: TrainState) -> None:
    """The arrays (the key as its raw data) with orbax, the counters and losses as JSON.
    Waits for the write to finish: the next update donates the saved params and optimizer
    state, so nothing may still be reading them."""
    import orbax.checkpoint as ocp

    arrays = {"params": state.params, "opt_state": state.opt_state,
              "rng": jax.random.key_data(state.rng)}
    meta = {"step": state.step, "data_position": state.data_position, "losses": state.losses}
    manager.save(state.step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                     meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()


def _restore(manager, fresh: TrainState) -> TrainState:
    """The latest checkpoint, placed as ``fresh`` (the state a new run would start from)."""
    import orbax.checkpoint as ocp

    like = {"params": fresh.params, "opt_state": fresh.opt_state,
            "rng": jax.random.key_data(fresh.rng)}
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), like)
    step = manager.latest_step()
    try:
        got = manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(target),
                                                            meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the checkpoint of step {step} in {manager.directory} does not match this "
                         f"model and optimizer: {exc}") from exc
    arrays, meta = got["arrays"], got["meta"]
    rng = jax.random.wrap_key_data(arrays["rng"], impl=jax.random.key_impl(fresh.rng))
    return TrainState(arrays["params"], arrays["opt_state"], int(meta["step"]),
                      int(meta["data_position"]), rng, [float(x) for x in meta["losses"]])
