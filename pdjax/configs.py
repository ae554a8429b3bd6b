"""Config presets. ``deepseek_v2_lite``, ``deepseek_v2``, ``deepseek_v3`` and ``deepseek_v32``
are the published configs (for analysis: tests never allocate them); ``tiny``, ``tiny_v32``
and ``small`` run anywhere."""

from __future__ import annotations

from pdjax.model_config import ModelConfig, RopeScaling


def tiny(**overrides) -> ModelConfig:
    """A V3-shaped model small enough for CPU tests: 3 layers (first dense), 8 experts in 4
    groups, top-2, sigmoid + bias routing, q LoRA, YaRN."""
    cfg = ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc",
        norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=1024,
        rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=256,
                                 mscale=1.0, mscale_all_dim=1.0),
        model_type="deepseek_v3")
    return cfg.replace(**overrides) if overrides else cfg


def tiny_v32(**overrides) -> ModelConfig:
    """:func:`tiny` with DeepSeek-V3.2's sparse attention: an indexer of 4 heads of width 16
    selecting 8 cached tokens per query (sparse from the 9th token on)."""
    cfg = tiny(index_n_heads=4, index_head_dim=16, index_topk=8, model_type="deepseek_v32")
    return cfg.replace(**overrides) if overrides else cfg


def small(**overrides) -> ModelConfig:
    """The benchmark config of benchmarks/model_vs_transformers.py: 8 layers, hidden 512,
    16 experts top-2 in 4 groups."""
    cfg = ModelConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc",
        norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096,
        model_type="deepseek_v3")
    return cfg.replace(**overrides) if overrides else cfg


def deepseek_v3(**overrides) -> ModelConfig:
    """DeepSeek-V3 / R1 (671B total, 37B active; one MTP depth beside them), as in its config.json."""
    cfg = ModelConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        first_k_dense_replace=3, scoring_func="sigmoid", topk_method="noaux_tc",
        norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                 beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        num_nextn_predict_layers=1, model_type="deepseek_v3")
    return cfg.replace(**overrides) if overrides else cfg


def deepseek_v32(**overrides) -> ModelConfig:
    """DeepSeek-V3.2 (-Exp): DeepSeek-V3 with DeepSeek sparse attention: a lightning indexer
    of 64 heads of width 128 in every layer picks the 2,048 cached tokens each query attends
    to (``index_n_heads``, ``index_head_dim``, ``index_topk`` of deepseek-ai/DeepSeek-V3.2-Exp's
    config.json; transformers' DeepseekV32Config has the same defaults)."""
    cfg = deepseek_v3(index_n_heads=64, index_head_dim=128, index_topk=2048, model_type="deepseek_v32")
    return cfg.replace(**overrides) if overrides else cfg


def deepseek_v2(**overrides) -> ModelConfig:
    """DeepSeek-V2 (236B total, 21B active), as in its config.json."""
    cfg = ModelConfig(
        vocab_size=102400, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=60, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=160,
        n_shared_experts=2, num_experts_per_tok=6, n_group=8, topk_group=3,
        first_k_dense_replace=1, scoring_func="softmax", topk_method="group_limited_greedy",
        norm_topk_prob=False, routed_scaling_factor=16.0, max_position_embeddings=163840,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                 beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
        model_type="deepseek_v2")
    return cfg.replace(**overrides) if overrides else cfg


def deepseek_v2_lite(**overrides) -> ModelConfig:
    """DeepSeek-V2-Lite (16B total, 2.4B active): no q LoRA, 64 experts, greedy top-6."""
    cfg = ModelConfig(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
        first_k_dense_replace=1, scoring_func="softmax", topk_method="greedy",
        norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=163840,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                 beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
        model_type="deepseek_v2")
    return cfg.replace(**overrides) if overrides else cfg


PRESETS = {"tiny": tiny, "tiny_v32": tiny_v32, "small": small, "deepseek_v2_lite": deepseek_v2_lite,
           "deepseek_v2": deepseek_v2, "deepseek_v3": deepseek_v3, "deepseek_v32": deepseek_v32}


def preset(name: str, **overrides) -> ModelConfig:
    """The preset called ``name`` ("tiny", "tiny_v32", "small", "deepseek_v2_lite",
    "deepseek_v2", "deepseek_v3", "deepseek_v32"), with ``overrides`` applied; an unknown name raises ValueError."""
    try:
        return PRESETS[name](**overrides)
    except KeyError:
        raise ValueError(f"unknown config preset {name!r}; known: {sorted(PRESETS)}") from None
