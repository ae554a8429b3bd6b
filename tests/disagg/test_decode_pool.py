"""The decode pool's step reads only the KV it needs, writes handoff chunks in place and copies
nothing from the host: the gathered view is bounded by the length bucket (and tokens still
equal pdjax.generate with slots at very different lengths), a received chunk lands in the
same buffer, and a step makes one device-to-host transfer (the tokens) and none the other
way; every pool and buffer update is donated."""

import dataclasses
import re

import jax
import numpy as np
import pytest

import pdjax
from pdjax.disagg import decode
from pdjax.disagg import prefill as prefill_module
from pdjax.disagg.decode import DecodePool
from pdjax.disagg.request import Request
from pdjax.model.paged import view_bucket

from host_transfers import device_fetches

# a donation XLA cannot honour (no output to alias) warns: make it fail the tests
pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

BLOCK, CONTEXT, NEW = 4, 512, 5
LENS = (3, 200, 7)                       # very different lengths: 1, 50 and 2 blocks


@pytest.fixture(scope="module")
def handoff(tiny_cfg, tiny_params):
    return _handoff(tiny_cfg, tiny_params, LENS)


def _handoff(tiny_cfg, tiny_params, LENS, seed=1):
    """Per prompt: (prompt, first token, per layer its latent rows [T, C+R]), and
    pdjax.generate's tokens. The rows come from the prefill generate runs itself (same
    shapes: one compiled program for both)."""
    rng = np.random.RandomState(seed)
    prompts = [list(rng.randint(0, tiny_cfg.vocab_size, n)) for n in LENS]
    want = pdjax.generate(tiny_params, tiny_cfg, prompts, max_new_tokens=NEW)
    tokens = np.zeros((len(prompts), max(LENS)), np.int64)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    lens = np.array(LENS, np.int32)
    logits, cache = pdjax.prefill(tiny_params, tiny_cfg, tokens, lengths=lens, max_len=max(LENS) + NEW)
    first = np.argmax(np.asarray(logits)[np.arange(len(LENS)), lens - 1], -1)
    rows = [[np.asarray(kv[i, :n]) for kv in cache.kv] for i, n in enumerate(LENS)]
    return [(p, int(f), r) for p, f, r in zip(prompts, first, rows)], want


def _pool(cfg, params):
    return DecodePool(params, cfg, jax.devices()[:2], {"data": 2}, slots=4, block_size=BLOCK, min_view_tokens=1,
                      max_context=CONTEXT)


def _admit(pool, index, prompt, first, rows, chunk=None):
    """Hand a prefilled request to the pool (in chunks of ``chunk`` rows) and admit it."""
    req = Request(index, prompt, NEW)
    res = pool.reserve(req)
    dev = pool.target_device(res)
    step = chunk or len(prompt)
    for layer, r in enumerate(rows):
        for start in range(0, len(prompt), step):
            pool.receive_layer(res, layer, jax.device_put(r[start:start + step], dev), start)
    req.output.append(first)
    return pool.admit(res, first), req


def _view_lengths(pool):
    """Token lengths S of every [b, S, C+R] array in the lowered program of the next step."""
    W = pool.cfg.kv_latent_dim
    text = decode._step.lower(pool.params, pool.cfg, pool.cache.with_view(pool.view_blocks()), pool.state,
                              pool.ep, False).as_text()                 # greedy, as the step runs
    return {int(s) for s in re.findall(rf"tensor<\d+x(\d+)x{W}xf32>", text)}


def _run(pool, slots, steps):
    for _ in range(steps):
        for s, tok in pool.step().items():
            slots[s].output.append(tok)


def test_step_reads_the_length_bucket_and_tokens_match_generate(tiny_cfg, tiny_params, handoff):
    (short, long_, mid), want = handoff
    pool = _pool(tiny_cfg, tiny_params)
    slots = {}
    for i, r in ((0, short), (2, mid)):
        s, req = _admit(pool, i, *r)
        slots[s] = req
    # short slots only: 7 + 1 tokens = 2 blocks, bucket 2 of the 128 a slot can address
    assert pool.view_blocks() == view_bucket(len(mid[0]) + 1, BLOCK, pool.blocks_per_slot) == 2
    assert max(_view_lengths(pool)) == 2 * BLOCK
    _run(pool, slots, 1)                                   # still within 2 blocks
    s, req = _admit(pool, 1, *long_)
    slots[s] = req
    # with the 200-token slot: 51 blocks needed, bucket 64 (< 128), and the view follows it
    assert pool.view_blocks() == 64 < pool.blocks_per_slot
    assert max(_view_lengths(pool)) == 64 * BLOCK
    _run(pool, slots, NEW)
    got = {req.index: req.output[:NEW] for req in slots.values()}
    assert [got[i] for i in range(3)] == [list(map(int, w)) for w in want]


