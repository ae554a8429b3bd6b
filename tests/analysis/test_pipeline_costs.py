"""The per-stage cost model of a pipeline derived from a ModelConfig
(pdjax.analysis.pipeline_costs), and its MTP term: with mtp_weight > 0 every stage holding the
LM head grows by exactly the MTP modules' derived cost, and nothing else changes.

The executor-side evidence (its placed params equal these param bytes, its measured memory
with MTP equals the simulation, XLA's FLOP counts of its programs against these FLOPs) is in
tests/pipeline/test_mtp_pipeline.py."""

import dataclasses
import math

import numpy as np
import pytest

import pdjax
from pdjax.analysis.kernels import causal_attention_flops
from pdjax.analysis.pipeline_costs import (StageTerm, layer_term, mtp_depth_term, mtp_term, pipeline_costs)
from pdjax.param_counts import layer_params, mtp_depth_params, param_counts
from pdjax.schedules import build

WEIGHT = 0.3
ROWS, SEQ = 2, 16
# (schedule, ranks, micro-batches, the stages holding the LM head, their ranks)
LAYOUTS = [("1f1b", 4, 8, (3,), (3,)), ("zb1p", 4, 8, (3,), (3,)), ("interleaved-1f1b", 2, 4, (3,), (1,)),
           ("dualpipe", 4, 8, (3, 7), (3, 0)), ("dualpipev", 4, 8, (7,), (0,))]


@pytest.fixture(scope="module")
def cfg():
    """Eight layers (the first dense), two MTP depths (MoE blocks)."""
    return pdjax.configs.tiny(num_hidden_layers=8, num_nextn_predict_layers=2)


def _active_matmul_params(cfg, layer: int) -> int:
    """The weights one token multiplies with in ``layer`` (param_counts' per-layer count less
    the norms, the router bias and the routed experts it does not use)."""
    d, q, c = cfg.hidden_size, cfg.q_lora_rank or 0, cfg.kv_lora_rank
    n = layer_params(cfg, layer) - 2 * d - q - c
    if cfg.is_moe_layer(layer):
        expert = 3 * d * cfg.moe_intermediate_size
        n -= (cfg.n_routed_experts - cfg.num_experts_per_tok) * expert
        n -= cfg.n_routed_experts if cfg.topk_method == "noaux_tc" else 0
    return n


@pytest.mark.parametrize("name, ranks, m, heads, head_ranks", LAYOUTS)
def test_the_head_stages_grow_by_exactly_the_mtp_term(cfg, name, ranks, m, heads, head_ranks):
    s = build(name, ranks, m)
    off = pipeline_costs(cfg, s, (ROWS, SEQ))
    on = pipeline_costs(cfg, s, (ROWS, SEQ), mtp_weight=WEIGHT)
    term = mtp_term(cfg, ROWS, SEQ)
    assert on.head_stages == off.head_stages == heads
    assert tuple(s.layout.stage_rank[h] for h in heads) == head_ranks
    assert on.mtp == term and off.mtp == StageTerm()
    assert term.F > 0 and term.activation_bytes > 0 and term.param_bytes > 0
    for stage, (a, b) in enumerate(zip(off.terms, on.terms)):
        assert b == (a + term if stage in heads else a), stage
    # and so for every per-stage array the simulator gets
    for key in ("F", "B", "W", "activation_bytes", "param_bytes"):
        grow = np.zeros(s.num_stages)
        grow[list(heads)] = getattr(term, key)
        np.testing.assert_array_equal(getattr(on, key), getattr(off, key) + grow, err_msg=key)


