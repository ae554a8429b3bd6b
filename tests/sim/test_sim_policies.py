"""Property tests of the scheduling policies and the prefix cache."""

import math

import pytest
from hypothesis import given, settings, strategies as st

import pdjax
from pdjax import sim
from pdjax.sim.policies import DEFAULT_BUCKET_EDGES


@pytest.fixture(scope="module")
def cost():
    return sim.LinearStepCost.from_roofline(pdjax.configs.deepseek_v3(), "h800", ep_size=32)


COST = sim.LinearStepCost.from_roofline(pdjax.configs.deepseek_v3(), "h800", ep_size=32)


@settings(max_examples=150, deadline=None)
@given(c=st.integers(0, 200_000), max_q=st.integers(0, 100_000), budget=st.floats(0.0, 1.0),
       base=st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 50_000)), max_size=3))
def test_chunk_for_budget_is_the_largest_fitting_chunk(c, max_q, budget, base):
    f = COST.prefill_step_time
    q = sim.policies.chunk_for_budget(f, base, c, max_q, budget)
    assert 0 <= q <= max_q
    if max_q == 0:
        assert q == 0
        return
    if not base:
        assert q >= 1                     # a step alone always makes progress
    if q >= 1 and (base or f([(q, c)]) <= budget):
        assert f(base + [(q, c)]) <= budget
    if q < max_q and (base or q >= 1) and f(base + [(1, c)]) <= budget:
        assert f(base + [(q + 1, c)]) > budget


@settings(max_examples=60, deadline=None)
@given(c=st.integers(0, 100_000), b1=st.floats(0.013, 0.5), b2=st.floats(0.013, 0.5))
def test_chunk_grows_with_budget_and_shrinks_with_prefix(c, b1, b2):
    f = COST.prefill_step_time
    lo, hi = sorted((b1, b2))
    assert sim.policies.chunk_for_budget(f, [], c, 1 << 20, lo) <= sim.policies.chunk_for_budget(f, [], c, 1 << 20, hi)
    assert sim.policies.chunk_for_budget(f, [], c + 10_000, 1 << 20, hi) <= sim.policies.chunk_for_budget(f, [], c, 1 << 20, hi)


def test_chunk_for_budget_solves_the_quadratic(cost):
    """For one chunk, cost(q, c) = c0 + c1 q + c2 q c + c3 q^2 + c4 c, so the largest q
    fitting the budget is the floor of the root of c3 q^2 + (c1 + c2 c) q + c0 + c4 c - budget."""
    c, budget = 20_000, 0.05
    a, b = cost.c3, cost.c1 + cost.c2 * c
    k = cost.c0 + cost.c4 * c - budget
    root = (-b + math.sqrt(b * b - 4 * a * k)) / (2 * a)
    assert sim.policies.chunk_for_budget(cost.prefill_step_time, [], c, 1 << 20, budget) == math.floor(root)


@given(n=st.integers(0, 10**7))
def test_length_buckets(n):
    b = sim.policies.length_bucket(n)
    edges = (0,) + DEFAULT_BUCKET_EDGES + (math.inf,)
    assert edges[b] <= n < edges[b + 1]


def test_length_bucket_edges_are_the_brief_s():
    assert [sim.policies.length_bucket(x) for x in (16383, 16384, 65535, 65536, 262143, 262144)] == [0, 1, 1, 2, 2, 3]


@given(pending=st.lists(st.floats(0, 100), min_size=1, max_size=8), data=st.data())
def test_pick_by_quota_minimises_work_per_quota(pending, data):
    quota = data.draw(st.lists(st.floats(0.1, 4), min_size=len(pending), max_size=len(pending)))
    i = sim.policies.pick_by_quota(pending, quota)
    assert all(pending[i] / quota[i] <= p / q for p, q in zip(pending, quota))
    allowed = data.draw(st.lists(st.integers(0, len(pending) - 1), min_size=1, unique=True))
    j = sim.policies.pick_by_quota(pending, quota, allowed)
    assert j in allowed and all(pending[j] / quota[j] <= pending[k] / quota[k] for k in allowed)


@given(counts=st.lists(st.integers(0, 50), min_size=1, max_size=8), data=st.data(),
       ctx=st.integers(1, 200_000))
def test_pick_decode_short_by_count_long_by_kv(counts, data, ctx):
    n = len(counts)
    kvs = data.draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
    fits = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    i = sim.policies.pick_decode(counts, kvs, ctx, 16384, fits)
    if not any(fits):
        assert i == -1
        return
    assert fits[i]
    ok = [k for k in range(n) if fits[k]]
    if ctx >= 16384:
        assert kvs[i] == min(kvs[k] for k in ok)
    else:
        assert counts[i] == min(counts[k] for k in ok)


