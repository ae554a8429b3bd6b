"""Build tiny, fully random Hugging Face DeepSeek-V2 / DeepSeek-V3 checkpoints and
reference logits for pdjax's torch-free tests.

Run from the repository root, with the separate torch venv (it is git-ignored):

    python3 -m venv .hfvenv
    .hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    .hfvenv/bin/python scripts/make_hf_fixtures.py

Nothing is downloaded: the models are built from configs and every weight (linear
weights, fused expert tensors, RMSNorm weights, router weights and DeepSeek-V3's
``e_score_correction_bias``) is overwritten with seeded random values, so the output is
deterministic for a given torch / transformers version.

It writes, under ``tests/fixtures/hf/``:

``deepseek_v2_tiny/``
    ``config.json`` (as ``save_pretrained`` writes it: ``rope_parameters`` form),
    ``config.legacy.json`` (the same model in the published DeepSeek layout: ``rope_scaling``
    with ``"type": "yarn"`` plus a top-level ``rope_theta``, and the extra keys the published
    checkpoints carry such as ``scoring_func`` / ``topk_method`` / ``moe_layer_freq``),
    ``model.safetensors`` (one file, published per-expert tensor names) and
    ``reference.npz``.
``deepseek_v3_tiny/``
    The same for DeepSeek-V3, but the weights are split into two shards with
    ``model.safetensors.index.json``.

``reference.npz`` holds ``tokens`` (int32 [2, 12]), ``logits`` (float32 [2, 12, vocab]) from
the HF model's forward pass (eval, float32, eager attention, no cache), and extra debugging
arrays: ``hidden_states`` (float32 [num_layers + 1, 2, 12, hidden]: the embeddings, then each
decoder layer's output; the last entry is *before* the final norm) and, for each MoE layer
``i``, ``topk_indices_layer{i}`` (int32 [24, top_k], sorted by expert id) and
``topk_weights_layer{i}`` (float32 [24, top_k], the final per-expert weights including
``routed_scaling_factor``, in the same order).

After writing, each directory is reloaded with ``from_pretrained`` (also with
``config.legacy.json``) and the logits are checked against ``reference.npz``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "hf")

BATCH, SEQ = 2, 12

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
)

# DeepSeek-V2: q_proj path (q_lora_rank None), softmax + group_limited_greedy (max per group),
# no renormalisation, routed_scaling_factor applied to the raw softmax weights.
# YaRN: original_max_position_embeddings 64, theta 1e4, dim 8 -> correction range (0, 2), so the
# per-pair ramp over the 4 rotary pairs is [0, 0.5, 1, 1] (pair 0 extrapolated, pair 1 mixed,
# pairs 2-3 interpolated; low is clamped up from -1). mscale != mscale_all_dim, so both the
# cos/sin attention_factor and the softmax-scale multiplier differ from 1.
V2_CONFIG = dict(
    COMMON,
    q_lora_rank=None,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=2,
    n_group=4,
    topk_group=2,
    topk_method="group_limited_greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.5,
    max_position_embeddings=512,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=8.0,
        original_max_position_embeddings=64,
        beta_fast=32,
        beta_slow=1,
        mscale=0.707,
        mscale_all_dim=1.0,
    ),
    bos_token_id=1,
    eos_token_id=2,
)

# DeepSeek-V3: q LoRA path, sigmoid + noaux_tc (bias only for selection, group score = sum of
# top-2 biased scores per group), renormalised then scaled by routed_scaling_factor.
# YaRN: original_max_position_embeddings 4096, theta 1e4, dim 8 -> correction range (1, 3), ramp
# over the 4 pairs is [0, 0, 0.5, 1] (pairs 0-1 extrapolated, pair 2 mixed, pair 3 interpolated).
V3_CONFIG = dict(
    COMMON,
    q_lora_rank=32,
    moe_intermediate_size=8,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=16384,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    rope_interleave=True,
    num_nextn_predict_layers=0,
    bos_token_id=0,
    eos_token_id=1,
)

# Keys of the published DeepSeek config.json files that transformers does not model (it keeps
# them as plain attributes); the legacy config variants carry them like the real checkpoints do.
V2_LEGACY_EXTRA = dict(
    scoring_func="softmax",
    topk_method="group_limited_greedy",
    moe_layer_freq=1,
    aux_loss_alpha=0.001,
    seq_aux=True,
)
V3_LEGACY_EXTRA = dict(
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    moe_layer_freq=1,
    aux_loss_alpha=0.001,
    seq_aux=True,
    ep_size=1,
)

# Per-model random seeds (weights, tokens) and the range of V3's e_score_correction_bias.
# Chosen (from a scan of seeds 100-159) so every routing decision has a score margin of at least
# ~3e-3 at the group cut and at the k-th pick, i.e. far above float32 rounding differences.
SEEDS = {"deepseek_v2_tiny": 145, "deepseek_v3_tiny": 109}
# Non-negative, so every biased score sigmoid + bias is > 0 and the choice of fill value for
# masked-out groups (0.0 vs -inf) cannot change which experts are selected.
BIAS_HIGH = 0.1

# Standard deviations of the random weights.
STD_EMBED = 0.5
STD_LINEAR = 0.08
STD_ROUTER = 0.15
STD_NORM = 0.1  # norm weights = 1 + STD_NORM * randn


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter and the router bias buffers with seeded random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                new = 1.0 + STD_NORM * torch.randn(p.shape, generator=g)
            elif name.endswith("embed_tokens.weight"):
                new = STD_EMBED * torch.randn(p.shape, generator=g)
            elif name.endswith("mlp.gate.weight"):
                new = STD_ROUTER * torch.randn(p.shape, generator=g)
            elif name.endswith("norm.bias"):      # a LayerNorm's (DeepSeek-V3.2's indexer key)
                new = STD_LINEAR * torch.randn(p.shape, generator=g)
            else:
                assert p.dim() in (2, 3), name
                new = STD_LINEAR * torch.randn(p.shape, generator=g)
            p.copy_(new.to(p.dtype))
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(BIAS_HIGH * torch.rand(b.shape, generator=g))


class RouterRecorder:
    """Forward hooks on each MoE gate recording its input and (weights, indices) output."""

    def __init__(self, model):
        self.records = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                self.handles.append(gate.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def fn(module, args, out):
            _, w, idx = out
            self.records[i] = (args[0].detach().reshape(-1, args[0].shape[-1]).clone(), w.detach(), idx.detach())

        return fn

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def routing_diagnostics(kind, gate, x, idx):
    """How much each routing ingredient matters for this fixture (so the test is sensitive), and
    the smallest score margins at the group cut and at the k-th expert pick (so the selection is
    robust to float32 rounding differences between implementations)."""
    k = gate.top_k
    n_e, n_g, tg = gate.num_experts, gate.num_group, gate.topk_group
    logits = x.float() @ gate.weight.float().t()
    chosen = set_rows(idx)
    out = {}
    if kind == "v2":
        s = logits.softmax(-1)
        out["differs_if_no_group_limit"] = count_diff(chosen, s.topk(k, -1)[1])
        # margin at the k-th pick, among the allowed experts (group-limited), and at the group cut
        gs = s.view(-1, n_g, n_e // n_g).max(-1).values
        allowed = s.masked_fill(~group_mask(gs, tg, n_e // n_g).bool(), 0.0)
    else:
        s = logits.sigmoid()
        b = s + gate.e_score_correction_bias
        gs = b.view(-1, n_g, n_e // n_g).topk(2, -1)[0].sum(-1)
        allowed = b.masked_fill(~group_mask(gs, tg, n_e // n_g).bool(), float("-inf"))
        out["differs_if_no_group_limit"] = count_diff(chosen, b.topk(k, -1)[1])
        out["differs_if_bias_ignored"] = count_diff(chosen, grouped_topk(s, s, n_g, tg, k, "top2sum"))
        out["differs_if_group_score_is_max"] = count_diff(chosen, grouped_topk(b, b, n_g, tg, k, "max"))
        out["differs_if_group_score_is_sum_all"] = count_diff(chosen, grouped_topk(b, b, n_g, tg, k, "sum"))
    srt = allowed.sort(-1, descending=True).values
    out["min_margin_kth_pick"] = float((srt[:, k - 1] - srt[:, k]).min())
    gsrt = gs.sort(-1, descending=True).values
    out["min_margin_group_cut"] = float((gsrt[:, tg - 1] - gsrt[:, tg]).min())
    return out


def group_mask(group_scores, topk_group, group_size):
    gidx = group_scores.topk(topk_group, -1)[1]
    gm = torch.zeros_like(group_scores).scatter_(1, gidx, 1)
    return gm.unsqueeze(-1).expand(-1, -1, group_size).reshape(group_scores.shape[0], -1)


def grouped_topk(choice, _, n_g, tg, k, how):
    v = choice.view(choice.shape[0], n_g, -1)
    if how == "max":
        gs = v.max(-1).values
    elif how == "sum":
        gs = v.sum(-1)
    else:
        gs = v.topk(2, -1)[0].sum(-1)
    m = group_mask(gs, tg, v.shape[-1])
    return choice.masked_fill(~m.bool(), float("-inf")).topk(k, -1)[1]


def set_rows(idx):
    return [frozenset(r) for r in idx.tolist()]


def count_diff(chosen, other):
    return sum(a != b for a, b in zip(chosen, set_rows(other)))


def forward_reference(model, tokens):
    """Logits, per-layer residual-stream states (embeddings, then each decoder layer's output,
    all before the final norm) and the router records."""
    rec = RouterRecorder(model)
    states = []
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, a, o: states.append(o.detach().clone()))]
    for layer in model.model.layers:
        hooks.append(layer.register_forward_hook(lambda m, a, o: states.append(o.detach().clone())))
    with torch.no_grad():
        out = model(input_ids=tokens, use_cache=False)
    for h in hooks:
        h.remove()
    rec.remove()
    assert len(states) == model.config.num_hidden_layers + 1
    return out.logits.float(), torch.stack(states).float(), rec.records


def legacy_config_dict(cfg_dict: dict, extra: dict) -> dict:
    """The config in the published DeepSeek layout: rope_scaling + top-level rope_theta."""
    d = {k: v for k, v in cfg_dict.items() if k not in ("rope_parameters", "head_dim", "qk_head_dim", "dtype")}
    rp = dict(cfg_dict["rope_parameters"])
    d["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    d["rope_scaling"] = dict(sorted(rp.items()))
    d["torch_dtype"] = "float32"
    d.update(extra)
    return dict(sorted(d.items()))


def check_fused_expert_mapping(model, path):
    """The saved per-expert tensors are exactly the slices of the in-memory fused tensors."""
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    saved = {}
    for f in files:
        with safe_open(os.path.join(path, f), "pt") as fh:
            for k in fh.keys():
                saved[k] = fh.get_tensor(k)
    sd = model.state_dict()
    n_checked = 0
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        inter = experts.intermediate_dim
        gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
        for e in range(experts.num_experts):
            pre = f"model.layers.{i}.mlp.experts.{e}."
            assert torch.equal(saved[pre + "gate_proj.weight"], gu[e, :inter]), pre
            assert torch.equal(saved[pre + "up_proj.weight"], gu[e, inter:]), pre
            assert torch.equal(saved[pre + "down_proj.weight"], dn[e]), pre
            n_checked += 3
    for k, v in sd.items():
        if ".experts." in k:
            continue
        assert torch.equal(saved[k], v), k
        n_checked += 1
    assert n_checked == len(saved), (n_checked, len(saved))
    return saved


def build(name, cls, cfg_kwargs, legacy_extra, shard):
    seed = SEEDS[name]
    cfg = cls.config_class(**cfg_kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomize_(model, seed)

    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    logits, states, records = forward_reference(model, tokens)

    path = os.path.join(OUT, name)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    total_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # 60% of the total per shard -> exactly two shards.
    kw = {"max_shard_size": int(0.6 * total_bytes)} if shard else {}
    model.save_pretrained(path, **kw)
    n_files = len([f for f in os.listdir(path) if f.endswith(".safetensors")])
    assert n_files == (2 if shard else 1), n_files
    # save_pretrained also writes generation_config.json; the fixtures do not need it.
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)

    with open(os.path.join(path, "config.json")) as f:
        cfg_dict = json.load(f)
    with open(os.path.join(path, "config.legacy.json"), "w") as f:
        json.dump(legacy_config_dict(cfg_dict, legacy_extra), f, indent=2)
        f.write("\n")

    arrays = {
        "tokens": tokens.to(torch.int32).numpy(),
        "logits": logits.numpy().astype(np.float32),
        "hidden_states": states.numpy(),
    }
    kind = "v2" if cls is DeepseekV2ForCausalLM else "v3"
    diags = {}
    for i, (x, w, idx) in sorted(records.items()):
        order = idx.argsort(-1)
        arrays[f"topk_indices_layer{i}"] = idx.gather(1, order).to(torch.int32).numpy()
        arrays[f"topk_weights_layer{i}"] = w.gather(1, order).float().numpy()
        diags[i] = routing_diagnostics(kind, model.model.layers[i].mlp.gate, x, idx)
    np.savez(os.path.join(path, "reference.npz"), **arrays)

    saved = check_fused_expert_mapping(model, path)
    return model, path, arrays, diags, saved


def verify(name, cls, path, arrays):
    """Reload with from_pretrained (default attention and eager; legacy config) and compare."""
    tokens = torch.from_numpy(arrays["tokens"].astype(np.int64))
    ref = arrays["logits"]
    results = {}
    for attn in ("eager", "sdpa"):
        m = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()
        assert isinstance(m, cls), type(m)
        with torch.no_grad():
            got = m(input_ids=tokens, use_cache=False).logits.float().numpy()
        results[f"reload_{attn}"] = float(np.abs(got - ref).max())

    # Legacy config: same weights, config.json replaced by config.legacy.json.
    with tempfile.TemporaryDirectory() as tmp:
        for f in os.listdir(path):
            if f not in ("config.json", "config.legacy.json"):
                shutil.copy(os.path.join(path, f), tmp)
        shutil.copy(os.path.join(path, "config.legacy.json"), os.path.join(tmp, "config.json"))
        m = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32).eval()
        with torch.no_grad():
            got = m(input_ids=tokens, use_cache=False).logits.float().numpy()
        results["reload_legacy_config"] = float(np.abs(got - ref).max())
        m0 = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
        rp_new, rp_old = dict(m0.config.rope_parameters), dict(m.config.rope_parameters)
        rp_old.pop("type", None)
        assert rp_new == rp_old, (rp_new, rp_old)

    # Incremental decoding with the cache must reproduce the last position's logits.
    with torch.no_grad():
        o1 = m0(input_ids=tokens[:, :-1], use_cache=True)
        o2 = m0(input_ids=tokens[:, -1:], cache=o1.cache, use_cache=True)
    results["cached_decode_last_pos"] = float(np.abs(o2.logits[:, -1].numpy() - ref[:, -1]).max())
    return results


def describe_rope(model):
    rot = model.model.rotary_emb
    attn = model.model.layers[0].self_attn
    return {
        "inv_freq": [float(v) for v in rot.inv_freq],
        "attention_scaling(cos/sin)": float(rot.attention_scaling),
        "softmax_scale": float(attn.scaling),
        "softmax_scale/qk_head_dim**-0.5": float(attn.scaling / attn.qk_head_dim**-0.5),
    }


def main():
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.use_deterministic_algorithms(True)
    os.makedirs(OUT, exist_ok=True)
    ok = True
    for name, cls, cfg, extra, shard in (
        ("deepseek_v2_tiny", DeepseekV2ForCausalLM, V2_CONFIG, V2_LEGACY_EXTRA, False),
        ("deepseek_v3_tiny", DeepseekV3ForCausalLM, V3_CONFIG, V3_LEGACY_EXTRA, True),
    ):
        model, path, arrays, diags, saved = build(name, cls, cfg, extra, shard)
        res = verify(name, cls, path, arrays)
        lg = arrays["logits"]
        print(f"\n== {name}")
        for f in sorted(os.listdir(path)):
            print(f"  {f:45s} {os.path.getsize(os.path.join(path, f)):>8d} bytes")
        print(f"  logits: std {lg.std():.4f}, max|.| {np.abs(lg).max():.4f}")
        print(f"  rope: {describe_rope(model)}")
        for i, d in diags.items():
            print(f"  routing layer {i}: {d}")
        print(f"  verification (max |diff| vs reference.npz): {res}")
        ok &= all(v < 1e-4 for v in res.values())
    if not ok:
        print("VERIFICATION FAILED")
        sys.exit(1)
    print("\nall fixtures verified")


if __name__ == "__main__":
    main()