def test_a_slot_ending_at_a_block_boundary_sees_the_row_it_writes(tiny_cfg, tiny_params):
    """Prompts of a whole number of blocks (4 and 8 tokens, 4-token blocks) and one block
    short (3, 7): each step writes its new row into the next block, which the view must
    include (min_view_tokens=1, so the view is the blocks of the longest slot plus its new
    row, nothing more); the tokens are pdjax.generate's."""
    pairs, want = _handoff(tiny_cfg, tiny_params, (4, 8, 3, 7), seed=2)
    pool = _pool(tiny_cfg, tiny_params)
    slots = {}
    for i, r in enumerate(pairs):
        s, req = _admit(pool, i, *r)
        slots[s] = req
    assert pool.view_blocks() == view_bucket(8 + 1, BLOCK, pool.blocks_per_slot) == 3
    _run(pool, slots, NEW)
    got = {req.index: req.output[:NEW] for req in slots.values()}
    assert [got[i] for i in range(4)] == [list(map(int, w)) for w in want]


def test_receive_layer_writes_in_place(tiny_cfg, tiny_params, handoff):
    (short, long_, _), _ = handoff
    pool = _pool(tiny_cfg, tiny_params)
    before = [[s.data.unsafe_buffer_pointer() for s in p.addressable_shards] for p in pool.cache.pools]
    _admit(pool, 0, *short)
    slot, _ = _admit(pool, 1, *long_, chunk=64)            # four chunks per layer
    after = [[s.data.unsafe_buffer_pointer() for s in p.addressable_shards] for p in pool.cache.pools]
    assert after == before                                 # every rank's shard: the same buffer
    res = pool.slot_req[slot]
    for layer, rows in enumerate(long_[2]):                # and the rows are where the blocks say
        blocks = np.asarray(pool.cache.pools[layer][res.rank])[res.blocks].reshape(-1, rows.shape[1])
        np.testing.assert_array_equal(blocks[:len(rows)], rows)


def test_step_copies_nothing_from_the_host_and_fetches_once(tiny_cfg, tiny_params, handoff):
    (short, long_, mid), _ = handoff
    pool = _pool(tiny_cfg, tiny_params)
    slots = dict(_admit(pool, i, *r) for i, r in enumerate((short, long_, mid)))
    _run(pool, slots, 1)                                   # compiled outside the guard
    with device_fetches() as fetches:
        for _ in range(3):
            _run(pool, slots, 1)
    assert fetches == [(pool.slots,)] * 3


def _aliased(lowered) -> int:
    """How many of a lowered program's inputs are donated into its outputs (updated in place)."""
    return len(re.findall(r"tf\.aliasing_output|jax\.buffer_donor = true", lowered.as_text()))


def test_every_pool_and_buffer_update_is_donated(tiny_cfg, tiny_params, handoff):
    from pdjax.disagg import prefill
    pool = _pool(tiny_cfg, tiny_params)
    cache, state = pool.cache.with_view(pool.view_blocks()), pool.state
    n_cache, n_state = len(jax.tree.leaves(cache)), len(jax.tree.leaves(state))
    assert _aliased(decode._step.lower(pool.params, tiny_cfg, cache, state, pool.ep)) == n_cache + n_state
    row, ints, floats = np.zeros(pool.blocks_per_slot, np.int32), np.zeros(6, np.int32), np.zeros(2, np.float32)
    assert _aliased(decode._set_slot.lower(cache.block_tables, cache.lengths, state, row, ints, floats)) == 2 + n_state
    shard = cache.pools[0].addressable_shards[0].data
    assert _aliased(decode._insert_rows.lower(shard, np.zeros((3, tiny_cfg.kv_latent_dim), np.float32),
                                              np.zeros((2, 3), np.int32))) == 1
    # the prefill's per-request cache buffer, continued chunk by chunk
    x, q_pos = np.zeros((1, 16, tiny_cfg.hidden_size), np.float32), np.zeros((1, 16), np.int32)
    kv = np.zeros((1, 32, tiny_cfg.kv_latent_dim), np.float32)
    assert _aliased(prefill._layer_cached.lower(tiny_params["layers"][1], tiny_cfg, x, q_pos, kv, np.zeros(1, np.int32),
                                                np.ones((1, 16), bool), None, None)) == 1


