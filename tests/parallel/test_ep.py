"""Expert parallelism on 8 CPU devices equals the single-device model; dropped-assignment
accounting is exact; meshes and rules reject bad input."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdjax
from pdjax.parallel import ExpertParallel, ShardingRules, ep_moe, make_mesh, place_experts

TOL = 1e-5
MESHES = [{"data": 2, "expert": 4}, {"data": 1, "expert": 8}]


@pytest.fixture(scope="module")
def tokens(tiny_cfg):
    return np.random.RandomState(0).randint(0, tiny_cfg.vocab_size, (8, 7)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(tiny_cfg, tiny_params, tokens):
    full = np.asarray(pdjax.forward(tiny_params, tiny_cfg, tokens))
    logits, cache = pdjax.prefill(tiny_params, tiny_cfg, tokens[:, :5], max_len=8)
    steps = []
    for t in (5, 6):
        step, cache = pdjax.decode_step(tiny_params, tiny_cfg, tokens[:, t], cache)
        steps.append(np.asarray(step))
    return full, np.asarray(logits), steps


def _redundant(params, cfg, mesh):
    """Physical slots = 2x logical experts over the expert axis: hot experts replicated."""
    E = cfg.n_routed_experts
    n_moe = sum("moe" in lp for lp in params["layers"])
    rng = np.random.RandomState(3)
    phy2log = np.stack([np.concatenate([np.arange(E), rng.randint(0, E, E)]) for _ in range(n_moe)])
    return place_experts(params, phy2log)


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
@pytest.mark.parametrize("redundant", [False, True], ids=["plain", "redundant"])
def test_ep_equals_single_device(tiny_cfg, tiny_params, tokens, reference, axes, redundant):
    mesh = make_mesh(axes)
    params = _redundant(tiny_params, tiny_cfg, mesh) if redundant else tiny_params
    full, pre, steps = reference
    out, stats = pdjax.forward(params, tiny_cfg, tokens, mesh=mesh, return_stats=True)
    np.testing.assert_allclose(out, full, atol=TOL, rtol=0)
    assert np.asarray(stats["dropped_per_moe_layer"]).tolist() == [0, 0]
    logits, cache = pdjax.prefill(params, tiny_cfg, tokens[:, :5], max_len=8, mesh=mesh)
    np.testing.assert_allclose(logits, pre, atol=TOL, rtol=0)
    for t, want in zip((5, 6), steps):
        step, cache = pdjax.decode_step(params, tiny_cfg, tokens[:, t], cache, mesh=mesh)
        np.testing.assert_allclose(step, want, atol=TOL, rtol=0)
    assert cache.kv[0].sharding.spec[0] == tuple(mesh.axis_names) or cache.kv[0].sharding.spec[0] == "expert"


def test_experts_are_sharded_over_the_expert_axis(tiny_cfg, tiny_params):
    mesh = make_mesh({"data": 2, "expert": 4})
    sharded = pdjax.parallel.shard_params(tiny_params, tiny_cfg, mesh)
    w = sharded["layers"][1]["moe"]["w_gate"]
    assert w.sharding.spec[0] == "expert"
    assert w.addressable_shards[0].data.shape[0] == tiny_cfg.n_routed_experts // 4
    assert sharded["layers"][1]["attn"]["wkv_a"].sharding.is_fully_replicated


def test_generate_on_mesh_equals_single_device(tiny_cfg, tiny_params):
    prompts = [list(range(1, 1 + n)) for n in (3, 1, 6, 2, 5, 4, 7, 2)]
    want = pdjax.generate(tiny_params, tiny_cfg, prompts, max_new_tokens=4)
    got = pdjax.generate(tiny_params, tiny_cfg, prompts, max_new_tokens=4, mesh=make_mesh({"data": 2, "expert": 4}))
    assert got == want


def test_dropped_assignments_counted_exactly(tiny_cfg, tiny_params):
    """Every token prefers experts 0 and 1 (both on expert rank 0): with capacity C per
    destination, each device keeps C of its n*k assignments and drops the rest."""
    cfg, X, cf = tiny_cfg, 4, 1.0
    mesh = make_mesh({"data": 2, "expert": X})
    p = dict(tiny_params["layers"][1]["moe"])
    p["router_bias"] = jnp.zeros(cfg.n_routed_experts).at[:2].set(10.0)
    x = jax.random.normal(jax.random.key(5), (32, cfg.hidden_size))
    ep = ExpertParallel(mesh, capacity_factor=cf)
    devices = 8
    n, k = 32 // devices, cfg.num_experts_per_tok
    C = math.ceil(cf * n * k / X)
    y, dropped = jax.jit(lambda p, x: ep_moe(p, cfg, x, ep))(p, x)
    assert int(dropped) == devices * (n * k - C)
    # the kept assignments are exact: compare with a dropless run on tokens whose both
    # assignments were kept (the first C // k tokens of each device keep both)
    y_full, none = jax.jit(lambda p, x: ep_moe(p, cfg, x, ExpertParallel(mesh)))(p, x)
    assert int(none) == 0
    kept = np.concatenate([np.arange(d * n, d * n + C // k) for d in range(devices)])
    np.testing.assert_allclose(np.asarray(y)[kept], np.asarray(y_full)[kept], atol=TOL, rtol=0)


def test_capacity_at_worst_case_equals_dropless(tiny_cfg, tiny_params, tokens, reference):
    mesh = make_mesh({"data": 1, "expert": 8})
    # worst case: all n*k assignments of a device to one rank -> cf = X
    out, stats = pdjax.forward(tiny_params, tiny_cfg, tokens, mesh=mesh, capacity_factor=8.0,
                               return_stats=True)
    np.testing.assert_allclose(out, reference[0], atol=TOL, rtol=0)
    assert int(np.asarray(stats["dropped_per_moe_layer"]).sum()) == 0


def test_drops_are_reported(tiny_cfg, tiny_params, tokens):
    mesh = make_mesh({"data": 1, "expert": 8})
    with pytest.warns(UserWarning, match="dropped"):
        pdjax.forward(tiny_params, tiny_cfg, tokens, mesh=mesh, capacity_factor=0.25)


# ---- bad input ----------------------------------------------------------------------------

def test_mesh_errors():
    with pytest.raises(ValueError, match="needs 4 devices, got 8"):
        make_mesh({"data": 2, "expert": 2})
    with pytest.raises(ValueError, match="positive integer"):
        make_mesh({"data": 0, "expert": 8})
    disjoint = make_mesh({"expert": 4}, devices=jax.devices()[4:])
    assert {d.id for d in disjoint.devices.flat} == {4, 5, 6, 7}


def test_batch_and_expert_divisibility(tiny_cfg, tiny_params):
    mesh = make_mesh({"data": 2, "expert": 4})
    with pytest.raises(ValueError, match="batch 6 does not divide"):
        pdjax.forward(tiny_params, tiny_cfg, np.zeros((6, 3), np.int32), mesh=mesh)
    cfg3 = tiny_cfg.replace(n_routed_experts=12, n_group=4)
    params3 = pdjax.init_params(cfg3, jax.random.key(1))
    with pytest.raises(ValueError, match="do not divide over the expert axes"):
        pdjax.parallel.shard_params(params3, cfg3, make_mesh({"data": 1, "expert": 8}))


def test_rules_are_data_and_checked(tiny_cfg, tiny_params):
    mesh = make_mesh({"data": 2, "expert": 4})
    rules = ShardingRules.default(mesh)
    assert "experts -> expert" in str(rules) and "batch -> data, expert" in str(rules)
    with pytest.raises(ValueError, match="no axis 'model'"):
        pdjax.parallel.shard_params(tiny_params, tiny_cfg, mesh, rules.override(experts="model"))
    with pytest.raises(ValueError, match="unknown logical axis 'bogus'"):
        pdjax.parallel.shard_params(tiny_params, tiny_cfg, mesh, rules.override(bogus="data"))


def test_eplb_placement_from_recorded_routing_runs_exactly(tiny_cfg, tiny_params, tokens, reference):
    """Routing statistics from a real forward -> EPLB (16 physical slots over 8 GPUs) ->
    physical expert params -> EP forward equals the single-device model."""
    from pdjax.parallel import eplb
    counts = eplb.collect_routing_stats(tiny_params, tiny_cfg, tokens)
    phy2log, log2phy, logcnt = eplb.rebalance_experts(counts, num_replicas=16, num_groups=tiny_cfg.n_group,
                                                      num_nodes=2, num_gpus=8)
    assert (logcnt >= 1).all() and logcnt.sum(1).tolist() == [16] * counts.shape[0]
    params = place_experts(tiny_params, phy2log)
    out = pdjax.forward(params, tiny_cfg, tokens, mesh=make_mesh({"data": 1, "expert": 8}))
    np.testing.assert_allclose(out, reference[0], atol=TOL, rtol=0)


@pytest.mark.parametrize("dispatch", ["padded", "ragged-emulated"])
def test_padding_tokens_do_not_count_as_drops(tiny_cfg, tiny_params, dispatch):
    """One real token per device, three padding tokens (valid False). With one row per
    destination rank (padded, cf 0.25: C = ceil(0.25 * 4*2 / 4) = 1), the real token comes
    first in send order, so it loses an assignment exactly when both its experts live on one
    rank; the padding tokens' assignments never count. Dropless (ragged): nothing dropped.
    Kept real tokens equal the single-device experts."""
    cfg = tiny_cfg
    X, E_loc = 4, cfg.n_routed_experts // 4
    mesh = make_mesh({"data": 2, "expert": X})
    p = tiny_params["layers"][1]["moe"]
    x = jax.random.normal(jax.random.key(9), (32, cfg.hidden_size))
    valid = np.arange(32) % 4 == 0                                     # n = 4 tokens per device
    cf = 0.25 if dispatch == "padded" else None
    ep = ExpertParallel(mesh, capacity_factor=cf, dispatch=dispatch)
    y, dropped = jax.jit(lambda p, x, v: ep_moe(p, cfg, x, ep, v))(p, x, jnp.asarray(valid))
    w, idx = pdjax.model.moe.gate(p, cfg, x)
    want = pdjax.model.moe.routed_experts(p, x, w, idx, "tiled")
    same_rank = np.asarray(idx[:, 0] // E_loc == idx[:, 1] // E_loc) & valid
    if dispatch == "padded":
        assert int(dropped) == int(same_rank.sum())
        kept = valid & ~same_rank
    else:
        assert int(dropped) == 0
        kept = valid
    assert kept.any()
    np.testing.assert_allclose(np.asarray(y)[kept], np.asarray(want)[kept], atol=TOL, rtol=0)


def test_padding_never_takes_capacity_from_real_tokens(tiny_cfg, tiny_params):
    """Real tokens keep exactly the same assignments (and outputs) whether the padding on
    their device comes before or after them."""
    cfg = tiny_cfg
    mesh = make_mesh({"data": 1, "expert": 8})
    p = tiny_params["layers"][1]["moe"]
    x = jax.random.normal(jax.random.key(4), (32, cfg.hidden_size))
    ep = ExpertParallel(mesh, capacity_factor=1.0)
    run = jax.jit(chex.assert_max_traces(lambda p, x, v: ep_moe(p, cfg, x, ep, v), n=1))   # one program for both masks
    first = np.tile([False, False, True, True], 8)                    # per device: padding, then real
    last = np.tile([True, True, False, False], 8)
    perm = np.concatenate([np.r_[4 * d + 2, 4 * d + 3, 4 * d, 4 * d + 1] for d in range(8)])
    y1, d1 = run(p, x, jnp.asarray(first))
    y2, d2 = run(p, x[perm], jnp.asarray(last))
    assert int(d1) == int(d2)
    np.testing.assert_array_equal(np.asarray(y1)[first], np.asarray(y2)[last])


@pytest.mark.parametrize("dispatch", ["padded", "ragged-emulated"])
def test_routing_computed_elsewhere_gives_the_same_layer(tiny_cfg, tiny_params, dispatch):
    """ep_moe with the routing handed in (AF disaggregation routes on the attention side)
    equals ep_moe routing on each rank, padding masked the same way."""
    cfg = tiny_cfg
    mesh = make_mesh({"expert": 4}, jax.devices()[:4])
    p = tiny_params["layers"][1]["moe"]
    x = jax.random.normal(jax.random.key(5), (16, cfg.hidden_size))
    valid = jnp.asarray(np.arange(16) % 3 != 0)
    ep = ExpertParallel(mesh, dispatch=dispatch)
    here = jax.jit(lambda p, x, v: ep_moe(p, cfg, x, ep, v))(p, x, valid)
    given = jax.jit(lambda p, x, v: ep_moe(p, cfg, x, ep, v, routing=pdjax.model.moe.route(p, cfg, x, v)))(p, x, valid)
    np.testing.assert_array_equal(np.asarray(given[0]), np.asarray(here[0]))
    assert int(given[1]) == int(here[1]) == 0
