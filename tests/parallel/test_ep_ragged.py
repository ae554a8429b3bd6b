"""The dropless ragged_all_to_all + ragged_dot expert-parallel path.

XLA:CPU has no ragged-all-to-all, so the path runs here with ``dispatch="ragged-emulated"``
(the same code with the collective swapped for an all_gather twin, itself checked against
the example in jax.lax.ragged_all_to_all's documentation), and the real path is checked by
lowering it for CUDA and TPU: two ragged_all_to_all collectives over the expert-axis groups,
three ragged_dot grouped GEMMs, no padded [X, C, D] all_to_all."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pdjax
from pdjax.parallel import ExpertParallel, ep_moe, make_mesh
from pdjax.parallel.ep_ragged import ragged_all_to_all_emulated

TOL = 1e-5


def test_emulated_collective_reproduces_the_documented_example():
    """jax.lax.ragged_all_to_all's docstring: axis of size 2, results [1,3,0,0] and [2,2,4,0]."""
    mesh = make_mesh({"x": 2}, devices=jax.devices()[:2])
    args = [np.array(a, np.int32) for a in (
        [[1, 2, 2], [3, 4, 0]],            # operand
        [[0, 0, 0, 0], [0, 0, 0, 0]],      # output
        [[0, 1], [0, 1]],                  # input_offsets
        [[1, 2], [1, 1]],                  # send_sizes
        [[0, 0], [1, 2]],                  # output_offsets
        [[1, 1], [2, 1]],                  # recv_sizes
    )]
    args = [jax.device_put(a.reshape(-1), NamedSharding(mesh, P("x"))) for a in args]

    def f(*a):
        return ragged_all_to_all_emulated(*a, axis_name="x")

    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))(*args)
    assert np.asarray(out).reshape(2, 4).tolist() == [[1, 3, 0, 0], [2, 2, 4, 0]]


@pytest.mark.parametrize("axes,overlap", [({"data": 2, "expert": 4}, None), ({"data": 1, "expert": 8}, "dbo")],
                         ids=["data2xexpert4", "data1xexpert8-dbo"])
def test_ragged_path_equals_single_device(tiny_cfg, tiny_params, case, axes, overlap):
    toks, full, pre, step = case
    mesh = make_mesh(axes)
    kw = dict(mesh=mesh, overlap=overlap, dispatch="ragged-emulated")
    out, stats = pdjax.forward(tiny_params, tiny_cfg, toks, return_stats=True, **kw)
    np.testing.assert_allclose(out, full, atol=TOL, rtol=0)
    assert np.asarray(stats["dropped_per_moe_layer"]).tolist() == [0, 0]
    logits, cache = pdjax.prefill(tiny_params, tiny_cfg, toks[:, :5], max_len=8, **kw)
    np.testing.assert_allclose(logits, pre, atol=TOL, rtol=0)
    got, _ = pdjax.decode_step(tiny_params, tiny_cfg, toks[:, 5], cache, **kw)
    np.testing.assert_allclose(got, step, atol=TOL, rtol=0)


def test_ragged_path_with_skewed_routing_and_replicas(tiny_cfg, tiny_params):
    """All tokens prefer experts 0 and 1 (one rank receives everything: the worst case the
    buffer is sized for), and with EPLB-style replicas; equal to the padded dropless path."""
    from pdjax.parallel import place_experts
    cfg = tiny_cfg
    mesh = make_mesh({"data": 2, "expert": 4})
    x = jax.random.normal(jax.random.key(5), (32, cfg.hidden_size))
    p = dict(tiny_params["layers"][1]["moe"])
    p["router_bias"] = jnp.zeros(cfg.n_routed_experts).at[:2].set(10.0)
    E = cfg.n_routed_experts
    phy2log = np.concatenate([np.arange(E), np.array([0, 1] * (E // 2))])[None]
    layer = {**tiny_params["layers"][1], "moe": p}
    replicated = place_experts({"layers": [layer]}, phy2log)["layers"][0]["moe"]
    for params in (p, replicated):
        run = [jax.jit(lambda p, x, d=d: ep_moe(p, cfg, x, ExpertParallel(mesh, dispatch=d)))(params, x)
               for d in ("padded", "ragged-emulated")]
        np.testing.assert_allclose(run[1][0], run[0][0], atol=TOL, rtol=0)
        assert int(run[1][1]) == 0


def _lowered_text(cfg, params, platform, **ep_kw):
    mesh = make_mesh({"data": 2, "expert": 4})
    ep = ExpertParallel(mesh, target_platform=platform, **ep_kw)
    x = jnp.zeros((32, cfg.hidden_size), jnp.float32)
    f = jax.jit(lambda p, x: ep_moe(p, cfg, x, ep))
    exported = jax.export.export(f, platforms=[platform], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(params["layers"][1]["moe"], x)
    return ep, exported.mlir_module()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_auto_selects_ragged_on_gpu_and_tpu_and_lowers(tiny_cfg, tiny_params, platform):
    ep, text = _lowered_text(tiny_cfg, tiny_params, platform)
    assert ep.dispatch_impl == "ragged"
    calls = re.findall(r"custom_call @ragged_all_to_all\((.*?)\).*?replica_groups = dense<(.*?)>.*?-> tensor<(\w+)>",
                       text)
    assert len(calls) == 2                                          # dispatch and combine
    D, n, k, X = tiny_cfg.hidden_size, 32 // 8, tiny_cfg.num_experts_per_tok, 4
    assert all(groups == "[[0, 1, 2, 3], [4, 5, 6, 7]]" for _, groups, _ in calls)   # the expert axis
    # dispatch writes into the worst-case buffer of X*n*k rows; combine back into n*k rows
    assert sorted(out for _, _, out in calls) == sorted([f"{X * n * k}x{D}xf32", f"{n * k}x{D}xf32"])
    assert len(re.findall(r'composite "chlo.ragged_dot"', text)) == 3   # gate, up, down
    # the only dense all_to_alls left carry per-rank counts and offsets, never hidden-size rows
    dense = re.findall(r'"stablehlo\.all_to_all".*?-> (tensor<[^>]*>)', text)
    assert sorted(dense) == sorted([f"tensor<{X}x{tiny_cfg.n_routed_experts // X}xi32>",
                                    f"tensor<{X}xi32>", f"tensor<{X}xi32>"])


def test_auto_keeps_padded_path_with_a_capacity_factor_or_on_cpu(tiny_cfg, tiny_params):
    mesh = make_mesh({"data": 2, "expert": 4})
    assert ExpertParallel(mesh).dispatch_impl == "padded"          # XLA:CPU
    ep, text = _lowered_text(tiny_cfg, tiny_params, "cuda", capacity_factor=1.25)
    assert ep.dispatch_impl == "padded" and "ragged_all_to_all" not in text


def test_bad_dispatch_choices():
    mesh = make_mesh({"data": 2, "expert": 4})
    with pytest.raises(ValueError, match="XLA:CPU does not implement"):
        ExpertParallel(mesh, dispatch="ragged")
    with pytest.raises(ValueError, match="dropless; capacity_factor must be None"):
        ExpertParallel(mesh, dispatch="ragged-emulated", capacity_factor=1.0)
    with pytest.raises(ValueError, match="unknown dispatch 'nccl'"):
        ExpertParallel(mesh, dispatch="nccl")
