"""The AF exchange (pdjax.disagg.afd_ffn) where the engine tests do not reach: a side of one
rank (the engine tests split 4:4, 6:2 and 2:6 devices), and the bytes counted per leaf on
their own. A micro-batch moved to the other side and back is the one sent, sealed and
unsealed whole, and every byte of every leaf is counted once."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pdjax.disagg import afd_ffn
from pdjax.disagg.afd_ffn import MeshExchange
from pdjax.parallel.mesh import make_mesh

R, D, K = 12, 6, 2

# jitted as the engines run them (called eagerly, each shard_map runs op by op)
seal = jax.jit(afd_ffn.seal, static_argnums=1)
unseal = jax.jit(afd_ffn.unseal, static_argnums=1)
split_local = jax.jit(afd_ffn.split_local, static_argnums=(1, 2))
join_local = jax.jit(afd_ffn.join_local, static_argnums=1)


def _batch(mesh):
    rng = np.random.default_rng(3)
    tree = (rng.standard_normal((R, D)).astype(np.float32), rng.random((R, K)).astype(np.float32),
            rng.integers(0, 8, (R, K)).astype(np.int32), rng.random(R) < 0.7)
    return tree, jax.device_put(tree, NamedSharding(mesh, P(tuple(mesh.axis_names))))


@pytest.mark.parametrize("M, N", [(1, 2)])
def test_a_round_trip_over_any_split_returns_the_micro_batch_sealed_whole(M, N):
    """M attention ranks, N FFN ranks (the attention side a single rank): split into
    the side's piece arrays, sealed, moved to the FFN side and back, unsealed: every leaf
    equal to what was sent, no piece counted corrupt, and each move counts each leaf's bytes
    exactly once."""
    devs = jax.devices()
    ex = MeshExchange(make_mesh({"expert": M}, devs[:M]), make_mesh({"expert": N}, devs[M:M + N]))
    assert ex.pieces == np.lcm(M, N) and ex.parts(ex.attention_mesh) == ex.pieces // M
    host, tree = _batch(ex.attention_mesh)
    sent = split_local(tree, ex.parts(ex.attention_mesh), ex.attention_mesh)
    at_ffn, nbytes = ex.to_ffn(seal(sent, ex.attention_mesh))
    assert nbytes == [a.nbytes for a in host] + [ex.pieces * 4 * 2 * 4]     # the seal: 2 uint32 a leaf a piece
    assert len(at_ffn) == ex.parts(ex.ffn_mesh)
    pieces, bad = unseal(at_ffn, ex.ffn_mesh)
    assert not any(np.asarray(b).any() for b in bad)
    back, _ = ex.to_attention(seal(pieces, ex.ffn_mesh))
    pieces, bad = unseal(back, ex.attention_mesh)
    assert not any(np.asarray(b).any() for b in bad)
    for got, want in zip(join_local(pieces, ex.attention_mesh), host):
        np.testing.assert_array_equal(np.asarray(got), want)
