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

    def run(self, req, push, on_layer_done=None):
        """Prefill ``req``; call ``push(layer, rows)`` with each layer's latent rows [T, C+R]
        right after that layer is dispatched. Returns the first generated token (int)."""
        T = len(req.prompt)
        Tb = bucket(T, self.size)
        tokens = np.zeros((1, Tb), np.int32)
        tokens[0, :T] = req.prompt
        tokens = jax.device_put(tokens, self.replicated)
        q_pos = jax.device_put(np.arange(Tb, dtype=np.int32)[None], self.replicated)
        x = _embed(self.params, tokens)
        for l, lp in enumerate(self.params["layers"]):
            x, kv = _layer(lp, self.cfg, x, q_pos, self.ep)
            push(l, kv[0, :T])
            if on_layer_done is not None:
                on_layer_done(l, x)
        s = req.sampling
        tok = _first_token(self.params, self.cfg, x, T - 1, jnp.float32([s.temperature]),
                           jnp.float32([s.top_p]), jnp.int32([s.seed]))
        return int(np.asarray(tok)[0])