def test_the_mtp_term_is_derived_from_the_config(cfg):
    """Per depth k on rows x (T - k) tokens: eh_proj [2D, D], one decoder block of layer index
    L + k - 1 and a second LM head; weight FLOPs = 2 x tokens x the weights a token multiplies
    with (from param_counts), the attention core the causal count; params = param_counts' MTP
    modules plus the embedding copy."""
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    total = StageTerm()
    for k in (1, 2):
        t = SEQ - k
        n = ROWS * t
        depth = mtp_depth_term(cfg, k, ROWS, SEQ)
        assert depth.W == 2 * n * (_active_matmul_params(cfg, L + k - 1) + 2 * D * D + D * V)
        assert depth.F - depth.W == ROWS * causal_attention_flops(cfg, [(t, 0)])
        assert depth.B == 2 * depth.F
        assert depth.param_bytes == 4 * mtp_depth_params(cfg, k)
        # the block is a decoder layer like the model's own MoE layers, on T - k positions
        block = layer_term(cfg, L + k - 1, ROWS, t)
        assert dataclasses.astuple(block) == dataclasses.astuple(layer_term(cfg, 1, ROWS, t))
        # held: the block's, the head's (two norm inputs of D, float32 logits), eh_proj's 3D
        assert depth.activation_bytes == block.activation_bytes + n * (4 * 2 * D + 4 * V) + n * 4 * 3 * D
        total = total + depth
    term = mtp_term(cfg, ROWS, SEQ)
    assert term == total + StageTerm(param_bytes=4 * V * D)
    assert term.param_bytes == 4 * (param_counts(cfg).mtp + param_counts(cfg).embedding)
    # per token of a micro-batch: twice the rows, twice every amount
    assert dataclasses.astuple(mtp_term(cfg, 2 * ROWS, SEQ)) == tuple(2 * x if i < 4 else x for i, x in
                                                                        enumerate(dataclasses.astuple(term)))
    # bfloat16 params and activations: half the bytes, the same FLOPs
    half = mtp_term(cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16"), ROWS, SEQ)
    assert (half.F, half.B, half.W) == (term.F, term.B, term.W) and half.param_bytes == term.param_bytes / 2


def test_mtp_weight_zero_is_the_model_without_mtp(cfg):
    s = build("zb1p", 4, 8)
    plain = pipeline_costs(cfg.replace(num_nextn_predict_layers=0), s, (ROWS, SEQ))
    assert pipeline_costs(cfg, s, (ROWS, SEQ), mtp_weight=0.0).terms == plain.terms


def test_a_one_stage_pipeline_does_not_count_the_embedding_twice(cfg):
    s = build("1f1b", 1, 2)
    off, on = pipeline_costs(cfg, s, (ROWS, SEQ)), pipeline_costs(cfg, s, (ROWS, SEQ), mtp_weight=WEIGHT)
    assert on.terms[0] == off.terms[0] + mtp_term(cfg, ROWS, SEQ, embedding=False)


def test_layers_per_stage_moves_layers_not_the_mtp_term(cfg):
    s = build("1f1b", 4, 8)
    even = pipeline_costs(cfg, s, (ROWS, SEQ), mtp_weight=WEIGHT)
    light = pipeline_costs(cfg, s, (ROWS, SEQ), mtp_weight=WEIGHT, layers_per_stage=[3, 2, 2, 1])
    assert [c.stop - c.start for c in light.chunks] == [3, 2, 2, 1]
    assert light.F[3] < even.F[3] and light.mtp == even.mtp


@pytest.mark.parametrize("name, ranks, m, heads, head_ranks", LAYOUTS)
def test_the_simulated_step_carries_the_mtp_work_on_the_head_ranks(cfg, name, ranks, m, heads, head_ranks):
    """Predicted busy time and peak memory: the head ranks grow by the MTP term (per
    micro-batch through a head stage), the other ranks keep theirs (a rank's peak depends
    only on its op order), and the step takes no less time."""
    s = build(name, ranks, m)
    off = pipeline_costs(cfg, s, (ROWS, SEQ))
    on = pipeline_costs(cfg, s, (ROWS, SEQ), mtp_weight=WEIGHT)
    rate = 1e6
    t_off, t_on = off.simulate(flop_rate=rate), on.simulate(flop_rate=rate)
    term = on.mtp
    per_rank = np.zeros(s.num_ranks)
    for h in heads:
        per_rank[s.layout.stage_rank[h]] += s.layout.pipeline_of_stage(h).num_microbatches * (term.F + term.B) / rate
    np.testing.assert_allclose(t_on.busy, t_off.busy + per_rank, rtol=1e-12)
    assert t_on.makespan >= t_off.makespan and t_on.bubble_ratio != t_off.bubble_ratio
    others = [r for r in range(s.num_ranks) if r not in head_ranks]
    np.testing.assert_array_equal(t_on.peak_memory[others], t_off.peak_memory[others])
    assert np.all(t_on.peak_memory[list(head_ranks)] > t_off.peak_memory[list(head_ranks)])
    np.testing.assert_array_equal(on.rank_param_bytes() - off.rank_param_bytes(),
                                  np.bincount(head_ranks, minlength=s.num_ranks) * term.param_bytes)
    np.testing.assert_array_equal(on.peak_bytes(t_on), on.rank_param_bytes() + t_on.peak_memory)
    if name == "1f1b":      # one stage per rank: the head rank holds its peak units x the term more
        units = t_on.peak_activations[head_ranks[0]]
        assert t_on.peak_memory[head_ranks[0]] - t_off.peak_memory[head_ranks[0]] == units * term.activation_bytes


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(mtp_weight=-0.3), ValueError, "mtp_weight must be >= 0, got -0.3"),
    (dict(mtp_weight=math.nan), ValueError, "mtp_weight must be finite"),
    (dict(mtp_weight="0.3"), TypeError, "mtp_weight must be a real number"),
    (dict(mtp_weight=True), TypeError, "mtp_weight must be a real number"),
    (dict(mtp_weight=0.3, microbatch=(2, 3)), ValueError,
     r"microbatch seq_len must be at least 4 \(num_nextn_predict_layers \+ 2 with mtp_weight\), got 3"),
    (dict(microbatch=(2, 1)), ValueError, "microbatch seq_len must be at least 2, got 1"),
    (dict(microbatch=(0, 16)), ValueError, "microbatch rows"),
    (dict(microbatch=16), TypeError, r"microbatch must be \(rows, seq_len\)"),
    (dict(layers_per_stage=[2, 2, 2, 1]), ValueError, "layers_per_stage .* sums to 7"),
])
def test_bad_arguments_are_named(cfg, kwargs, err, match):
    args = dict(microbatch=(ROWS, SEQ)) | kwargs
    with pytest.raises(err, match=match):
        pipeline_costs(cfg, build("1f1b", 4, 8), **args)


