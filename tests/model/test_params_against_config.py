"""Params, caches and configs held against each other before any compute: params of another
vocabulary, width, layer or expert count, and caches of another layer count or latent width,
are refused naming the first leaf that differs (they ran, clamped or cut, or failed deep in
XLA before); an EPLB-placed tree (physical experts and its tables) is accepted."""

import jax
import numpy as np
import pytest

import pdjax
from pdjax.model import checks


@pytest.fixture(scope="module")
def setup(tiny_cfg, tiny_params):
    tokens = np.zeros((1, 4), np.int32)
    _, cache = pdjax.prefill(tiny_params, tiny_cfg, tokens, max_len=8)
    return tiny_cfg, tiny_params, tokens, cache


@pytest.mark.parametrize("change, match", [
    ({"vocab_size": 300}, r"params\['embed'\] has shape \(300, 64\), cfg gives \(256, 64\)"),
    ({"hidden_size": 32}, r"params\['embed'\] has shape \(256, 32\)"),
    ({"num_hidden_layers": 4}, r"params\['layers'\] holds 4 entries, cfg gives 3 \(cfg.num_hidden_layers\)"),
    ({"n_routed_experts": 16}, r"\['moe'\]\['router'\] has shape \(64, 16\), cfg gives \(64, 8\)"),
])
def test_params_of_another_config_are_refused_before_compute(setup, change, match, compile_counter):
    cfg, _, tokens, cache = setup
    other = pdjax.init_params(cfg.replace(**change), jax.random.key(0))
    for call in (lambda: pdjax.forward(other, cfg, tokens), lambda: pdjax.prefill(other, cfg, tokens),
                 lambda: pdjax.decode_step(other, cfg, np.zeros(1, np.int32), cache),
                 lambda: pdjax.generate(other, cfg, [[1, 2]], max_new_tokens=2)):
        with compile_counter() as compiles, pytest.raises(ValueError, match=match):
            call()
        assert compiles.count == 0           # refused before any compute


@pytest.mark.parametrize("change, match", [
    ({"num_hidden_layers": 4}, "the cache holds 4 layers, cfg.num_hidden_layers=3"),
    ({"kv_lora_rank": 16}, r"latent width kv_lora_rank \+ qk_rope_head_dim = 40"),
])
def test_a_cache_of_another_config_is_refused(setup, change, match):
    cfg, params, tokens, _ = setup
    other_cfg = cfg.replace(**change)
    _, other = pdjax.prefill(pdjax.init_params(other_cfg, jax.random.key(0)), other_cfg, tokens, max_len=8)
    with pytest.raises(ValueError, match=match):
        pdjax.decode_step(params, cfg, np.zeros(1, np.int32), other)
    with pytest.raises(ValueError, match=match):
        pdjax.prefill(params, cfg, tokens, cache=other)


def test_integer_params_and_foreign_trees_are_refused(setup):
    cfg, params, tokens, _ = setup
    ints = {**params, "embed": params["embed"].astype(np.int32)}
    with pytest.raises(TypeError, match=r"params\['embed'\] must be a floating array"):
        pdjax.forward(ints, cfg, tokens)
    with pytest.raises(ValueError, match=r"params holds .*'extra'"):
        pdjax.forward({**params, "extra": params["embed"]}, cfg, tokens)
    with pytest.raises(TypeError, match="params must be the dict"):
        pdjax.forward(list(params.values()), cfg, tokens)


def test_the_check_is_made_once_per_structure(setup, monkeypatch):
    cfg, params, tokens, _ = setup
    pdjax.forward(params, cfg, tokens)
    calls = []
    monkeypatch.setattr(checks, "_compare", lambda *a: calls.append(a))
    pdjax.forward(params, cfg, tokens)
    assert calls == []            # the same (cfg, structure, shapes): not compared again
