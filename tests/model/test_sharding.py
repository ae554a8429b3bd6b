"""The model owns its sharding: every weight's logical axes are declared where it is made
(pdjax/model/sharding.py), a weight without a declaration fails naming it, the default
placement is ShardingRules.default's, the rules and the params' shardings are declared once
(pdjax.parallel's are the model's), and pdjax.model never imports pdjax.parallel."""

import ast
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pdjax
from pdjax.model import mla, params as model_params, sharding

CONFIGS = {
    "v3": pdjax.configs.tiny(),                                         # q LoRA, router bias, shared experts
    "v2": pdjax.configs.tiny(q_lora_rank=None, topk_method="greedy", scoring_func="softmax",
                             n_shared_experts=0, n_group=1, topk_group=1, model_type="deepseek_v2"),
    "v3_large": pdjax.configs.deepseek_v3(),                           # traced only
    "v32": pdjax.configs.tiny_v32(),                                    # the sparse-attention indexer
    "v32_large": pdjax.configs.deepseek_v32(),                         # traced only
}


def _is_axes(x):
    return isinstance(x, tuple)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_param_declares_its_logical_axes(name):
    """param_axes is a tree like the params, one known name (or None) per dim of each weight;
    "experts" is on exactly the routed experts' stacking dim (the router stays whole)."""
    cfg = CONFIGS[name]
    shapes = jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))
    axes = model_params.param_axes(cfg)
    assert jax.tree.structure(axes, is_leaf=_is_axes) == jax.tree.structure(shapes)
    experts = []
    for (path, ax), leaf in zip(jax.tree_util.tree_flatten_with_path(axes, is_leaf=_is_axes)[0],
                                jax.tree.leaves(shapes)):
        assert len(ax) == leaf.ndim, (sharding.path_name(path), ax, leaf.shape)
        assert all(a is None or a in sharding.LOGICAL_AXES for a in ax), ax
        if "experts" in ax:
            experts.append(sharding.path_name(path))
            assert ax.index("experts") == 0 and leaf.shape[0] == cfg.n_routed_experts
    moe = [f"layers/{i}" for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    moe += [f"mtp/{j}/layer" for j in range(cfg.num_nextn_predict_layers)       # the MTP blocks' experts too
            if cfg.is_moe_layer(cfg.num_hidden_layers + j)]
    assert sorted(experts) == sorted(f"{at}/moe/{w}" for at in moe for w in ("w_gate", "w_up", "w_down"))


def test_a_param_without_a_declaration_is_named(tiny_cfg, tiny_params, monkeypatch):
    """A weight added to a params tree without logical axes: the mapping to shardings
    (model and parallel) raises naming it, never replicates it silently; and a weight an
    init function makes without declare() fails init_params, naming it."""
    from pdjax.parallel import make_mesh, param_shardings

    mesh = make_mesh({"data": 2, "expert": 4})
    layers = list(tiny_params["layers"])
    layers[1] = {**layers[1], "attn": {**layers[1]["attn"], "w_extra": np.zeros((4, 4), np.float32)}}
    extended = {**tiny_params, "layers": layers}
    with pytest.raises(ValueError, match="layers/1/attn/w_extra has no logical-axis declaration"):
        model_params.param_logical_axes(extended, tiny_cfg)
    with pytest.raises(ValueError, match="layers/1/attn/w_extra has no logical-axis declaration"):
        param_shardings(extended, tiny_cfg, mesh)
    with pytest.raises(ValueError, match="lm_head has shape"):            # a declared weight of another rank
        param_shardings({**tiny_params, "lm_head": np.zeros((2, 2, 2), np.float32)}, tiny_cfg, mesh)

    real = mla.attention_weights
    monkeypatch.setattr(mla, "attention_weights",
                        lambda cfg, key, dtype: {**real(cfg, key, dtype), "w_extra": jax.numpy.zeros((4, 4))})
    with pytest.raises(ValueError, match="layers/0/attn/w_extra has no logical-axis declaration"):
        pdjax.init_params(tiny_cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="layers/0/attn/w_extra has no logical-axis declaration"):
        pdjax.init_params(tiny_cfg, jax.random.key(0), mesh=mesh)


def test_parts_of_the_params_map_and_the_default_placement_is_sharding_rules_default(tiny_cfg, tiny_params):
    """Parts of the params (a pipeline stage's layers, the FFN side's routed experts) and
    EPLB-placed params map by path; without rules every param is placed as
    ShardingRules.default does (routed experts over the expert axis, the rest whole), on
    meshes with and without an expert axis; pdjax.parallel's rules and functions are the
    model's, declared once."""
    from pdjax import parallel
    from pdjax.parallel import ShardingRules, make_mesh, param_shardings, place_experts

    assert ShardingRules is sharding.ShardingRules and param_shardings is model_params.param_shardings
    assert parallel.param_logical_axes is model_params.param_logical_axes
    shapes = jax.eval_shape(lambda: tiny_params)
    for axes in ({"data": 2, "expert": 4}, {"expert": 8}, {"data": 8}):
        mesh = make_mesh(axes)
        got = param_shardings(shapes, tiny_cfg, mesh)
        assert got == param_shardings(shapes, tiny_cfg, mesh, ShardingRules.default(mesh))
        expert = "expert" if "expert" in axes else None
        for (path, ax), s in zip(jax.tree_util.tree_flatten_with_path(model_params.param_axes(tiny_cfg),
                                                                      is_leaf=_is_axes)[0], jax.tree.leaves(got)):
            assert s.spec == P(*(expert if a == "experts" else None for a in ax)), sharding.path_name(path)
    mesh = make_mesh({"data": 2, "expert": 4})
    stage = {"layers": tiny_params["layers"][1:], "lm_head": tiny_params["lm_head"]}
    got = param_shardings(stage, tiny_cfg, mesh)
    assert got["layers"][0]["moe"]["w_up"].spec == P("expert", None, None)
    assert got["layers"][0]["moe"]["router"].is_fully_replicated
    routed = {"layers": [{"moe": {"w_down": lp["moe"]["w_down"]}} if "moe" in lp else {} for lp in tiny_params["layers"]]}
    assert param_shardings(routed, tiny_cfg, mesh)["layers"][1]["moe"]["w_down"].spec == P("expert", None, None)
    E, n_moe = tiny_cfg.n_routed_experts, sum("moe" in lp for lp in tiny_params["layers"])
    placed = place_experts(tiny_params, np.tile(np.concatenate([np.arange(E), np.arange(E)]), (n_moe, 1)))
    tables = param_shardings(placed, tiny_cfg, mesh)["layers"][1]["moe"]
    assert tables["log2phy"].is_fully_replicated and tables["logcnt"].is_fully_replicated
    assert tables["w_gate"].spec == P("expert", None, None)


def test_model_never_imports_parallel():
    """No module under pdjax/model imports pdjax.parallel, at any depth (function-level too)."""
    root = pathlib.Path(pdjax.__file__).parent
    found = []
    for path in sorted((root / "model").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert not node.level, f"{path}: relative import"
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.name}:{node.lineno} {n}" for n in names if n == "pdjax.parallel" or
                      n.startswith("pdjax.parallel.") or n == "pdjax.api"]
    assert not found, found
