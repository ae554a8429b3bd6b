"""Checks of executed steps shared by the executor's tests (in one process, over rank
processes, over the processes of a launch)."""

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.schedules.ops import OverlapFB


def max_rel_err(tree, ref):
    errs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)), tree, ref)
    return max(jax.tree.leaves(errs))


def _parts(op):
    return (op.forward, op.backward) if isinstance(op, OverlapFB) else (op,)


def check_dependencies(tl):
    """On the shared clock: each rank's ops in order, and every op starts after the ops
    that produce its inputs on the other rank ended."""
    sched = tl.schedule
    end_of = {}
    for r, ops in enumerate(sched.ops):
        assert np.all(tl.starts[r][1:] >= tl.ends[r][:-1]), f"rank {r}'s ops overlap"
        for op, e in zip(ops, tl.ends[r]):
            for part in _parts(op):
                end_of[(part.kind, part.stage, part.microbatch)] = e
    layout, checked = sched.layout, 0
    for r, ops in enumerate(sched.ops):
        for op, start in zip(ops, tl.starts[r]):
            for part in _parts(op):
                prev, nxt = layout.prev_stage[part.stage], layout.next_stage[part.stage]
                if part.kind == "F" and prev >= 0:
                    key = ("F", prev, part.microbatch)
                elif part.kind in ("B", "I") and nxt >= 0:
                    key = next((k, nxt, part.microbatch) for k in ("B", "I") if (k, nxt, part.microbatch) in end_of)
                else:
                    continue
                if layout.stage_rank[key[1]] != r:
                    assert start >= end_of[key], f"{op} on rank {r} started before {key} ended"
                    checked += 1
    return checked
