"""The prefill pool: runs a prompt layer by layer on its own mesh and pushes each layer's
latent KV to the decode pool as soon as that layer is done.

A prompt of T tokens is padded to a bucket (a multiple of the mesh size, so the MoE tokens
split evenly; powers of two to bound recompiles). Attention runs replicated over the prefill
devices and the MoE layers expert-parallel (tokens split over the mesh: small EP). After
layer l the real rows ``[T, C+R]`` of its latent cache are sliced off (no padding is sent) and
handed to ``jax.device_put`` towards the decode rank that reserved the request's blocks; the
call is asynchronous, so the copy of layer l proceeds while layer l+1 computes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pdjax.config import ModelConfig
from pdjax.disagg.request import sample
from pdjax.model.transformer import embed, head, layer
from pdjax.parallel.ep import ExpertParallel
from pdjax.parallel.mesh import make_mesh, shard_params


@functools.partial(jax.jit, static_argnames=("cfg", "moe_impl"))
def _layer(lp, cfg, x, q_pos, moe_impl):
    return layer(lp, cfg, x, q_pos, moe_impl=moe_impl)


@functools.partial(jax.jit, static_argnames=("cfg", "chunk", "moe_impl"))
def _layer_cached(lp, cfg, x, q_pos, prefix_rows, start, chunk, moe_impl):
    """A layer over a chunk that continues a cached prefix [P, C+R]: the prefix rows and the
    chunk's new rows form the layer cache [1, P + chunk, C+R]."""
    kv = jnp.pad(prefix_rows, ((0, chunk), (0, 0)))[None]
    return layer(lp, cfg, x, q_pos, kv, start, moe_impl=moe_impl)


@jax.jit
def _embed(params, tokens):
    return embed(params, tokens)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _first_token(params, cfg, x, last, temperature, top_p, seed):
    logits = head(params, cfg, x[:, last])
    return sample(logits, temperature, top_p, seed, jnp.zeros_like(seed))


def bucket(n: int, multiple: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum), rounded up to a multiple of ``multiple``."""
    b = 1 << (max(n, minimum) - 1).bit_length()
    return -(-b // multiple) * multiple


class PrefillPool:
    def __init__(self, params, cfg: ModelConfig, devices, mesh_axes: dict):
        self.cfg = cfg
        self.mesh = make_mesh(mesh_axes, devices)
        self.size = math.prod(self.mesh.shape.values())
        self.ep = ExpertParallel(self.mesh) if "expert" in self.mesh.axis_names else None
        self.params = shard_params(params, cfg, self.mesh)
        self.replicated = NamedSharding(self.mesh, P())

    def run(self, req, push, prefix=None, timeline=None):
        """Prefill ``req``; call ``push(layer, rows)`` with each layer's latent rows [T, C+R]
        (the whole prompt) right after that layer is dispatched. Returns (first generated
        token, the pushed rows per layer).

        ``prefix``: (P, iterator of (layer, rows [P, C+R]) on this pool's devices) for a
        cached prefix of P tokens: only the remaining T - P tokens are computed, each layer
        attending to its prefix rows, which the iterator delivers layer by layer.
        ``timeline``: a :class:`pdjax.disagg.timeline.Timeline` to record each layer's compute."""
        T = len(req.prompt)
        P, loaded = prefix if prefix else (0, None)
        n = T - P
        Tb = bucket(n, self.size)
        tokens = np.zeros((1, Tb), np.int32)
        tokens[0, :n] = req.prompt[P:]
        tokens = jax.device_put(tokens, self.replicated)
        q_pos = jax.device_put((P + np.arange(Tb, dtype=np.int32))[None], self.replicated)
        start = jax.device_put(np.array([P], np.int32), self.replicated)
        x = _embed(self.params, tokens)
        rows = []
        for l, lp in enumerate(self.params["layers"]):
            if loaded is None:
                x, kv = _layer(lp, self.cfg, x, q_pos, self.ep)
                rows.append(kv[0, :T])
            else:
                layer_idx, prefix_rows = next(loaded)
                assert layer_idx == l, (layer_idx, l)
                x, kv = _layer_cached(lp, self.cfg, x, q_pos, prefix_rows, start, Tb, self.ep)
                rows.append(kv[0, :T])
            if timeline is not None:
                timeline.record("prefill compute", f"layer {l}", x)
            push(l, rows[-1])
        s = req.sampling
        tok = _first_token(self.params, self.cfg, x, n - 1, jnp.float32([s.temperature]),
                           jnp.float32([s.top_p]), jnp.int32([s.seed]))
        return int(np.asarray(tok)[0]), rows