def test_mtp_needs_the_modules_and_a_valid_depth(cfg):
    s = build("1f1b", 4, 8)
    with pytest.raises(ValueError, match=r"mtp_weight=0.3 needs the MTP modules: cfg.num_nextn_predict_layers is 0"):
        pipeline_costs(cfg.replace(num_nextn_predict_layers=0), s, (ROWS, SEQ), mtp_weight=0.3)
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be >= 0, got -1"):
        pipeline_costs(cfg.replace(num_nextn_predict_layers=-1), s, (ROWS, SEQ), mtp_weight=0.3)
    with pytest.raises(TypeError, match="schedule must be a Schedule"):
        pipeline_costs(cfg, "1f1b", (ROWS, SEQ))
    with pytest.raises(TypeError, match="cfg must be a ModelConfig"):
        pipeline_costs(s, cfg, (ROWS, SEQ))
    with pytest.raises(ValueError, match="flop_rate must be > 0"):
        pipeline_costs(cfg, s, (ROWS, SEQ)).simulate(flop_rate=0)


def test_deepseek_v3_mtp_on_its_head_stage():
    """DeepSeek-V3 (61 layers, one MTP depth) in bf16 on DualPipeV over 8 ranks: the MTP
    module's params (param_counts' 11.6e9, with the 0.93e9 embedding copy) sit on rank 0, and
    its work is one MoE layer, eh_proj and a second LM head per token."""
    v3 = pdjax.configs.deepseek_v3().replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    s = build("dualpipev", 8, 32)
    on = pipeline_costs(v3, s, (1, 4096), mtp_weight=WEIGHT)
    counts = param_counts(v3)
    assert on.head_stages == (15,) and s.layout.stage_rank[15] == 0
    assert on.mtp.param_bytes == 2 * (counts.mtp + counts.embedding)
    D, V, L = v3.hidden_size, v3.vocab_size, v3.num_hidden_layers
    assert on.mtp.W == 2 * 4095 * (_active_matmul_params(v3, L) + 2 * D * D + D * V)
