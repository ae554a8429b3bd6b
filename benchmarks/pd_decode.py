"""The paged decode pool against a contiguous cache, on simulated CPU devices.

1. Decode step time against the KV length at a fixed pool capacity: every slot holds L
   tokens; the pool's step (it gathers only the length bucket's blocks) against the same
   step over a contiguous ``KVCache`` of L + a few positions (``decode_core`` + sampling, the
   tokens fed back on the device and fetched each step, as the pool does), and against the
   pool's step forced to gather every block of the table (what it did before).
2. A received handoff chunk written into one rank's pool shard: time per chunk against the
   pool's size, donated (in place) and not donated (a copy of the shard), and XLA's memory
   analysis of each compiled insert. The reference is a plain copy of the chunk.
3. DP2 x EP2 decode (a pool on 4 devices) with 8 running requests against the single-device
   contiguous step of the same 8 requests.

Times are medians over steps; ratios are taken within each repeat (the two steps measured
back to back), then the median over repeats: the machine is shared and noisy.

Run: .venv/bin/python benchmarks/pd_decode.py [--preset tiny] [--max-len 8192] [--slots 8]
     [--part 1 2 3] (--max-len is the size knob: lengths run from max_len/32 to max_len)
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pdjax  # noqa: E402
from pdjax.disagg import decode  # noqa: E402
from pdjax.disagg.decode import DecodePool  # noqa: E402
from pdjax.disagg.request import Request  # noqa: E402
from pdjax.model.cache import KVCache  # noqa: E402
from pdjax.model.transformer import decode_core  # noqa: E402


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _contiguous_step(params, cfg, tokens, cache):
    """The pool's step (greedy batch) on a contiguous cache: decode, argmax, the tokens kept on
    the device."""
    logits, cache = decode_core(params, cfg, tokens, cache, None, jnp.ones(tokens.shape[0], bool))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


class Contiguous:
    """B rows of L cached tokens (random latents) in a contiguous cache of L + extra positions."""

    def __init__(self, params, cfg, B, L, extra, device):
        rng = np.random.default_rng(0)
        kv = tuple(jax.device_put(rng.standard_normal((B, L + extra, cfg.kv_latent_dim), np.float32)
                                  .astype(cfg.kv_cache_dtype), device) for _ in range(cfg.num_hidden_layers))
        self.cache = KVCache(kv, jax.device_put(np.full(B, L, np.int32), device))
        self.params, self.cfg = jax.device_put(params, device), cfg
        self.tokens = jax.device_put(np.arange(B, dtype=np.int32), device)

    def step(self):
        self.tokens, self.cache = _contiguous_step(self.params, self.cfg, self.tokens, self.cache)
        return jax.device_get(self.tokens)


def fill(pool: DecodePool, n: int, L: int, new_tokens: int, seed: int = 0) -> None:
    """Admit n requests of L-token prompts with random latent rows (one chunk per layer)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        req = Request(i, [1] * L, new_tokens)
        res = pool.reserve(req)
        dev = pool.target_device(res)
        for layer in range(pool.cfg.num_hidden_layers):
            rows = rng.standard_normal((L, pool.cfg.kv_latent_dim), np.float32).astype(pool.cfg.kv_cache_dtype)
            pool.receive_layer(res, layer, jax.device_put(rows, dev))
        req.output.append(0)
        pool.admit(res, 0)


def empty(pool: DecodePool) -> None:
    for s in pool.active:
        pool.release(s)


def full_view_step(pool: DecodePool):
    """The pool's step gathering every block of the table (the step before length buckets)."""
    toks, pool.cache, pool.state = decode._step(pool.params, pool.cfg, pool.cache.with_view(None), pool.state,
                                                pool.ep, False)
    return jax.device_get(toks)


