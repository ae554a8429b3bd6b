"""Meshes, and params and batches placed on them by the logical-axis sharding rules.

A mesh is built from a dict of axis sizes (names are the caller's). Params and activations
name *logical* axes ("experts", "batch", ...; every weight's are declared where the model
makes it); :class:`~pdjax.model.sharding.ShardingRules` maps each logical axis to mesh axes
and is declared, with its default (DeepSeek's serving layout: routed experts over the
"expert" axis, attention and dense weights replicated, the batch over every axis for DP
attention), in :mod:`pdjax.model.sharding`; the params' shardings are
:func:`pdjax.model.params.param_shardings`. Both are on ``pdjax.parallel``'s face.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from pdjax.model_config import ModelConfig
from pdjax.model.params import param_shardings
from pdjax.model.sharding import ShardingRules


def make_mesh(axes: Mapping[str, int], devices: Sequence | None = None) -> Mesh:
    """A mesh with the given axis sizes over ``devices`` (default: all), in order.

    ``devices`` may be a subset, so two meshes can live on disjoint devices (PD pools).
    Axes are GSPMD-style (AxisType.Auto).
    """
    if not isinstance(axes, Mapping) or not axes:
        raise ValueError(f"mesh axes must be a non-empty dict of name -> size, got {axes!r}")
    for name, size in axes.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"mesh axis names must be non-empty strings, got {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"mesh axis {name!r} must have a positive integer size, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(axes.values())
    if len(devices) != need:
        raise ValueError(f"mesh {dict(axes)} needs {need} devices, got {len(devices)}")
    if len(set(d.id for d in devices)) != len(devices):
        raise ValueError("mesh devices must be distinct")
    grid = np.array(devices, dtype=object).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def shard_params(params, cfg: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None):
    """Place params on the mesh by the rules (:func:`param_shardings`)."""
    return jax.device_put(params, param_shardings(params, cfg, mesh, rules))


def batch_sharding(mesh: Mesh, rules: ShardingRules | None = None, ndim: int = 2) -> NamedSharding:
    """Sharding of a batch-major array of ``ndim`` dims: the batch split over the rules'
    batch axes (data-parallel attention), the other dims whole."""
    rules = rules or ShardingRules.default(mesh)
    return NamedSharding(mesh, rules.spec("batch", *([None] * (ndim - 1))))


def check_batch(mesh: Mesh, batch: int, rules: ShardingRules | None = None) -> None:
    """Raise ValueError (before any compute) when ``batch`` sequences do not split evenly
    over the mesh's batch axes."""
    rules = rules or ShardingRules.default(mesh)
    n = rules.size(mesh, "batch")
    if batch % n:
        raise ValueError(f"batch {batch} does not divide over the batch axes {rules.axes('batch')} "
                         f"(size {n}): DP attention gives every device batch/{n} sequences")
