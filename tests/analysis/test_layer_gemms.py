"""The one description of a layer's matmuls (pdjax.analysis.layer_gemms), held against the
model's own parameter tree (``jax.eval_shape`` of ``pdjax.init_params``, nothing allocated)
and pdjax.param_counts: every weight matrix of a layer is the weight of exactly one GEMM of
its block, and a token does 2 FLOPs per weight element it multiplies with (all of them once,
the routed experts' top-k of E), in both MLA forms.

Who reads the description (the op model, the training pair, the pipeline costs, the roofline
cost model's kv_b) is held to its own numbers in their tests."""

import functools

import jax
import numpy as np
import pytest

import pdjax
from pdjax.analysis.layer_gemms import (FORMS, ROWS, attention_gemms, head_gemms, layer_gemms, matmul_flops,
                                        mtp_gemms, weight_elements)
from pdjax.param_counts import layer_params

CONFIGS = {
    "tiny": lambda: pdjax.configs.tiny(num_nextn_predict_layers=1),
    "small": pdjax.configs.small,
    "deepseek_v2_lite": pdjax.configs.deepseek_v2_lite,          # no q LoRA
    "deepseek_v2": pdjax.configs.deepseek_v2,
    "deepseek_v3": pdjax.configs.deepseek_v3,                    # one MTP depth
    "v3_no_shared": lambda: pdjax.configs.deepseek_v3(n_shared_experts=0),
    "moe_every_2nd": lambda: pdjax.configs.tiny(num_hidden_layers=6, moe_layer_freq=2, num_nextn_predict_layers=2),
    "small_plain_q_no_shared": lambda: pdjax.configs.small(q_lora_rank=None, n_shared_experts=0),
}
if hasattr(pdjax.configs, "deepseek_v32"):                     # sparse attention: the indexer's GEMMs
    CONFIGS["deepseek_v32"] = pdjax.configs.deepseek_v32
TOKENS = 7


@functools.lru_cache(maxsize=None)
def _model(name: str):
    cfg = CONFIGS[name]()
    return cfg, jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))


def _block(keys: tuple) -> str:
    """The layer block a weight of the model's tree belongs to, by where it sits."""
    if keys[0] == "attn":
        return "indexer" if keys[1] == "indexer" else "attention"
    if keys[0] == "moe":
        return keys[1] if keys[1] in ("router", "shared") else "routed"
    assert keys[0] == "mlp", keys
    return "dense_mlp"


def _tree_weights(cfg, layer_tree) -> tuple[dict, dict, int]:
    """From a layer's parameter tree: {block: weight-matrix elements held}, {block: elements a
    token multiplies with} (a routed expert stack [E, ...]: top-k of E) and all elements
    (matrices, norms and biases)."""
    held, used, total = {}, {}, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(layer_tree):
        size = int(np.prod(leaf.shape))
        total += size
        if leaf.ndim < 2:                       # norms, biases: no matmul
            continue
        block = _block(tuple(p.key for p in path))
        if block == "routed":
            assert leaf.shape[0] == cfg.n_routed_experts
        per_token = size // cfg.n_routed_experts * cfg.num_experts_per_tok if block == "routed" else size
        held[block] = held.get(block, 0) + size
        used[block] = used.get(block, 0) + per_token
    return held, used, total


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_weight_matrix_is_one_gemm_and_a_token_multiplies_each_once(name, form):
    """Every decoder layer and MTP block, block by block: the GEMMs' weights are the tree's
    matrices, and ``TOKENS`` tokens (nothing cached) do 2 FLOPs per element each uses."""
    cfg, tree = _model(name)
    L = cfg.num_hidden_layers
    for layer in range(L + cfg.num_nextn_predict_layers):
        layer_tree = tree["layers"][layer] if layer < L else tree["mtp"][layer - L]["layer"]
        held, used, total = _tree_weights(cfg, layer_tree)
        assert total == layer_params(cfg, layer), layer       # param_counts' layer is this tree
        gemms = layer_gemms(cfg, layer, form)
        assert {g.block for g in gemms} == set(held), (layer, {g.block for g in gemms}, set(held))
        for block in held:
            mine = [g for g in gemms if g.block == block]
            assert weight_elements(cfg, mine) == held[block], (layer, block)
            assert matmul_flops(cfg, mine, TOKENS) == 2 * TOKENS * used[block], (layer, block)
        assert matmul_flops(cfg, gemms, TOKENS) == 2 * TOKENS * sum(used.values())
        assert all(g.rows in ROWS and g.n > 0 and g.k > 0 for g in gemms)
        assert len({g.name for g in gemms}) == len(gemms)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_head_and_the_mtp_projection(name):
    cfg, tree = _model(name)
    head = int(np.prod(tree["lm_head"].shape))
    assert weight_elements(cfg, head_gemms(cfg)) == head
    assert matmul_flops(cfg, head_gemms(cfg), TOKENS) == 2 * TOKENS * head
    for depth in tree.get("mtp", []):
        proj = int(np.prod(depth["eh_proj"].shape))
        assert weight_elements(cfg, mtp_gemms(cfg)) == proj
        assert matmul_flops(cfg, mtp_gemms(cfg), TOKENS) == 2 * TOKENS * proj


def test_only_the_naive_kv_b_grows_with_the_cache():
    """Naive MLA expands every attended latent (new and cached) through kv_b; the absorbed
    form's per-head products run on the new tokens alone, on the same weights."""
    cfg = pdjax.configs.deepseek_v3()
    naive, absorbed = attention_gemms(cfg, "naive"), attention_gemms(cfg, "absorbed")
    (kv_b,) = [g for g in naive if g.rows == "attended"]
    cached = 4096
    assert (matmul_flops(cfg, naive, TOKENS, TOKENS + cached) - matmul_flops(cfg, naive, TOKENS)
            == 2 * cached * weight_elements(cfg, [kv_b]))
    assert matmul_flops(cfg, absorbed, TOKENS, TOKENS + cached) == matmul_flops(cfg, absorbed, TOKENS)
    assert weight_elements(cfg, naive) == weight_elements(cfg, absorbed)
    assert kv_b.transposed().n == kv_b.k and kv_b.transposed().k == kv_b.n
    with pytest.raises(ValueError, match="form must be one of"):
        attention_gemms(cfg, "mha")
