"""Expert parallelism: route locally, all-to-all tokens to the ranks that hold their experts,
run the local experts, all-to-all the results back, combine with the routing weights.

Einsum legend: n local tokens, k experts per token, A = n*k assignments, X ranks on the
expert axis, C capacity (rows per destination rank), D hidden.

Inside ``jax.shard_map`` every device holds n tokens (the batch is split over all mesh
axes: DP attention) and P/X physical experts (split over the expert axis). Buffers are
capacity-padded ([X, C, D], works on XLA:CPU). ``capacity_factor=None`` sizes C for the
worst case (every assignment to one rank), so nothing can drop and the result equals the
single-device model; a finite factor sets C = ceil(cf * A / X) and any assignment past C is
dropped *and counted*: ``ep_moe`` returns the count and records it with
``moe.record_stat``, so the model's jitted functions return it per layer.

Redundant experts (EPLB): :func:`place_experts` turns logical expert weights into physical
slots ``w[phy2log]`` and stores the inverse map in the layer's params; tokens of a replicated
expert are split across its replicas round-robin by assignment index.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from pdjax.model_config import ModelConfig
from pdjax.model import moe as moe_lib
from pdjax.parallel import ep_ragged

DISPATCH_IMPLS = ("auto", "padded", "ragged", "ragged-emulated")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How MoE layers run on a mesh; a static (hashable) argument of the jitted model.

    expert_axis: mesh axis the experts are split over; batch_axes: mesh axes the tokens
    are split over (default: all axes, DP attention); capacity_factor: None = dropless;
    impl: local expert back end of the padded path (see :mod:`pdjax.model.moe`; None: the
    backend's default, "bucketed" on CPU);
    dispatch: "auto" (the dropless ragged_all_to_all + ragged_dot path of
    :mod:`pdjax.parallel.ep_ragged` on GPU/TPU when capacity_factor is None, else the
    capacity-padded all_to_all), "padded", "ragged", or "ragged-emulated" (the ragged path
    with an all_gather twin of the collective, for backends without it, e.g. XLA:CPU);
    target_platform: the backend the computation is lowered for, when not the mesh devices'
    (e.g. "cuda" to ``jax.export`` for a GPU from a CPU host).
    """

    mesh: Mesh
    expert_axis: str = "expert"
    batch_axes: tuple[str, ...] | None = None
    capacity_factor: float | None = None
    impl: str | None = None
    dispatch: str = "auto"
    target_platform: str | None = None

    @property
    def may_drop(self) -> bool:
        return self.capacity_factor is not None

    def __post_init__(self):
        names = tuple(self.mesh.axis_names)
        if self.expert_axis not in names:
            raise ValueError(f"expert_axis {self.expert_axis!r} is not a mesh axis {names}")
        if self.batch_axes is None:
            object.__setattr__(self, "batch_axes", names)
        for a in self.batch_axes:
            if a not in names:
                raise ValueError(f"batch axis {a!r} is not a mesh axis {names}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")
        if self.dispatch not in DISPATCH_IMPLS:
            raise ValueError(f"unknown dispatch {self.dispatch!r}; use one of {DISPATCH_IMPLS}")
        if self.dispatch.startswith("ragged") and self.capacity_factor is not None:
            raise ValueError(f"dispatch={self.dispatch!r} is dropless; capacity_factor must be None, "
                             f"got {self.capacity_factor}")
        if self.dispatch == "ragged" and self.platform not in ep_ragged.RAGGED_PLATFORMS:
            raise ValueError(f"dispatch='ragged' needs ragged_all_to_all, which XLA:{self.platform.upper()} "
                             f"does not implement; use 'padded' (or 'ragged-emulated' to validate)")

    @property
    def platform(self) -> str:
        return self.target_platform or self.mesh.devices.flat[0].platform

    @property
    def dispatch_impl(self) -> str:
        """The dispatch that runs: "auto" is the dropless ragged path on GPU/TPU meshes when no
        capacity factor is set, the capacity-padded all_to_all otherwise."""
        if self.dispatch != "auto":
            return self.dispatch
        if self.capacity_factor is None and self.platform in ep_ragged.RAGGED_PLATFORMS:
            return "ragged"
        return "padded"

    @property
    def ep_size(self) -> int:
        return self.mesh.shape[self.expert_axis]

    @property
    def batch_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def capacity(self, assignments: int) -> int:
        if self.capacity_factor is None:
            return assignments
        return max(1, math.ceil(self.capacity_factor * assignments / self.ep_size))

    def __call__(self, p, cfg: ModelConfig, x_ND, valid_N=None):
        y, dropped = ep_moe(p, cfg, x_ND, self, valid_N)
        moe_lib.record_stat(dropped)
        if cfg.n_shared_experts:   # data-parallel: x is batch-sharded, the weights replicated
            y = y + moe_lib.shared_experts(p, cfg, x_ND)
        return y


