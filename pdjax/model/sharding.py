"""Logical axes of the params, declared where each weight is made, and the rules that map
them (and the activations' "batch") onto a mesh's axes: the one place the logical-axis ->
mesh-axis rules are declared.

Every init function makes its weights with :func:`declare` (``declare(value, ("embed",
"vocab"))``), so a weight's logical axis names sit next to its shape and initializer, as in
jax-llm-examples' deepseek_r1_jax. :func:`split` turns such a tree into the params and a
like-shaped tree of axes tuples, and raises naming any weight made without a declaration.
:func:`pdjax.model.params.param_axes` is that tree for a config.

:class:`ShardingRules` maps each logical axis to mesh axes (``ShardingRules.default(mesh)``:
DeepSeek's serving layout); :func:`shardings` places a tree by them. The model takes the
rules as data and never imports :mod:`pdjax.parallel`, which re-exports them
(``pdjax.parallel.ShardingRules``) for its meshes, batches and expert parallelism.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

#: every logical axis name: the params' dims (and the activations' "batch")
LOGICAL_AXES = ("batch", "experts", "vocab", "embed", "heads", "mlp", "latent", "q_lora")


@jax.tree_util.register_pytree_node_class
class Declared:
    """A weight with its logical axes (one name or None per dim): the value is the pytree
    child, the axes static, so a tree of them passes through ``jax.eval_shape`` and jit."""

    def __init__(self, value, axes: tuple):
        self.value, self.axes = value, axes

    def tree_flatten(self):
        return (self.value,), self.axes

    @classmethod
    def tree_unflatten(cls, axes, children):
        return cls(children[0], axes)


def declare(value, axes) -> Declared:
    """``value`` (an array, or anything with a ``shape``) with logical ``axes``, one name of
    :data:`LOGICAL_AXES` or None (never sharded) per dim."""
    axes = tuple(axes)
    for name in axes:
        if name is not None and name not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {name!r}; known: {LOGICAL_AXES}")
    if len(axes) != len(value.shape):
        raise ValueError(f"logical axes {axes} for a weight of shape {tuple(value.shape)}")
    return Declared(value, axes)


def _is_declared(x) -> bool:
    return isinstance(x, Declared)


def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def path_name(path) -> str:
    """A pytree path as ``layers/1/moe/w_gate``."""
    return "/".join(_key(k) for k in path)


def _pattern(path) -> str:
    """A path with every list index a wildcard: ``layers/*/moe/w_gate``."""
    return "/".join("*" if isinstance(k, jax.tree_util.SequenceKey) else _key(k) for k in path)


def split(tree):
    """(values, axes) of a tree of :class:`Declared` weights, two trees like it. Raises
    ValueError naming a weight that was made without :func:`declare`."""
    def check(path, x):
        if not _is_declared(x):
            raise ValueError(f"param {path_name(path)} has no logical-axis declaration: make it with "
                             "pdjax.model.sharding.declare(value, axes) where it is initialised")
    jax.tree_util.tree_map_with_path(check, tree, is_leaf=_is_declared)
    return (jax.tree.map(lambda d: d.value, tree, is_leaf=_is_declared),
            jax.tree.map(lambda d: d.axes, tree, is_leaf=_is_declared))


def values(tree):
    """The params of a tree of :class:`Declared` weights (the axes dropped)."""
    return split(tree)[0]


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def axes_like(params, declared, extra: Mapping[str, tuple] | None = None):
    """The logical axes of every leaf of ``params`` (arrays or anything with a ``shape``), as
    a tree like it, looked up by path in ``declared`` (a tree of axes tuples) with list
    indices as wildcards, so a part of the params (some layers, some weights) maps too.
    ``extra``: ``{"layers/*/moe/log2phy": axes}`` for leaves a layer above the model adds.
    Raises ValueError naming a leaf without a declaration or of another rank."""
    index = dict(extra or {})
    for path, axes in jax.tree_util.tree_flatten_with_path(declared, is_leaf=_is_axes)[0]:
        if index.setdefault(_pattern(path), axes) != axes:
            raise ValueError(f"param {path_name(path)} declares axes {axes}, another layer's "
                             f"{index[_pattern(path)]}")

    def lookup(path, leaf):
        axes = index.get(_pattern(path))
        if axes is None:
            raise ValueError(f"param {path_name(path)} has no logical-axis declaration in the model "
                             "(pdjax.model.params.param_axes)")
        if len(axes) != len(leaf.shape):
            raise ValueError(f"param {path_name(path)} has shape {tuple(leaf.shape)}, its logical axes "
                             f"{axes} name {len(axes)} dims")
        return axes
    return jax.tree_util.tree_map_with_path(lookup, params)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axes (a tuple; empty = replicated). Printable, overridable; the
    rules ``init_params``, ``load_hf``, ``pdjax.parallel.shard_params`` and the model's
    ``mesh=`` entry points take.

    ``ShardingRules.default(mesh)`` (DeepSeek's serving layout) puts "experts" on the
    "expert" axis (if the mesh has one) and "batch" on every data-like axis (all mesh axes:
    DP attention, every device attends over its own requests); every other axis is whole.
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


def _check_divides(name: str, shape, axes, spec, mesh: Mesh) -> None:
    for dim, logical, entry in zip(shape, axes, spec):
        mesh_axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        n = math.prod(mesh.shape[a] for a in mesh_axes)
        if dim % n:
            what = "(physical) experts" if logical == "experts" else f"{logical!r} entries"
            over = "expert" if logical == "experts" else repr(logical)
            raise ValueError(f"{dim} {what} of {name} do not divide over the {over} axes {mesh_axes} of size {n}")


def shardings(params, axes, mesh: Mesh, rules: ShardingRules):
    """The NamedSharding of every leaf of ``params`` (arrays or jax.ShapeDtypeStruct: only
    shapes are read) whose logical axes are ``axes`` (a tree like it), by ``rules`` (checked
    against ``mesh`` first). Raises
    ValueError, naming the weight, when a sharded dim does not divide over its mesh axes."""
    rules.check(mesh)

    def place(path, ax, leaf):
        spec = rules.spec(*ax)
        _check_divides(path_name(path), leaf.shape, ax, spec, mesh)
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(place, axes, params, is_leaf=_is_axes)
