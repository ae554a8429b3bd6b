"""Meshes and logical-axis sharding rules.

A mesh is built from a dict of axis sizes (names are the caller's). Params and activations
name *logical* axes ("experts", "batch", ...; every weight's are declared where the model
makes it, :mod:`pdjax.model.sharding`); :class:`ShardingRules` maps each logical axis to mesh
axes. The default rules are DeepSeek's serving layout: routed experts over the "expert" axis,
attention and dense weights replicated, and the batch over data x expert for attention (DP
attention), so every device attends over its own requests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from pdjax.config import ModelConfig
from pdjax.model import params as model_params, sharding as model_sharding
from pdjax.model.sharding import LOGICAL_AXES
from pdjax.parallel.ep import PLACEMENT_AXES


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


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axes (a tuple; empty = replicated). Printable, overridable; the
    rules ``init_params`` and ``load_hf`` take (:class:`pdjax.model.sharding.AxisRules`).

    ``ShardingRules.default(mesh)`` puts "experts" on the "expert" axis (if the mesh has
    one) and "batch" on every data-like axis (all mesh axes: DP attention).
    """

    rules: tuple[tuple[str, tuple[str, ...]], ...]

    @staticmethod
    def default(mesh: Mesh, expert_axis: str = "expert") -> "ShardingRules":
        names = tuple(mesh.axis_names)
        return ShardingRules((
            ("batch", names),
            ("experts", (expert_axis,) if expert_axis in names else ()),
        ))

    def override(self, **changes) -> "ShardingRules":
        d = dict(self.rules)
        for k, v in changes.items():
            d[k] = (v,) if isinstance(v, str) else tuple(v or ())
        return ShardingRules(tuple(d.items()))

    def axes(self, logical: str) -> tuple[str, ...]:
        return dict(self.rules).get(logical, ())

    def spec(self, *logical) -> P:
        """PartitionSpec for an array whose dims carry these logical names (None = replicated)."""
        parts = []
        for name in logical:
            axes = self.axes(name) if name else ()
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*parts)

    def check(self, mesh: Mesh) -> None:
        for logical, axes in self.rules:
            if logical not in LOGICAL_AXES:
                raise ValueError(f"sharding rules name unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
            for a in axes:
                if a not in mesh.axis_names:
                    raise ValueError(f"sharding rule {logical!r} -> {a!r}: mesh has no axis {a!r} "
                                     f"(axes: {tuple(mesh.axis_names)})")

    def size(self, mesh: Mesh, logical: str) -> int:
        return math.prod(mesh.shape[a] for a in self.axes(logical))

    def __str__(self) -> str:
        return "\n".join(f"{k:>8} -> {', '.join(v) if v else '(replicated)'}" for k, v in self.rules)


def param_logical_axes(params, cfg: ModelConfig) -> dict:
    """A pytree like params holding each leaf's logical axes (tuple of names/None), as the
    model declares them (:func:`pdjax.model.params.logical_axes`; EPLB's replica tables from
    :func:`pdjax.parallel.place_experts` whole). Raises ValueError naming a param the model
    does not declare."""
    return model_params.logical_axes(params, cfg, extra=PLACEMENT_AXES)


def param_shardings(params, cfg: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None):
    """The NamedSharding of every param by the rules applied to the model's logical axes
    (default: routed experts over the expert axis, everything else replicated), as a pytree
    like ``params`` (all of the params or a part). ``params`` may hold arrays or
    jax.ShapeDtypeStruct (only paths and shapes are read), so an init or a checkpoint load can
    be placed before any value exists. Raises ValueError naming the param when one has no
    logical-axis declaration or a sharded dim (e.g. the experts) does not divide over its
    mesh axes."""
    rules = rules or ShardingRules.default(mesh)
    return model_sharding.shardings(params, param_logical_axes(params, cfg), mesh, rules)


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