def test_pick_decode_matches_the_article_example():
    # GPU A: 20 requests, 40K KV; GPU B: 5 requests, 200K KV
    counts, kvs = [20, 5], [40_000, 200_000]
    assert sim.policies.pick_decode(counts, kvs, 2_000, 16384) == 1      # short -> fewer requests (B)
    assert sim.policies.pick_decode(counts, kvs, 40_000, 16384) == 0     # long -> less KV (A)


# ---- prefix cache -------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(cap=st.integers(0, 20), ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12),
                                                      st.booleans()), max_size=40))
def test_prefix_cache_invariants(cap, ops):
    cache = sim.PrefixCache(cap, block_size=4)
    t = 0.0
    for family, length, is_insert in ops:
        t += 1.0
        toks = [family * 1000 + i for i in range(length * 4)]
        hs = sim.prefix_cache.token_chain_hashes(toks, 4)
        if is_insert:
            cache.insert(hs, t)
            assert cache.peek(hs, t) == min(len(hs), cap)    # a fresh chain is found whole
        else:
            n = cache.lookup(hs, t)
            assert all(h in cache for h in hs[:n])
        assert len(cache) <= cap
        # chain property: a cached block's predecessor is cached
        order = cache.lru_order()
        pos = {h: i for i, h in enumerate(order)}
        for f in range(6):
            fh = sim.prefix_cache.token_chain_hashes([f * 1000 + i for i in range(48)], 4)
            present = [h in cache for h in fh]
            assert present == sorted(present, reverse=True)  # a prefix of the chain, no holes
            cached = [h for h in fh if h in cache]
            assert all(pos[a] > pos[b] for a, b in zip(cached, cached[1:]))  # head most recent


def test_prefix_cache_lru_evicts_least_recent_chain():
    cache = sim.PrefixCache(4, block_size=2)
    a = sim.prefix_cache.token_chain_hashes([1, 2, 3, 4], 2)
    b = sim.prefix_cache.token_chain_hashes([5, 6, 7, 8], 2)
    c = sim.prefix_cache.token_chain_hashes([9, 10, 11, 12], 2)
    cache.insert(a, 0.0)
    cache.insert(b, 1.0)
    assert cache.lookup(a, 2.0) == 2            # a becomes most recent
    cache.insert(c, 3.0)                        # evicts b (least recent)
    assert cache.peek(b, 3.0) == 0 and cache.peek(a, 3.0) == 2 and cache.peek(c, 3.0) == 2
    assert cache.evicted == 2


@given(ttl_chat=st.floats(1, 100), ttl_agent=st.floats(1, 100), dt=st.floats(0, 200))
def test_prefix_cache_ttl_per_retention_class(ttl_chat, ttl_agent, dt):
    cache = sim.PrefixCache(100, block_size=2, retention={"chat": ttl_chat, "agent": ttl_agent})
    x = sim.prefix_cache.token_chain_hashes([1, 2, 3, 4], 2)
    y = sim.prefix_cache.token_chain_hashes([5, 6, 7, 8], 2)
    cache.insert(x, 0.0, "chat")
    cache.insert(y, 0.0, "agent")
    assert cache.lookup(x, dt) == (2 if dt < ttl_chat else 0)
    assert cache.lookup(y, dt) == (2 if dt < ttl_agent else 0)


def test_retention_days_from_the_article():
    day = 86400.0
    cache = sim.PrefixCache(10, 2, retention={"agent": 3 * day, "chat": 7 * day})
    h = sim.prefix_cache.token_chain_hashes([1, 2], 2)
    cache.insert(h, 0.0, "agent")
    assert cache.peek(h, 3 * day - 1) == 1 and cache.peek(h, 3 * day) == 0


@given(segs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=6),
       segs2=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=6),
       bs=st.integers(1, 16))
def test_segment_hashes_agree_with_token_hashes_on_prefix_equality(segs, segs2, bs):
    def expand(ss):
        return [(sid, i) for sid, n in ss for i in range(n)]
    t1, t2 = expand(segs), expand(segs2)
    h1, h2 = sim.prefix_cache.segment_chain_hashes(segs, bs), sim.prefix_cache.segment_chain_hashes(segs2, bs)
    assert len(h1) == len(t1) // bs
    tok1 = sim.prefix_cache.token_chain_hashes([hash(x) for x in t1], bs)
    tok2 = sim.prefix_cache.token_chain_hashes([hash(x) for x in t2], bs)
    for i in range(min(len(h1), len(h2))):
        assert (h1[i] == h2[i]) == (tok1[i] == tok2[i]) == (t1[:(i + 1) * bs] == t2[:(i + 1) * bs])


def test_bad_cache_arguments():
    with pytest.raises(ValueError, match="capacity_blocks"):
        sim.PrefixCache(-1)
    with pytest.raises(ValueError, match="block_size"):
        sim.PrefixCache(10, 0)
    with pytest.raises(ValueError, match="TTL of class 'chat'"):
        sim.PrefixCache(10, 4, retention={"chat": 0})