def median_step(step, n: int) -> float:
    step()                                             # compile / warm
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def capacity(args) -> int:
    """Tokens per slot of part 1's pool: the longest length and the steps' rows, in whole blocks."""
    return -(-(args.max_len + 4 * args.steps) // args.block_size) * args.block_size


def part_length(params, cfg, args):
    """Step time against the KV length at a fixed capacity (one device)."""
    dev = jax.devices()[0]
    cap = capacity(args)
    pool = DecodePool(params, cfg, [dev], {"data": 1}, slots=args.slots, block_size=args.block_size, max_context=cap)
    print(f"## 1. decode step vs KV length: {args.preset}, {args.slots} slots all running, one device, "
          f"pool capacity {pool.blocks_per_slot * args.block_size} tokens per slot (block {args.block_size})")
    print(f"{'KV len':>7}{'view':>7}{'paged ms':>10}{'contig ms':>10}{'paged/contig':>13}{'all blocks ms':>14}"
          f"{'all/contig':>11}")
    L = args.max_len // 32
    while L <= args.max_len:
        rows = []
        for _ in range(args.repeats):
            fill(pool, args.slots, L, 3 * args.steps)
            view = pool.view_blocks() * args.block_size
            paged = median_step(pool.step, args.steps)
            full = median_step(lambda: full_view_step(pool), args.steps) if args.full else float("nan")
            empty(pool)
            contig = Contiguous(params, cfg, args.slots, L, 4 * args.steps, dev)
            c = median_step(contig.step, args.steps)
            del contig
            rows.append((paged, c, full))
        p, c, f = np.median(rows, axis=0)
        r = np.median([a / b for a, b, _ in rows])
        rf = np.median([x / b for _, b, x in rows])
        print(f"{L:>7}{view:>7}{1e3 * p:>10.2f}{1e3 * c:>10.2f}{r:>13.2f}{1e3 * f:>14.2f}{rf:>11.2f}")
        L *= 2
    print("(view: tokens per slot the paged step gathers; all blocks: the same step gathering the whole "
          "table, as before)\n")


def _time(fn, n: int) -> float:
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _insert_row(params, cfg, args, blocks: int, copy_rows, undonated) -> str:
    """One table row of part 2: a DP2 pool of ``blocks`` blocks per rank."""
    T = args.chunk
    pool = DecodePool(params, cfg, jax.devices()[:2], {"data": 2}, slots=2, block_size=args.block_size,
                      max_context=T + 1, num_blocks=blocks)
    res = pool.reserve(Request(0, [1] * T, 1))
    dev = pool.target_device(res)
    rows = jax.device_put(np.ones((T, cfg.kv_latent_dim), cfg.kv_cache_dtype), dev)
    pos = np.arange(T)
    index = jax.device_put(np.stack([np.asarray(res.blocks, np.int32)[pos // args.block_size],
                                     (pos % args.block_size).astype(np.int32)]), dev)
    shard = pool.cache.pools[2].addressable_shards[res.rank].data      # layers 0, 1: receive, insert
    extra = []
    for f in (decode._insert_rows, undonated):
        m = f.lower(shard, rows, index).compile().memory_analysis()
        extra.append(m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)
    receive = _time(lambda: (pool.receive_layer(res, 0, rows), pool.cache.pools[0])[1], args.steps)
    state = {"s": pool.cache.pools[1].addressable_shards[res.rank].data}

    def insert():
        state["s"] = decode._insert_rows(state["s"], rows, index)
        return state["s"]
    t_in = _time(insert, args.steps)
    t_nd = _time(lambda: undonated(shard, rows, index), args.steps)
    t_cp = _time(lambda: copy_rows(rows), args.steps)
    return (f"{shard.nbytes:>14,}{1e3 * receive:>11.3f}{1e3 * t_in:>10.3f}{1e3 * t_nd:>13.3f}{1e3 * t_cp:>14.3f}"
            f"{t_in / t_cp:>12.2f}{extra[0]:>12,}{extra[1]:>18,}")


def part_insert(params, cfg, args):
    """A handoff chunk written into one rank's shard, against the pool's size."""
    itemsize = jnp.dtype(cfg.kv_cache_dtype).itemsize
    print(f"## 2. a received handoff chunk: {args.chunk} rows x {cfg.kv_latent_dim} x {itemsize} B = "
          f"{args.chunk * cfg.kv_latent_dim * itemsize:,} B into rank 0 of a DP2 pool ({args.preset}, "
          f"block {args.block_size})")
    print(f"{'pool shard B':>14}{'receive ms':>11}{'insert ms':>10}{'no-donate ms':>13}{'chunk copy ms':>14}"
          f"{'insert/copy':>12}{'XLA extra B':>12}{'no-donate extra B':>18}")
    copy_rows, undonated = jax.jit(lambda x: x + 1), jax.jit(decode._insert_rows.__wrapped__)
    need = -(-(args.chunk + 1) // args.block_size)        # the request (chunk + 1 token) and scratch block 0
    for blocks in (need + 1, 4 * need, 16 * need, 64 * need):
        print(_insert_row(params, cfg, args, blocks, copy_rows, undonated))
    print("(receive: the whole receive_layer call; insert: its jitted in-place write; no-donate: the same "
          "write without donation (a copy of the shard); chunk copy: rows -> rows + 1, which moves 2x the "
          "chunk's bytes, as the in-place insert does (read the chunk, write its rows). XLA extra B: output "
          "bytes not aliased to an input, plus temp)\n")


def _dp_row(pool, params, cfg, args, n: int) -> tuple:
    """(pool ms, contiguous ms, median ratio) of n running requests over the repeats."""
    rows = []
    for r in range(args.repeats):
        fill(pool, n, args.dp_len, 3 * args.steps, seed=r)
        p = median_step(pool.step, args.steps)
        empty(pool)
        contig = Contiguous(params, cfg, n, args.dp_len, 4 * args.steps, jax.devices()[0])
        c = median_step(contig.step, args.steps)
        del contig
        rows.append((p, c))
    p, c = np.median(rows, axis=0)
    return 1e3 * p, 1e3 * c, float(np.median([a / b for a, b in rows]))


def part_dp_ep(args):
    """DP2 x EP2 decode with 8 running requests against the single-device contiguous step."""
    cfg = pdjax.configs.preset(args.dp_preset)
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, args.dp_context))
    params = pdjax.init_params(cfg, jax.random.key(0))
    n, devs = 8, jax.devices()
    print(f"## 3. decode pool, {n} running requests of {args.dp_len} tokens ({args.dp_preset}), vs the "
          f"single-device contiguous step")
    print(f"{'pool':>28}{'slots':>6}{'pool ms':>9}{'contig ms':>10}{'pool/contig':>12}")
    for name, pool_devs, axes, slots in (("one device", devs[:1], {"data": 1}, 8),
                                         ("DP2 x EP2 (devices 4-7)", devs[4:8], {"data": 2, "expert": 2}, 8),
                                         ("DP2 x EP2 (devices 4-7)", devs[4:8], {"data": 2, "expert": 2}, 32)):
        pool = DecodePool(params, cfg, pool_devs, axes, slots=slots, block_size=16, max_context=args.dp_context)
        p, c, r = _dp_row(pool, params, cfg, args, n)
        print(f"{name:>28}{slots:>6}{p:>9.1f}{c:>10.1f}{r:>12.2f}")
        del pool
    print(f"(pool capacity {args.dp_context} tokens per slot; empty slots are masked padding rows)\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", help="model of parts 1 and 2")
    ap.add_argument("--max-len", type=int, default=8192, help="longest KV length (part 1); the size knob")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--full", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the step gathering every block (part 1)")
    ap.add_argument("--chunk", type=int, default=4096, help="rows per handoff chunk (part 2)")
    ap.add_argument("--dp-preset", default="small")
    ap.add_argument("--dp-len", type=int, default=32)
    ap.add_argument("--dp-context", type=int, default=1088)
    ap.add_argument("--part", type=int, nargs="*", default=[1, 2, 3])
    args = ap.parse_args()
    cfg = pdjax.configs.preset(args.preset)
    if cfg.max_position_embeddings < capacity(args):
        cfg = cfg.replace(max_position_embeddings=capacity(args))
    params = pdjax.init_params(cfg, jax.random.key(0))
    if 1 in args.part:
        part_length(params, cfg, args)
    if 2 in args.part:
        part_insert(params, cfg, args)
    if 3 in args.part:
        part_dp_ep(args)


if __name__ == "__main__":
    main()