def test_prefill_layers_keep_their_input_sharding(tiny_cfg, tiny_params):
    """An MoE layer of the prefill pool returns x and its cache rows replicated, as the
    dense layer before it does: the next MoE layer then runs the same compiled program
    (split over the expert axis, it compiled a second one)."""
    pool = prefill_module.PrefillPool(tiny_params, tiny_cfg, jax.devices()[:4], {"expert": 4})
    tokens, q_pos, valid = pool._inputs(list(range(1, 13)), 0, 12)
    x = prefill_module._embed(pool.params, tiny_cfg, tokens)
    for lp in pool.params["layers"]:
        x, kv = prefill_module._layer(lp, tiny_cfg, x, q_pos, valid, pool.ep, pool.replicated)
        assert x.sharding.is_equivalent_to(pool.replicated, x.ndim)
        assert kv.sharding.is_equivalent_to(pool.replicated, kv.ndim)


def test_warm_up_compiles_every_view_bucket(tiny_cfg, tiny_params, handoff):
    """After warm_up, serving requests of any length compiles no further step program, and
    the pool is left as it was (empty; tokens still those of pdjax.generate)."""
    pool = DecodePool(tiny_params, tiny_cfg, jax.devices()[:2], {"data": 2}, slots=4, block_size=128,
                      max_context=256, min_view_tokens=1)       # 2 blocks a slot: buckets 1, 2
    assert pool.warm_up(sampling=(False,)) == 2
    compiled = decode._step._cache_size()
    (items, want) = handoff
    slots = [_admit(pool, i, p, f, r) for i, (p, f, r) in enumerate(items)]
    out = {s: [req.output[0]] for s, req in slots}
    for _ in range(NEW - 1):
        for s, t in pool.step().items():
            out[s].append(t)
    assert [out[s] for s, _ in slots] == want
    assert decode._step._cache_size() == compiled
    with pytest.raises(RuntimeError, match="empty decode pool"):
        pool.warm_up()


def test_paged_cache_accounting_and_unsharded_multi_row_write(tiny_cfg):
    """Mutation-testing gaps (docs/mutation.md): the smallest pool (2 blocks: scratch + one)
    is accepted, the cache's bytes per token and dtype, and the unsharded write_and_view
    writing several rows across a block boundary at their positions."""
    import jax.numpy as jnp
    from pdjax.model.paged import PagedLayer, init_paged_cache
    cache = init_paged_cache(tiny_cfg, slots=2, num_blocks=2, block_size=4, blocks_per_slot=1, dtype="float32")
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        init_paged_cache(tiny_cfg, slots=2, num_blocks=1, block_size=4, blocks_per_slot=1)
    assert cache.dtype == jnp.float32
    assert cache.nbytes_per_token() == tiny_cfg.num_hidden_layers * tiny_cfg.kv_latent_dim * 4
    W = 3
    layer = PagedLayer(jnp.zeros((1, 3, 4, W), jnp.float32), jnp.array([[2, 1]], jnp.int32))
    assert layer.dtype == jnp.float32 and layer.shape == (1, 8, W)
    new = jnp.arange(1.0, 1.0 + 3 * W).reshape(1, 3, W)           # positions 2, 3 | 4
    layer, view = layer.write_and_view(new, jnp.array([2], jnp.int32))
    want = np.zeros((1, 8, W), np.float32)
    want[0, 2:5] = np.asarray(new[0])
    np.testing.assert_array_equal(np.asarray(view), want)
    np.testing.assert_array_equal(np.asarray(layer.pool[0, 2, 2:]), np.asarray(new[0, :2]))   # block 2 first
    np.testing.assert_array_equal(np.asarray(layer.pool[0, 1, 0]), np.asarray(new[0, 2]))


