"""The PD engine's prefix KV store: hash-chain blocks in device/host/disk tiers, LRU and TTL,
checksums, metadata-only lookups and layer-by-layer loads (on the 8 CPU devices)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdjax
from pdjax import sim
from pdjax import prefix_index
from pdjax.disagg import prefix_store
from pdjax.disagg.prefix_store import CorruptBlockError, MissingBlockError, PrefixStore

from faults import corrupt_block

BS = 4


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def cfg():
    return pdjax.configs.tiny()


def _rows(cfg, n, seed, dtype=np.float32):
    rng = np.random.RandomState(seed)
    return [rng.randn(n, cfg.kv_latent_dim).astype(dtype) for _ in range(cfg.num_hidden_layers)]


def _prompt(n, seed):
    return list(np.random.RandomState(1000 + seed).randint(0, 256, n))


def _store(cfg, tmp_path=None, *, device=0, host=0, disk=0, **kw):
    return PrefixStore(cfg, BS, device_blocks=device, host_blocks=host, disk_blocks=disk,
                       disk_dir=None if tmp_path is None else str(tmp_path), **kw)


def _load_all(store, tokens, n, device=None):
    return [np.asarray(rows) for _, rows in store.load(tokens, n, device or jax.devices()[1])]


def test_round_trip_from_each_tier_with_demotion(cfg, tmp_path):
    store = _store(cfg, tmp_path, device=2, host=2, disk=2)
    prompts = [_prompt(2 * BS + 1, s) for s in range(4)]
    rows = [_rows(cfg, 2 * BS + 1, s) for s in range(4)]
    for p, r in zip(prompts[:3], rows[:3]):
        assert store.insert(p, r if p is not prompts[1] else [jnp.asarray(x) for x in r]) == 2
    for p, tier in zip(prompts, ["disk", "host", "device"]):     # oldest demoted furthest
        assert {store.tier_of(h) for h in store.hashes(p)} == {tier}
    for i, tier in enumerate(["disk", "host", "device"]):
        before = dict(store.stats["bytes_loaded"])
        assert store.lookup(prompts[i]) == 2 * BS
        got = _load_all(store, prompts[i], 2 * BS)
        for l in range(cfg.num_hidden_layers):
            np.testing.assert_array_equal(got[l], rows[i][l][:2 * BS])
        assert store.stats["bytes_loaded"][tier] - before[tier] == 2 * store.block_bytes
    # the disk tier is a zarr3 array, one chunk file per block slot (2 blocks + 1 spare slot)
    chunks = os.path.join(store.disk_path, "blocks.zarr", "c")
    assert os.path.exists(os.path.join(store.disk_path, "blocks.zarr", "zarr.json"))
    assert len(os.listdir(chunks)) == 2
    assert os.path.getsize(store._chunk_file(store._data["disk"][store.hashes(prompts[0])[0]])) == store.block_bytes
    store.insert(prompts[3], rows[3])        # disk is full: its LRU chain (prompt 0) is dropped
    assert store.lookup(prompts[0]) == 0 and store.stats["evictions"]["disk"] >= 1
    assert len(store._data["disk"]) == 2 and len(store._free_slots) == 1     # 3 slots: 2 live, 1 spare
    path = store.disk_path
    store.close()
    assert not os.path.exists(path)


def test_chain_split_over_tiers_and_bfloat16(cfg, tmp_path):
    store = _store(cfg, tmp_path, device=1, host=1, disk=2, dtype=jnp.bfloat16)
    p = _prompt(4 * BS, 7)
    r = _rows(cfg, 4 * BS, 7, dtype=jnp.bfloat16)
    store.insert(p, r)
    assert [store.tier_of(h) for h in store.hashes(p)] == ["device", "host", "disk", "disk"]
    assert store.lookup(p) == 3 * BS                 # the last token is never covered
    got = _load_all(store, p, 4 * BS)
    for l in range(cfg.num_hidden_layers):
        assert got[l].dtype == jnp.bfloat16
        np.testing.assert_array_equal(got[l].view(np.uint16), r[l].view(np.uint16))


def test_hash_chain_shares_prefixes_and_breaks_on_an_earlier_difference(cfg):
    store = _store(cfg, host=64)
    common = _prompt(2 * BS, 1)
    a, b = common + _prompt(BS + 2, 2), common + _prompt(BS + 2, 3)
    ra = _rows(cfg, len(a), 2)
    assert store.insert(a, ra) == 3
    assert store.lookup(b) == 2 * BS                 # shares the two common blocks
    assert store.insert(b, _rows(cfg, len(b), 3)) == 1
    got = _load_all(store, b, 2 * BS)
    np.testing.assert_array_equal(got[0], ra[0][:2 * BS])
    c = list(a)
    c[0] = (c[0] + 1) % 256                          # block 0 differs, blocks 1, 2 equal
    ha, hc = store.hashes(a), store.hashes(c)
    assert all(x != y for x, y in zip(ha, hc))       # the whole chain differs
    assert store.lookup(c) == 0
    # one representation: the simulator's index and token hashes are these
    assert sim.PrefixCache is prefix_index.PrefixCache
    assert sim.prefix_cache.token_chain_hashes(a, BS) == ha


def test_lookup_is_metadata_only(cfg, tmp_path, monkeypatch):
    store = _store(cfg, tmp_path, device=1, host=1, disk=4)
    p = _prompt(3 * BS + 1, 4)
    store.insert(p, _rows(cfg, len(p), 4))
    loaded = (dict(store.stats["bytes_loaded"]), dict(store.stats["blocks_loaded"]))

    def no_read(*a, **k):
        raise AssertionError("lookup read a block")
    monkeypatch.setattr(store, "_read", no_read)
    monkeypatch.setattr(store, "_read_data", no_read)
    monkeypatch.setattr(prefix_store, "_device_put", no_read)
    assert store.lookup(p) == 3 * BS
    assert store.lookup(p[:2 * BS]) == BS
    assert (store.stats["bytes_loaded"], store.stats["blocks_loaded"]) == loaded
    assert store.stats["loads"] == 0
    assert store.stats["hit_blocks"] == 4 and store.stats["hit_tokens"] == 4 * BS


def test_lookup_never_covers_the_last_token(cfg):
    store = _store(cfg, host=64)
    p = _prompt(2 * BS, 5)
    store.insert(p, _rows(cfg, len(p), 5))
    assert len(store) == 2                           # both full blocks are stored ...
    assert store.lookup(p) == BS                     # ... but a prefill computes >= 1 token
    assert store.lookup(p + [1]) == 2 * BS
    assert store.lookup(p[:1]) == 0 and store.lookup([]) == 0
    assert store.lookup(p[:BS]) == 0 and store.lookup(p[:BS + 1]) == BS


def test_lru_within_a_tier(cfg):
    store = _store(cfg, host=2)
    a, b, c = (_prompt(BS + 1, s) for s in (10, 11, 12))
    store.insert(a, _rows(cfg, len(a), 0))
    store.insert(b, _rows(cfg, len(b), 1))
    assert store.lookup(a) == BS                     # a becomes most recent
    store.insert(c, _rows(cfg, len(c), 2))           # evicts b (no disk: dropped)
    assert store.lookup(b) == 0 and store.lookup(a) == BS and store.lookup(c) == BS
    assert store.stats["evictions"]["host"] == 1


def test_ttl_per_retention_class_survives_demotion(cfg):
    clock = FakeClock()
    store = _store(cfg, device=1, host=4, retention={"chat": 10.0, "agent": 5.0}, clock=clock)
    a, b = _prompt(BS + 1, 20), _prompt(BS + 1, 21)
    store.insert(a, _rows(cfg, len(a), 0), retention="chat")
    store.insert(b, _rows(cfg, len(b), 1), retention="agent")     # demotes a to host
    assert store.tier_of(store.hashes(a)[0]) == "host"
    clock.t = 4.9
    assert store.lookup(a) == BS and store.lookup(b) == BS
    clock.t = 5.0
    assert store.lookup(b) == 0 and store.lookup(a) == BS           # agent expired
    assert store.stats["expired_blocks"] == 1 and store.tier_of(store.hashes(b)[0]) is None
    with pytest.raises(MissingBlockError):
        next(store.load(b, BS, jax.devices()[0]))
    store.insert(a, _rows(cfg, len(a), 0), retention="chat")        # a rewrite extends
    clock.t = 14.0
    assert store.lookup(a) == BS
    clock.t = 15.0
    assert store.lookup(a) == 0


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_corrupt_block_raises_and_is_evicted(cfg, tmp_path, tier):
    caps = {"device": dict(device=4), "host": dict(host=4), "disk": dict(disk=4)}[tier]
    store = _store(cfg, tmp_path, **caps)
    p = _prompt(2 * BS + 1, 30)
    r = _rows(cfg, len(p), 30)
    store.insert(p, r)
    h0, h1 = store.hashes(p)
    assert corrupt_block(store, h1) == tier
    assert store.lookup(p) == 2 * BS                 # metadata cannot see it ...
    with pytest.raises(CorruptBlockError) as e:      # ... the load's checksum does
        store.load(p, 2 * BS, jax.devices()[0])
    assert isinstance(e.value, ValueError)
    assert (e.value.block_hash, e.value.tier) == (h1, tier)
    assert store.tier_of(h1) is None and store.tier_of(h0) == tier
    assert store.stats["corrupt_blocks"] == 1
    assert store.lookup(p) == BS                     # the retry recomputes block 1
    assert store.insert(p, r) == 1
    got = _load_all(store, p, 2 * BS)
    np.testing.assert_array_equal(got[2], r[2][:2 * BS])


def test_load_issues_layer_l_plus_1_before_yielding_layer_l(cfg, monkeypatch):
    cfg = cfg.replace(num_hidden_layers=4)
    store = _store(cfg, host=8)
    p = _prompt(3 * BS + 1, 40)
    r = _rows(cfg, len(p), 40)
    store.insert(p, r)
    events, real_put = [], jax.device_put

    def watched(x, device):
        events.append("put")
        return real_put(x, device)
    monkeypatch.setattr(prefix_store, "_device_put", watched)
    target = jax.devices()[3]
    for l, rows in store.load(p, 3 * BS, target):
        events.append(f"yield {l}")
        assert rows.shape == (3 * BS, cfg.kv_latent_dim) and rows.devices() == {target}
        np.testing.assert_array_equal(np.asarray(rows), r[l][:3 * BS])
    assert events == ["put", "put", "yield 0", "put", "yield 1", "put", "yield 2", "yield 3"]


def test_missing_block_between_lookup_and_load(cfg):
    store = _store(cfg, host=1)
    a, b = _prompt(BS + 1, 50), _prompt(BS + 1, 51)
    store.insert(a, _rows(cfg, len(a), 0))
    assert store.lookup(a) == BS
    store.insert(b, _rows(cfg, len(b), 1))           # evicts a
    with pytest.raises(MissingBlockError):
        store.load(a, BS, jax.devices()[0])
    assert [r.shape for _, r in store.load(a, 0, jax.devices()[0])] == [(0, cfg.kv_latent_dim)] * 3


def test_bad_input(cfg, tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        PrefixStore(cfg, 0, device_blocks=1, host_blocks=1)
    with pytest.raises(ValueError, match="host_blocks"):
        PrefixStore(cfg, BS, device_blocks=1, host_blocks=-1)
    with pytest.raises(ValueError, match="disk_dir"):
        PrefixStore(cfg, BS, device_blocks=1, host_blocks=1, disk_blocks=2)
    with pytest.raises(ValueError, match="TTL of class 'chat'"):
        PrefixStore(cfg, BS, device_blocks=1, host_blocks=1, retention={"chat": 0})
    store = _store(cfg, host=8)
    p = _prompt(2 * BS + 1, 60)
    good = _rows(cfg, len(p), 60)
    with pytest.raises(ValueError, match="width"):
        store.insert(p, [x[:, :-1] for x in good])
    with pytest.raises(ValueError, match=f"{BS} rows"):
        store.insert(p, [x[:BS] for x in good])
    with pytest.raises(ValueError, match="one array per layer"):
        store.insert(p, good[:-1])
    with pytest.raises(ValueError, match="dtype"):
        store.insert(p, [x.astype(np.float16) for x in good])
    with pytest.raises(ValueError, match="retention class 'batch'"):
        store.insert(p, good, retention="batch")
    assert len(store) == 0                           # nothing stored by a bad call
    store.insert(p, good)
    with pytest.raises(ValueError, match="num_tokens"):
        store.load(p, BS + 1, jax.devices()[0])
    with pytest.raises(ValueError, match="num_tokens"):
        store.load(p, 4 * BS, jax.devices()[0])
