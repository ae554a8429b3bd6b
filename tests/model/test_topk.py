"""pdjax.model.topk.top_k is jax.lax.top_k exactly (values bitwise, indices), for random
floats, ties, every non-finite value and signed zeros, integers, any k from 0 to n; and it
compiles to a program XLA:CPU can serialize (so a MoE stage relocates, tests/pipeline/test_cold_start.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.model.topk import top_k

SPECIAL = np.array([-np.inf, np.inf, np.nan, -np.nan, 0.0, -0.0, 1.0, -1.0], np.float32)


def _cases():
    rng = np.random.default_rng(0)
    out = []
    for trial in range(40):
        n = int(rng.integers(1, 20))
        shape = (int(rng.integers(1, 4)), n)
        kind = trial % 4
        if kind == 0:
            x = rng.standard_normal(shape).astype(np.float32)
        elif kind == 1:
            x = rng.integers(-2, 2, shape).astype(np.float32)          # many ties
        elif kind == 2:
            x = rng.choice(SPECIAL, shape)
        else:
            x = rng.integers(-3, 3, shape).astype(np.int32)
        out.append((x, int(rng.integers(0, n + 1))))
    return out


_both = jax.jit(lambda xs, ks: [(jax.lax.top_k(x, k), top_k(x, k)) for x, k in zip(xs, ks)], static_argnums=1)


def test_top_k_is_lax_top_k_exactly():
    cases = _cases()
    got = _both([jnp.asarray(x) for x, _ in cases], tuple(k for _, k in cases))
    for (x, k), ((va, ia), (vb, ib)) in zip(cases, got):
        va, vb = np.asarray(va), np.asarray(vb)
        assert np.array_equal(np.asarray(ia), np.asarray(ib)), (x, k)
        assert va.dtype == vb.dtype and va.tobytes() == vb.tobytes(), (x, k)    # bitwise: NaN, -0.0


class TopKJittedAndNot(chex.TestCase):
    """The same exactness through both paths a user can take: top_k called eagerly (op by op)
    and under jit (one XLA program), against jax.lax.top_k taken the same way."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_top_k_is_lax_top_k_exactly(self):
        ours = self.variant(top_k, static_argnums=1)
        theirs = self.variant(jax.lax.top_k, static_argnums=1)
        for x, k in _cases()[:16]:
            (vb, ib), (va, ia) = ours(jnp.asarray(x), k), theirs(jnp.asarray(x), k)
            chex.assert_trees_all_equal(ib, ia, strict=True)
            assert np.asarray(va).tobytes() == np.asarray(vb).tobytes(), (x, k)    # bitwise: NaN, -0.0


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="k=5 outside 0..4"):
        top_k(jnp.zeros((2, 4)), 5)