def test_block_allocator_view_bounds_and_the_unsharded_cache(tiny_cfg):
    """Mutation-testing gaps (docs/mutation.md): the allocator hands out every block but the
    scratch block 0 (num_blocks - 1 per rank), refuses more than are free, and releases only
    blocks 1..num_blocks-1; ``with_view`` takes 1..blocks_per_slot blocks; a cache without a
    mesh has one rank (so any slot count divides), its batch, block size and max_len, the
    config's KV dtype by default, and a positive slot count; blocks_per_slot * block_size may
    reach max_position_embeddings but not pass it."""
    from pdjax.model.paged import BlockAllocator, init_paged_cache
    alloc = BlockAllocator(2, 5, BLOCK)
    assert [alloc.available(r) for r in (0, 1)] == [5 - 1, 5 - 1]
    assert alloc.allocate(0, 5) is None and alloc.available(0) == 5 - 1
    got = alloc.allocate(0, 5 - 1)
    assert sorted(got) == [1, 2, 3, 4] and alloc.available(0) == 0 and alloc.available(1) == 5 - 1
    for bad in (0, 5):
        with pytest.raises(ValueError, match=f"block {bad} is not a releasable block of rank 0"):
            alloc.release(0, [bad])
    alloc.release(0, got)
    assert alloc.available(0) == 5 - 1
    cache = init_paged_cache(tiny_cfg, slots=3, num_blocks=2, block_size=BLOCK, blocks_per_slot=2)
    assert cache.pools[0].shape[0] == 1 and cache.with_view(2).view_blocks == 2
    assert (cache.batch, cache.block_size, cache.max_len) == (3, BLOCK, 2 * BLOCK)
    assert cache.dtype == jax.numpy.dtype(tiny_cfg.kv_cache_dtype)
    bf16 = init_paged_cache(tiny_cfg.replace(cache_dtype="bfloat16"), slots=1, num_blocks=2, block_size=BLOCK,
                            blocks_per_slot=1)
    assert bf16.dtype == jax.numpy.bfloat16                     # the config's KV dtype by default
    with pytest.raises(ValueError, match="slots must be an integer >= 1, got 0"):
        init_paged_cache(tiny_cfg, slots=0, num_blocks=2, block_size=BLOCK, blocks_per_slot=1)
    for bad in (0, 3):
        with pytest.raises(ValueError, match=re.escape(f"view_blocks must be in [1, 2] or None, got {bad}")):
            cache.with_view(bad)
    most = tiny_cfg.max_position_embeddings // BLOCK
    assert init_paged_cache(tiny_cfg, slots=1, num_blocks=2, block_size=BLOCK, blocks_per_slot=most).max_len == \
        most * BLOCK
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        init_paged_cache(tiny_cfg, slots=1, num_blocks=2, block_size=BLOCK, blocks_per_slot=most + 1)


def test_a_cache_split_over_two_mesh_axes_gives_each_rank_its_own_pool(tiny_cfg):
    """Mutation-testing gap (docs/mutation.md): with DP ranks over two mesh axes (2 x 2), the
    cache and the attention's write_and_view shard over both (P(("a", "b"))): each device holds
    one rank's pool, and slot r's row lands in rank r's pool and view (the decode pool's
    tests use one axis, which shards alike whichever spec)."""
    import jax.numpy as jnp
    from pdjax.model.paged import init_paged_cache
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    cache = init_paged_cache(tiny_cfg, slots=4, num_blocks=2, block_size=BLOCK, blocks_per_slot=1, mesh=mesh,
                             axes=("a", "b"), dtype="float32")
    assert {s.data.shape[0] for s in cache.pools[0].addressable_shards} == {1}
    W = tiny_cfg.kv_latent_dim
    ranks = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("a", "b")))
    new = jax.device_put(jnp.arange(1.0, 1.0 + 4 * W).reshape(4, 1, W), ranks)   # a row per slot, at 0
    layer = dataclasses.replace(cache.layers()[0], block_tables=jax.device_put(jnp.ones((4, 1), jnp.int32), ranks))
    layer, view = layer.write_and_view(new, jax.device_put(jnp.zeros((4,), jnp.int32), ranks))
    np.testing.assert_array_equal(np.asarray(layer.pool[:, 1, 0]), np.asarray(new[:, 0]))
    np.testing.assert_array_equal(np.asarray(view[:, 0]), np.asarray(new[:, 0]))