def _physical_ids(idx_nk, p, ep: ExpertParallel):
    """Logical expert ids -> physical slots; replicas taken round-robin by assignment index."""
    if "log2phy" not in p:
        return idx_nk
    log2phy, logcnt = p["log2phy"], p["logcnt"]
    a = jnp.arange(idx_nk.size, dtype=jnp.int32).reshape(idx_nk.shape)
    replica = a % logcnt[idx_nk]
    return log2phy[idx_nk, replica]


@dataclasses.dataclass(frozen=True)
class _Plan:
    X: int          # ranks on the expert axis
    E_loc: int      # physical experts per rank
    n: int          # tokens per device
    k: int
    C: int          # capacity: rows per destination rank

    @property
    def A(self) -> int:
        return self.n * self.k


def _plan(p, cfg: ModelConfig, num_tokens: int, ep: ExpertParallel) -> _Plan:
    X, axis = ep.ep_size, ep.expert_axis
    num_phys = p["w_gate"].shape[0]
    if num_phys % X:
        raise ValueError(f"{num_phys} physical experts do not divide over expert axis {axis!r} of size {X}")
    if num_tokens % ep.batch_size:
        raise ValueError(f"{num_tokens} tokens do not divide over batch axes {ep.batch_axes} "
                         f"(size {ep.batch_size})")
    n, k = num_tokens // ep.batch_size, cfg.num_experts_per_tok
    return _Plan(X=X, E_loc=num_phys // X, n=n, k=k, C=ep.capacity(n * k))


def _specs(ep: ExpertParallel):
    if set(ep.batch_axes) != set(ep.mesh.axis_names):
        raise ValueError(f"expert parallelism needs the batch split over every mesh axis "
                         f"{tuple(ep.mesh.axis_names)} (DP attention), got {ep.batch_axes}")
    return P(ep.batch_axes if len(ep.batch_axes) > 1 else ep.batch_axes[0])


def ep_dispatch(p, cfg: ModelConfig, x_ND, ep: ExpertParallel, valid_N=None, routing=None):
    """Stage 1: route locally and send each assignment to its expert's rank.

    Returns (state, dropped): the in-flight state (arrays split over all devices, opaque to
    callers: pass it to :func:`ep_compute` and :func:`ep_combine`) and the dropped count
    (summed over the mesh; always 0 when dropless). ``valid_N``: False for padding tokens
    (routed round-robin with weight 0, not counted as dropped). ``routing``: (weights [N,k],
    logical expert ids [N,k]) already computed by :func:`pdjax.model.moe.route` elsewhere
    (AF disaggregation routes on the attention side), or None: route here, on each rank."""
    pl, batch = _plan(p, cfg, x_ND.shape[0], ep), _specs(ep)
    route = {key: p[key] for key in ("router", "router_bias", "log2phy", "logcnt") if key in p}
    valid = jnp.ones(x_ND.shape[0], bool) if valid_N is None else valid_N
    routing = () if routing is None else tuple(routing)
    specs = (batch, batch, jax.tree.map(lambda _: P(), route), (batch,) * len(routing))
    if ep.dispatch_impl != "padded":
        return ep_ragged.dispatch(cfg, (x_ND, valid, route, routing), specs, ep, pl, _physical_ids)
    X, C, A, axis = pl.X, pl.C, pl.A, ep.expert_axis

    def local(x, valid, route, routing):
        D = x.shape[1]
        weights, idx = routing or moe_lib.route(route, cfg, x, valid)
        phys = _physical_ids(idx, route, ep).reshape(A)
        dest, loc = phys // pl.E_loc, phys % pl.E_loc
        real = jnp.repeat(valid, pl.k)
        queue = jnp.where(real, dest, X)                  # padding queues nowhere: never sent
        order = jnp.argsort(queue, stable=True)
        counts = jnp.bincount(queue, length=X + 1)
        starts = jnp.cumsum(counts) - counts
        pos = jnp.zeros((A,), jnp.int32).at[order].set(
            jnp.arange(A, dtype=jnp.int32) - starts[queue[order]].astype(jnp.int32))
        keep = real & (pos < C)                           # capacity goes to real tokens only
        slot = jnp.where(keep, dest * C + pos, X * C).astype(jnp.int32)   # X*C: not sent
        token = jnp.arange(A) // pl.k
        send_x = jnp.zeros((X * C, D), x.dtype).at[slot].set(x[token], mode="drop")
        send_e = jnp.full((X * C,), -1, jnp.int32).at[slot].set(loc, mode="drop")
        recv_x = jax.lax.all_to_all(send_x.reshape(X, C, D), axis, 0, 0).reshape(X * C, D)
        recv_e = jax.lax.all_to_all(send_e.reshape(X, C), axis, 0, 0).reshape(X * C)
        lost = (~keep & real).sum(dtype=jnp.int32)
        dropped = jax.lax.psum(lost, tuple(ep.mesh.axis_names))
        return (recv_x, recv_e, slot, weights * keep.reshape(pl.n, pl.k)), dropped

    return jax.shard_map(local, mesh=ep.mesh, in_specs=specs, out_specs=((batch,) * 4, P()),
                         check_vma=False)(x_ND, valid, route, routing)


def ep_compute(p, state, ep: ExpertParallel):
    """Stage 2: each rank runs its local experts over the rows it received (no communication)."""
    batch = _specs(ep)
    if ep.dispatch_impl != "padded":
        return ep_ragged.compute(p, state, ep, batch)
    experts = {key: p[key] for key in ("w_gate", "w_up", "w_down")}
    recv_x, recv_e, _, weights = state
    expected = weights.size // ep.batch_size          # n*k: what a rank receives on average

    def local(experts, rows, ids):
        # the receive buffer holds X*C rows, ~n*k of them real; empty slots (id -1) cost nothing
        # in the bucketed back end, which sizes its buckets by the expected rows
        return moe_lib.experts_for_rows(experts, rows, ids, expected, ep.impl)

    return jax.shard_map(local, mesh=ep.mesh, in_specs=({k: P(ep.expert_axis) for k in experts}, batch, batch),
                         out_specs=batch, check_vma=False)(experts, recv_x, recv_e)


def ep_combine(y_rows, state, ep: ExpertParallel, dtype):
    """Stage 3: send the results back and sum each token's k results by weight."""
    batch, X, axis = _specs(ep), ep.ep_size, ep.expert_axis
    if ep.dispatch_impl != "padded":
        return ep_ragged.combine(y_rows, state, ep, batch, dtype)
    slot, weights = state[2:]

    def local(rows, slot, w):
        n, k = w.shape
        D = rows.shape[1]
        back = jax.lax.all_to_all(rows.reshape(X, -1, D), axis, 0, 0).reshape(-1, D)
        y_assign = jnp.take(back, slot, axis=0, mode="fill", fill_value=0).reshape(n, k, D)
        return jnp.einsum("nkD,nk->nD", y_assign.astype(jnp.float32), w).astype(dtype)

    return jax.shard_map(local, mesh=ep.mesh, in_specs=(batch, batch, batch), out_specs=batch,
                         check_vma=False)(y_rows, slot, weights)


def ep_moe(p, cfg: ModelConfig, x_ND, ep: ExpertParallel, valid_N=None, routing=None):
    """Routed experts, expert-parallel: dispatch, compute, combine (``routing``: see
    :func:`ep_dispatch`). Returns (y [N,D], dropped assignments over the mesh, int32)."""
    state, dropped = ep_dispatch(p, cfg, x_ND, ep, valid_N, routing)
    y_rows = ep_compute(p, state, ep)
    return ep_combine(y_rows, state, ep, x_ND.dtype), dropped


def place_experts(params, phy2log) -> dict:
    """Params with routed experts laid out in physical slots: ``w[l] = w_logical[phy2log[l]]``
    for each MoE layer (phy2log [moe_layers, P], from EPLB), plus the inverse map
    ``log2phy`` [E, max_replicas] / ``logcnt`` [E] in each MoE layer's params (their logical
    axes: :data:`pdjax.model.params.PLACEMENT_AXES`)."""
    phy2log = np.asarray(phy2log)
    moe_layers = [i for i, lp in enumerate(params["layers"]) if "moe" in lp]
    if phy2log.ndim != 2 or phy2log.shape[0] != len(moe_layers):
        raise ValueError(f"phy2log must be [moe_layers={len(moe_layers)}, physical], got {phy2log.shape}")
    layers = list(params["layers"])
    for row, i in zip(phy2log, moe_layers):
        m = dict(layers[i]["moe"])
        E = m["w_gate"].shape[0]
        if row.min() < 0 or row.max() >= E or len(set(row.tolist())) != E:
            raise ValueError(f"phy2log for layer {i} must map onto every one of {E} logical experts")
        cnt = np.bincount(row, minlength=E)
        log2phy = np.full((E, cnt.max()), -1, np.int32)
        fill = np.zeros(E, np.int64)
        for phys, e in enumerate(row):
            log2phy[e, fill[e]] = phys
            fill[e] += 1
        for key in ("w_gate", "w_up", "w_down"):
            m[key] = m[key][jnp.asarray(row)]
        m["log2phy"], m["logcnt"] = jnp.asarray(log2phy), jnp.asarray(cnt.astype(np.int32))
        layers[i] = {**layers[i], "moe": m}
    return {**params, "layers": layers}
