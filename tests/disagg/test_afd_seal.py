"""The AF exchange's seal (pdjax.disagg.afd_ffn.seal / unseal) covers every element of every
leaf of every piece on every rank: a bit flipped on the wire in the last or a middle row, in a
leaf other than the first (routing weights, expert ids, the valid mask), in a piece array
other than the first, on a rank other than the first, is refused by the receiving side (its
slice counted corrupt and zeroed), and only that slice. (The engine-level fault tests flip
element 0 of leaf 0 on rank 0, which a seal of only the first row or leaf passes too.)

2 attention ranks and 4 FFN ranks: lcm 4 pieces of 4 rows; the attention side holds them as
2 piece arrays, the FFN side as 1."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pdjax.disagg import afd_ffn
from pdjax.disagg.afd_ffn import MeshExchange
from pdjax.parallel.mesh import make_mesh

from afd_faults import flip_in_rank

R, D, K = 16, 6, 2

# jitted as the engines run them (inside their step programs): called eagerly, each shard_map
# runs op by op, about 300 small compiles a case
seal = jax.jit(afd_ffn.seal, static_argnums=1)
unseal = jax.jit(afd_ffn.unseal, static_argnums=1)
split_local = jax.jit(afd_ffn.split_local, static_argnums=(1, 2))


@pytest.fixture(scope="module")
def exchange():
    return MeshExchange(make_mesh({"expert": 2}, jax.devices()[:2]), make_mesh({"expert": 4}, jax.devices()[2:6]))


def _sealed_and_moved(exchange, direction):
    """A micro-batch (hidden [R,D], weights [R,k], ids [R,k], valid [R]) sealed on the sending
    side and moved: (the moved sealed piece arrays, the receiving mesh)."""
    src, dst = ((exchange.attention_mesh, exchange.ffn_mesh) if direction == "a2f"
                else (exchange.ffn_mesh, exchange.attention_mesh))
    rng = np.random.default_rng(0)
    tree = (rng.standard_normal((R, D)).astype(np.float32), rng.random((R, K)).astype(np.float32),
            rng.integers(0, 8, (R, K)).astype(np.int32), rng.random(R) < 0.7)
    tree = jax.device_put(tree, NamedSharding(src, P(tuple(src.axis_names))))
    sealed = seal(split_local(tree, exchange.parts(src), src), src)
    moved, _ = exchange.to_ffn(sealed) if direction == "a2f" else exchange.to_attention(sealed)
    return moved, dst


# (direction, piece array, leaf, rank, row in the rank's slice (-1: the last), column)
CASES = [("a2f", 0, 0, 3, -1, 3),      # the hidden states' last row, a middle element, FFN rank 3
         ("a2f", 0, 1, 2, 1, 1),       # the routing weights, a middle row, rank 2
         ("a2f", 0, 2, 1, -1, 1),      # the expert ids' last row, rank 1
         ("a2f", 0, 3, 3, -1, 0),      # the valid mask's last row, rank 3
         ("f2a", 1, 0, 1, 2, 4),       # the second piece array, a middle row, attention rank 1
         ("f2a", 1, 1, 1, -1, 1),      # the second piece array's weights, last row, rank 1
         ("f2a", 0, 2, 1, -1, 0)]      # the first piece array's ids, last row, rank 1


@pytest.mark.parametrize("direction, piece, leaf, rank, row, col", CASES)
def test_the_seal_refuses_a_flip_anywhere(exchange, direction, piece, leaf, rank, row, col):
    moved, dst = _sealed_and_moved(exchange, direction)
    clean, bad = unseal(moved, dst)
    assert all(not np.asarray(b).any() for b in bad)                  # what was sent arrives whole
    spoiled = list(moved)
    tree, sums = spoiled[piece]
    leaves, treedef = jax.tree.flatten(tree)
    leaves[leaf] = flip_in_rank(leaves[leaf], rank, row, col, bit=30 if leaf < 2 else 3)
    spoiled[piece] = (jax.tree.unflatten(treedef, leaves), sums)
    got, bad = unseal(tuple(spoiled), dst)
    want = np.zeros((len(moved), dst.devices.size), np.int32)
    want[piece, rank] = 1
    np.testing.assert_array_equal(np.stack([np.asarray(b) for b in bad]), want)
    for j, (g, c) in enumerate(zip(got, clean)):                    # only the corrupt slice is zeroed
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(c)):
            a, b = np.asarray(a), np.array(b)
            if j == piece:
                per = a.shape[0] // dst.devices.size
                b[rank * per:(rank + 1) * per] = 0
            np.testing.assert_array_equal(a, b)
