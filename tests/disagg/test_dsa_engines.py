"""DeepSeek-V3.2's sparse attention served: PDEngine (prefix cache off and on), ColocatedEngine,
AFDEngine and two processes give pdjax.generate's tokens, and the handoff carries every
layer's rows with the indexer's keys beside the latents (``tiny_v32``: 8 tokens selected,
prompts up to 40 tokens, so the decode attends sparsely)."""

import jax
import numpy as np
import pytest

import pdjax
from child_env import CHILD_ENV
from faults import alive, assert_nothing_held, free_blocks
from pdjax.disagg import AFDEngine, ColocatedEngine, PDEngine, launch_pd

CFG = pdjax.configs.tiny_v32()
NEW = 6


@pytest.fixture(scope="module")
def params():
    return pdjax.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(0)
    system = [int(t) for t in rng.randint(0, CFG.vocab_size, 20)]
    out = [[int(t) for t in rng.randint(0, CFG.vocab_size, n)] for n in (1, 7, 40)]
    return out + [system + [1, 2, 3], system + [4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def expected(params, prompts):
    want = pdjax.generate(params, CFG, prompts, max_new_tokens=NEW)
    dense = pdjax.generate(params, CFG.replace(index_topk=4096), prompts, max_new_tokens=NEW)
    assert want != dense                 # the selection changes the tokens
    return want


def _row_bytes():
    """Bytes one prompt token's rows cost on the link: every layer's [latent | rope key |
    indexer key] in the cache dtype."""
    return CFG.num_hidden_layers * (CFG.kv_lora_rank + CFG.qk_rope_head_dim + CFG.index_head_dim) \
        * np.dtype(CFG.kv_cache_dtype).itemsize


def test_pd_with_and_without_the_prefix_cache(params, prompts, expected):
    for cache in (False, True):
        eng = PDEngine(params, CFG, prefill_devices=jax.devices()[:2], decode_devices=jax.devices()[2:6],
                       decode_mesh={"data": 2, "expert": 2}, max_context=64, block_size=8, prefix_cache=cache)
        free = free_blocks(eng)
        for round_ in range(2 if cache else 1):
            assert eng.generate(prompts, NEW) == expected, (cache, round_)
            assert eng.stats["kv_bytes_sent"] == sum(map(len, prompts)) * _row_bytes()
        assert_nothing_held(eng, free)
    assert [r["prefix_hit_tokens"] for r in eng.stats["requests"]] == [0, 0, 32, 16, 24]


def test_colocated_and_afd(params, prompts, expected):
    col = ColocatedEngine(params, CFG, devices=jax.devices()[:4], mesh={"expert": 4}, max_context=64)
    assert col.generate(prompts, NEW) == expected
    afd = AFDEngine(params, CFG, attention_devices=jax.devices()[:2], ffn_devices=jax.devices()[2:4], max_context=64)
    assert afd.generate(prompts, NEW) == expected


def test_two_processes(prompts, expected):
    srv = launch_pd("tiny_v32", 0, prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2}, block_size=8,
                    max_decode_slots=4, max_context=64, env=CHILD_ENV, startup_timeout=60)
    try:
        assert srv.generate(prompts, NEW) == expected
    finally:
        srv.close()
    assert not any(alive(p) for p in srv.procs.started)
