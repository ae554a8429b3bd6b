"""Logical axes of the params, declared where each weight is made, and their shardings on a
mesh under rules the caller gives.

Every init function makes its weights with :func:`declare` (``declare(value, ("embed",
"vocab"))``), so a weight's logical axis names sit next to its shape and initializer, as in
jax-llm-examples' deepseek_r1_jax. :func:`split` turns such a tree into the params and a
like-shaped tree of axes tuples, and raises naming any weight made without a declaration.
:func:`pdjax.model.params.param_axes` is that tree for a config.

The model never decides mesh axes: :func:`shardings` maps the axes through any object with
``spec(*logical) -> PartitionSpec`` and ``check(mesh)`` (:class:`AxisRules`;
:class:`pdjax.parallel.ShardingRules` is one). Without rules, ``init_params(mesh=)`` and
``load_hf(mesh=)`` use :class:`ExpertRules`, the params' part of
``ShardingRules.default(mesh)``.
"""

from __future__ import annotations

import math
from typing import Mapping, Protocol

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


class AxisRules(Protocol):
    """Logical axes -> mesh axes, as the model uses them (:class:`pdjax.parallel.ShardingRules`)."""

    def spec(self, *logical) -> P:
        """The PartitionSpec of an array whose dims carry these logical names (None: whole)."""

    def check(self, mesh: Mesh) -> None:
        """Raise ValueError when the rules do not fit ``mesh``."""


class ExpertRules:
    """The params' placement for a mesh given without rules: the routed experts over the
    mesh's ``expert`` axis (when it has one), every other dim whole; the placement
    ``pdjax.parallel.ShardingRules.default(mesh)`` gives the params."""

    def __init__(self, mesh: Mesh, expert_axis: str = "expert"):
        self.expert_axis = expert_axis if expert_axis in mesh.axis_names else None

    def spec(self, *logical) -> P:
        return P(*(self.expert_axis if name == "experts" else None for name in logical))

    def check(self, mesh: Mesh) -> None:
        pass


def _check_divides(name: str, shape, axes, spec, mesh: Mesh) -> None:
    for dim, logical, entry in zip(shape, axes, spec):
        mesh_axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        n = math.prod(mesh.shape[a] for a in mesh_axes)
        if dim % n:
            what = "(physical) experts" if logical == "experts" else f"{logical!r} entries"
            over = "expert" if logical == "experts" else repr(logical)
            raise ValueError(f"{dim} {what} of {name} do not divide over the {over} axes {mesh_axes} of size {n}")


def shardings(params, axes, mesh: Mesh, rules: AxisRules):
    """The NamedSharding of every leaf of ``params`` (arrays or jax.ShapeDtypeStruct: only
    shapes are read) whose logical axes are ``axes`` (a tree like it), by ``rules``. Raises
    ValueError, naming the weight, when a sharded dim does not divide over its mesh axes."""
    rules.check(mesh)

    def place(path, ax, leaf):
        spec = rules.spec(*ax)
        _check_divides(path_name(path), leaf.shape, ax, spec, mesh)
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(place, axes, params, is_leaf=_is_axes)
