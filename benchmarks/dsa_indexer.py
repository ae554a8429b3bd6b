"""Where the sparse-attention indexer's decode time goes on CPU: the cost of its key layout.

pdjax caches the indexer's key inside each token's latent row, ``[latent | rope | index key]``
(``cfg.kv_latent_dim`` = C + R + Di), so every cache, the paged pool, the handoff and the
prefix store carry it with no code of their own; the decode step reads it as the slice
``row[..., mla_latent_dim:]``, Di values out of a row of C + R + Di. DeepSeek's kernels keep it
in a cache of its own (FP8 key and scale, 132 B a token). This times, for
``benchmarks/dsa_decode.py``'s V3.2 (4 indexer heads of width 32, top 256, rows of
128 + 32 + 32 float32 values), per cached token of a sequence and one layer, jitted alone,
best of ``--repeats``:

* the key read: the sum of the keys, sliced from the rows (pdjax's layout) and from a
  contiguous [S, Di] array (a separate indexer cache);
* the scores ``sum_h w_h relu(q_h . k)`` as ``pdjax.model.dsa.index_scores`` computes them
  (float32), from each layout;
* ``lax.top_k`` of the scores (what ``dsa.select`` runs).

Beside them: the key's bytes at the read bandwidth the benchmark measures (a sum over 256 MiB).
Run: .venv/bin/python benchmarks/dsa_indexer.py [--lengths 4096 16384 65536] [--batch 1]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from dsa_decode import V32, _best, machine

HI, DI, K = V32.index_n_heads, V32.index_head_dim, V32.index_topk
W, OFF = V32.kv_latent_dim, V32.mla_latent_dim


@jax.jit
def _read_in_rows(rows):
    return rows[..., OFF:].sum(axis=1)


@jax.jit
def _read_contiguous(keys):
    return keys.sum(axis=1)


def _scores(q, w, keys):
    s = jnp.einsum("BHI,BSI->BHS", q, keys, preferred_element_type=jnp.float32) * DI ** -0.5
    return jnp.einsum("BH,BHS->BS", w, jax.nn.relu(s))


_scores_in_rows = jax.jit(lambda q, w, rows: _scores(q, w, rows[..., OFF:]))
_scores_contiguous = jax.jit(_scores)
_top_k = jax.jit(lambda s: jax.lax.top_k(s, K)[1])


def measure(lengths, batch: int, repeats: int) -> list:
    """Rows (S, {name: ns per cached token of a sequence and layer})."""
    rng, out = np.random.default_rng(0), []
    q = jnp.asarray(rng.standard_normal((batch, HI, DI)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((batch, HI)), jnp.float32)
    for S in lengths:
        rows = jnp.asarray(rng.standard_normal((batch, S, W)), jnp.float32)
        keys = jnp.asarray(np.asarray(rows[..., OFF:]))
        scores = _scores_contiguous(q, w, keys)
        runs = {"key read, in the rows": lambda: _read_in_rows(rows),
                "key read, contiguous": lambda: _read_contiguous(keys),
                "scores, in the rows": lambda: _scores_in_rows(q, w, rows),
                "scores, contiguous": lambda: _scores_contiguous(q, w, keys),
                "top_k": lambda: _top_k(scores)}
        out.append((S, {name: _best(lambda f=f: jax.block_until_ready(f()), repeats) * 1e9 / (batch * S)
                        for name, f in runs.items()}))
        print(f"  S={S} done", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    rows = measure(args.lengths, args.batch, args.repeats)
    bw, _ = machine()
    print(f"\nns per cached token and layer, batch {args.batch}; the key's {DI * 4} B at the measured "
          f"{bw / 1e9:.1f} GB/s take {DI * 4 / bw * 1e9:.1f} ns; rows of {W} float32 values\n")
    names = list(rows[0][1])
    print("| context | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1))
    for S, t in rows:
        print(f"| {S} | " + " | ".join(f"{t[n]:.1f}" for n in names) + " |")


if __name__ == "__main__":
    main()
