"""Build a tiny, fully random DeepSeek-V3 checkpoint *with* its multi-token-prediction (MTP)
layer, and torch reference outputs for the MTP forward pass, for pdjax's torch-free tests.

Run from the repository root with the torch venv described in ``make_hf_fixtures.py``:

    .hfvenv/bin/python scripts/make_mtp_fixture.py            # writes the fixture
    .hfvenv/bin/python scripts/make_mtp_fixture.py --scan     # routing margins for MTP seeds

It writes ``tests/fixtures/hf/deepseek_v3_mtp_tiny/``:

``config.json`` / ``config.legacy.json``
    ``deepseek_v3_tiny``'s config with ``"num_nextn_predict_layers": 1``.
``model-00001-of-00002.safetensors``
    The main model (same weights and tokens as ``deepseek_v3_tiny``: same config and seed).
``model-00002-of-00002.safetensors``
    The MTP layer under the published names ``model.layers.{L}.*`` (``L = num_hidden_layers``):
    ``enorm``, ``hnorm``, ``eh_proj`` ([D, 2D]), ``embed_tokens`` / ``shared_head.head`` (copies of
    the main embedding / lm_head), ``shared_head.norm`` and a MoE decoder block
    (``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``, ``mlp.gate.*``,
    ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts.*``).
``model.safetensors.index.json`` and ``reference.npz``:
    ``tokens`` int32 [2, 12]; ``logits`` float32 [2, 12, V] and ``main_hidden_normed`` [2, 12, D]
    (HF main model, last hidden state after ``model.norm``); for depth 1 at positions i = 0..10:
    ``mtp_eh_out`` [2, 11, D] = eh_proj([enorm(embed(tokens[:, i+1])), hnorm(main_hidden_normed[:, i])]),
    ``mtp_hidden`` [2, 11, D] = shared_head.norm(block(mtp_eh_out)) and ``mtp_logits`` [2, 11, V] =
    shared_head.head(mtp_hidden); ``mtp_topk_indices`` / ``mtp_topk_weights`` [22, top_k] (the MTP
    block's routing, sorted by expert id, weights include routed_scaling_factor).

The block is transformers' own ``DeepseekV3DecoderLayer(config, layer_idx=L)`` run at RoPE
positions 0..10 with the causal mask and rotary embeddings that ``DeepseekV3Model.forward``
prepares (checked against the ones it passes to its own layers). Eval mode, float32, eager
attention, no cache. The script then checks: the reloaded main model's logits; the MTP outputs
recomputed from the saved tensors; and transformers' ``MtpModel`` (``generate(use_mtp=True)``)
loaded from the fixture directory.
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
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import (  # noqa: E402
    BATCH,
    OUT,
    SEEDS,
    SEQ,
    V3_CONFIG,
    V3_LEGACY_EXTRA,
    legacy_config_dict,
    randomize_,
    routing_diagnostics,
)

NAME = "deepseek_v3_mtp_tiny"
CONFIG = dict(V3_CONFIG, num_nextn_predict_layers=1)
MAIN_SEED = SEEDS["deepseek_v3_tiny"]  # main weights and tokens identical to deepseek_v3_tiny
# MTP-layer weights seed, chosen with --scan (seeds 300-339) for the largest routing margins of
# the MTP block (min margin at the group cut and at the k-th pick, cf. make_hf_fixtures.SEEDS).
MTP_SEED = 313  # min margin 1.28e-2 (next best: 329 1.20e-2, 322 1.09e-2)
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
MAX_BYTES = 1_500_000


class MTPLayer(nn.Module):
    """DeepSeek-V3's MTP module (depth 1), around transformers' decoder layer ``block``."""

    def __init__(self, cfg, layer_idx):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.enorm = DeepseekV3RMSNorm(d, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)  # weight [D, 2D]
        self.block = DeepseekV3DecoderLayer(cfg, layer_idx)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(d, eps=eps)
        self.shared_head.head = nn.Linear(d, cfg.vocab_size, bias=False)


def build_main():
    cfg = DeepseekV3ForCausalLM.config_class(**CONFIG)
    cfg._attn_implementation = "eager"
    torch.manual_seed(MAIN_SEED)
    model = DeepseekV3ForCausalLM(cfg).eval()
    randomize_(model, MAIN_SEED)
    g = torch.Generator().manual_seed(MAIN_SEED + 1)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    return model, tokens


def build_mtp(main, seed):
    """Random MTP layer (norm weights 1 + 0.1 randn); embedding and head copied from ``main``."""
    cfg = main.config
    mtp = MTPLayer(cfg, cfg.num_hidden_layers).eval()
    assert hasattr(mtp.block.mlp, "experts"), "layer L must be a MoE layer"
    randomize_(mtp, seed)
    with torch.no_grad():
        mtp.embed_tokens.weight.copy_(main.model.embed_tokens.weight)
        mtp.shared_head.head.weight.copy_(main.lm_head.weight)
    return mtp


@torch.no_grad()
def main_forward(main, tokens):
    """Logits, the last hidden state after model.norm, and the one before it."""
    seen = []
    hook = main.model.norm.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    logits = main(input_ids=tokens, use_cache=False).logits
    hook.remove()
    normed = main.model(input_ids=tokens, use_cache=False).last_hidden_state
    assert torch.allclose(main.lm_head(normed), logits, atol=1e-5, rtol=0)
    assert torch.equal(main.model.norm(seen[0]), normed)
    return logits.float(), normed.float(), seen[0].float()


def mask_and_rope(main, x, pos_offset=0):
    """Position ids, causal mask and (cos, sin) built as in DeepseekV3Model.forward (no cache)."""
    position_ids = (torch.arange(x.shape[1]) + pos_offset).unsqueeze(0)
    mask = create_causal_mask(
        config=main.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=position_ids
    )
    return position_ids, mask, main.model.rotary_emb(x, position_ids)


@torch.no_grad()
def check_mask_and_rope(main, tokens):
    """What DeepseekV3Model.forward passes to its layers for an 11-token input equals ours."""
    seen = {}
    hook = main.model.layers[0].register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    main(input_ids=tokens[:, : SEQ - 1], use_cache=False)
    hook.remove()
    x = main.model.embed_tokens(tokens[:, : SEQ - 1])
    pos, mask, (cos, sin) = mask_and_rope(main, x)
    assert torch.equal(seen["position_ids"], pos)
    assert torch.equal(seen["attention_mask"], mask), "causal mask differs"
    assert torch.equal(seen["position_embeddings"][0], cos) and torch.equal(seen["position_embeddings"][1], sin)
    return mask


@torch.no_grad()
def mtp_forward(mtp, main, tokens, h_normed, hidden_first=False, pos_offset=0, zero_pos0=False):
    """Depth-1 MTP at positions i = 0..T-2: hidden h_i, embedding of t_{i+1}, RoPE position i.
    The keyword arguments give the wrong variants used to show the fixture's sensitivity."""
    emb = mtp.embed_tokens(tokens[:, 1:])  # [B, T-1, D]: Emb(t_{i+1})
    if zero_pos0:  # vLLM's "inputs_embeds[positions == 0] = 0"
        emb = torch.cat([torch.zeros_like(emb[:, :1]), emb[:, 1:]], dim=1)
    h = h_normed[:, :-1]  # [B, T-1, D]: h_i (main model, after model.norm)
    parts = [mtp.enorm(emb), mtp.hnorm(h)]  # embedding FIRST
    x = mtp.eh_proj(torch.cat(parts[::-1] if hidden_first else parts, dim=-1))
    position_ids, mask, rope = mask_and_rope(main, x, pos_offset)
    rec = {}
    hook = mtp.block.mlp.gate.register_forward_hook(lambda m, a, o: rec.update(x=a[0].flatten(0, 1), w=o[1], idx=o[2]))
    y = mtp.block(x, attention_mask=mask, position_ids=position_ids, position_embeddings=rope, use_cache=False)
    hook.remove()
    hidden = mtp.shared_head.norm(y)
    return dict(eh_out=x, block_out=y, hidden=hidden, logits=mtp.shared_head.head(hidden), router=rec)


def mtp_tensors(mtp, layer):
    """The MTP layer's tensors under the published checkpoint names (per-expert tensors)."""
    pre = f"model.layers.{layer}."
    out = {}
    for k, v in mtp.state_dict().items():
        k = k.removeprefix("block.")
        if ".experts." in k:
            continue
        out[pre + k] = v.detach().clone().contiguous()
    experts = mtp.block.mlp.experts
    inter, gu, dn = experts.intermediate_dim, experts.gate_up_proj.detach(), experts.down_proj.detach()
    for e in range(experts.num_experts):
        ep = f"{pre}mlp.experts.{e}."
        out[ep + "gate_proj.weight"] = gu[e, :inter].clone().contiguous()
        out[ep + "up_proj.weight"] = gu[e, inter:].clone().contiguous()
        out[ep + "down_proj.weight"] = dn[e].clone().contiguous()
    return out


def read_safetensors(path):
    with safe_open(path, "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def save_checkpoint(main, extra, path):
    """Main model (as save_pretrained writes it) in shard 1, the MTP tensors in shard 2."""
    with tempfile.TemporaryDirectory() as tmp:
        main.save_pretrained(tmp)
        files = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
        assert files == ["model.safetensors"], files
        main_sd = read_safetensors(os.path.join(tmp, files[0]))
        shutil.copy(os.path.join(tmp, "config.json"), path)
    # The saved layer-(L-1) names, renumbered, are exactly the saved MTP block names.
    L = main.config.num_hidden_layers
    prev = {k.replace(f"model.layers.{L - 1}.", "") for k in main_sd if k.startswith(f"model.layers.{L - 1}.")}
    mtp_only = {"enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head.norm", "shared_head.head"}
    mtp_only = {f"{n}.weight" for n in mtp_only}
    assert {k.replace(f"model.layers.{L}.", "") for k in extra} == prev | mtp_only
    assert not set(main_sd) & set(extra)
    weight_map = {}
    for shard, sd in zip(SHARDS, (main_sd, extra)):
        save_file(sd, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in sd})
    all_t = list(main_sd.values()) + list(extra.values())
    meta = {"total_parameters": sum(t.numel() for t in all_t)}
    meta["total_size"] = sum(t.numel() * t.element_size() for t in all_t)
    index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    with open(os.path.join(path, "config.json")) as f:
        cfg_dict = json.load(f)
    assert cfg_dict.get("num_nextn_predict_layers") == 1, cfg_dict
    with open(os.path.join(path, "config.legacy.json"), "w") as f:
        json.dump(legacy_config_dict(cfg_dict, V3_LEGACY_EXTRA), f, indent=2)
        f.write("\n")


def load_mtp_from_file(path, cfg):
    """A fresh MTPLayer filled from shard 2 (per-expert tensors fused back)."""
    L = cfg.num_hidden_layers
    saved = read_safetensors(os.path.join(path, SHARDS[1]))
    mtp = MTPLayer(cfg, L).eval()
    own = ("enorm.", "hnorm.", "eh_proj.", "embed_tokens.", "shared_head.")
    sd = {}
    for k, v in saved.items():
        k = k.removeprefix(f"model.layers.{L}.")
        if ".experts." not in k:
            sd[k if k.startswith(own) else "block." + k] = v
    n_e, pre = cfg.n_routed_experts, f"model.layers.{L}.mlp.experts."
    ex = [[saved[f"{pre}{e}.{p}_proj.weight"] for e in range(n_e)] for p in ("gate", "up", "down")]
    sd["block.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(ex[0], ex[1])])
    sd["block.mlp.experts.down_proj"] = torch.stack(ex[2])
    mtp.load_state_dict(sd, strict=True)
    assert len(saved) == len(sd) - 2 + 3 * n_e
    return mtp


@torch.no_grad()
def hf_mtp_model_logits(path, main, tokens, h_normed):
    """transformers' own MtpModel (the generate(use_mtp=True) drafter) loaded from the fixture.
    Its key discovery uses the main model's ignore pattern, which names layer 61; point it at L."""
    from transformers.modeling_layers import MtpModel

    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{main.config.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(main).eval()
    pos = torch.arange(SEQ - 1).unsqueeze(0)
    h = mtp.forward_layer(0, h_normed[:, :-1], pos, None, input_ids=tokens[:, 1:], use_cache=False)
    return mtp._project_to_logits(h).float().numpy()


def verify(path, arrays):
    """Reload from the fixture directory and compare with reference.npz."""
    tokens = torch.from_numpy(arrays["tokens"].astype(np.int64))
    res = {}
    for attn in ("eager", "sdpa"):
        m, info = AutoModelForCausalLM.from_pretrained(
            path, attn_implementation=attn, dtype=torch.float32, output_loading_info=True
        )
        m.eval()
        assert isinstance(m, DeepseekV3ForCausalLM) and not info["missing_keys"], info["missing_keys"]
        L = m.config.num_hidden_layers
        assert all(k.startswith(f"model.layers.{L}.") for k in info["unexpected_keys"]), info["unexpected_keys"]
        with torch.no_grad():
            logits = m(input_ids=tokens, use_cache=False).logits.float().numpy()
            normed = m.model(input_ids=tokens, use_cache=False).last_hidden_state.float().numpy()
        res[f"reload_{attn}_logits"] = float(np.abs(logits - arrays["logits"]).max())
        res[f"reload_{attn}_main_hidden_normed"] = float(np.abs(normed - arrays["main_hidden_normed"]).max())
    n_unexp = len(info["unexpected_keys"])
    mtp = load_mtp_from_file(path, m.config)
    m.config._attn_implementation = "eager"
    h = torch.from_numpy(arrays["main_hidden_normed"])
    out = mtp_forward(mtp, m, tokens, h)
    for k in ("eh_out", "hidden", "logits"):
        res[f"saved_tensors_mtp_{k}"] = float(np.abs(out[k].numpy() - arrays[f"mtp_{k}"]).max())
    res["hf_MtpModel_mtp_logits"] = float(np.abs(hf_mtp_model_logits(path, m, tokens, h) - arrays["mtp_logits"]).max())
    return res, n_unexp


@torch.no_grad()
def sensitivity(mtp, main, tokens, normed, prenorm, ref):
    """max |mtp_logits - wrong variant|: each must be far above float32 noise, except
    ``rope_positions_i_plus_1``: RoPE is relative, so with the MTP layer's own (here: no) cache
    shifting all its positions by one changes nothing; the fixture cannot check that choice."""
    d = lambda o: float((o["logits"] - ref).abs().max())  # noqa: E731
    y = mtp_forward(mtp, main, tokens, normed)["block_out"]
    return {
        "hidden_first_concat": d(mtp_forward(mtp, main, tokens, normed, hidden_first=True)),
        "hidden_before_final_norm": d(mtp_forward(mtp, main, tokens, prenorm)),
        "rope_positions_i_plus_1": d(mtp_forward(mtp, main, tokens, normed, pos_offset=1)),
        "vllm_zero_embed_pos0": d(mtp_forward(mtp, main, tokens, normed, zero_pos0=True)),
        "no_shared_head_norm": float((mtp.shared_head.head(y) - ref).abs().max()),
    }


def router_arrays(rec):
    order = rec["idx"].argsort(-1)
    return rec["idx"].gather(1, order).to(torch.int32).numpy(), rec["w"].gather(1, order).float().numpy()


def scan(seeds):
    main, tokens = build_main()
    _, normed, _ = main_forward(main, tokens)
    for seed in seeds:
        mtp = build_mtp(main, seed)
        rec = mtp_forward(mtp, main, tokens, normed)["router"]
        dg = routing_diagnostics("v3", mtp.block.mlp.gate, rec["x"], rec["idx"])
        print(seed, round(min(dg["min_margin_kth_pick"], dg["min_margin_group_cut"]), 5), dg)


def build():
    main, tokens = build_main()
    logits, normed, prenorm = main_forward(main, tokens)
    check_mask_and_rope(main, tokens)
    mtp = build_mtp(main, MTP_SEED)
    out = mtp_forward(mtp, main, tokens, normed)
    idx, w = router_arrays(out["router"])
    arrays = {
        "tokens": tokens.to(torch.int32).numpy(),
        "logits": logits.numpy(),
        "main_hidden_normed": normed.numpy(),
        "mtp_eh_out": out["eh_out"].float().numpy(),
        "mtp_hidden": out["hidden"].float().numpy(),
        "mtp_logits": out["logits"].float().numpy(),
        "mtp_topk_indices": idx,
        "mtp_topk_weights": w,
    }
    assert arrays["mtp_logits"].shape == (BATCH, SEQ - 1, CONFIG["vocab_size"])
    path = os.path.join(OUT, NAME)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    extra = mtp_tensors(mtp, main.config.num_hidden_layers)
    save_checkpoint(main, extra, path)
    np.savez(os.path.join(path, "reference.npz"), **arrays)
    diags = routing_diagnostics("v3", mtp.block.mlp.gate, out["router"]["x"], out["router"]["idx"])
    sens = sensitivity(mtp, main, tokens, normed, prenorm, out["logits"])
    return path, arrays, extra, diags, sens


def report(path, arrays, extra, diags, sens, res, n_unexp):
    print(f"\n== {NAME}")
    total = 0
    for f in sorted(os.listdir(path)):
        size = os.path.getsize(os.path.join(path, f))
        total += size
        print(f"  {f:40s} {size:>8d} bytes")
    print(f"  total {total} bytes")
    print(f"  MTP tensors ({len(extra)}):")
    for k, v in sorted(extra.items()):
        if ".experts." not in k or ".experts.0." in k:
            print(f"    {k:55s} {tuple(v.shape)}")
    print(f"    (+ mlp.experts.1..{CONFIG['n_routed_experts'] - 1}.{{gate,up,down}}_proj.weight)")
    for k, v in arrays.items():
        print(f"  {k:20s} {str(v.dtype):8s} {str(v.shape):14s} max|.| {np.abs(v).max():.4f}")
    print(f"  MTP routing: {diags}")
    print(f"  sensitivity (max |diff| of mtp_logits vs a wrong variant): {sens}")
    print(f"  reload: {n_unexp} unexpected (layer-L) keys ignored by from_pretrained")
    print(f"  verification (max |diff| vs reference.npz): {res}")
    v3 = os.path.join(OUT, "deepseek_v3_tiny", "reference.npz")
    if os.path.exists(v3):  # same config and seed: informational (it was built with another version)
        ref = np.load(v3)
        same, diff = np.array_equal(ref["tokens"], arrays["tokens"]), np.abs(ref["logits"] - arrays["logits"]).max()
        print(f"  vs deepseek_v3_tiny: same tokens {same}, max |logits diff| {diff:.3g}")
    return total


def main():
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    transformers.logging.set_verbosity_error()  # the load report lists the layer-L keys; we count them
    transformers.utils.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    if "--scan" in sys.argv:
        scan(range(300, 340))
        return
    path, arrays, extra, diags, sens = build()
    res, n_unexp = verify(path, arrays)
    total = report(path, arrays, extra, diags, sens, res, n_unexp)
    sens_ok = all(v > 1e-2 for k, v in sens.items() if k != "rope_positions_i_plus_1")
    ok = all(v < 1e-4 for v in res.values()) and sens_ok and total < MAX_BYTES
    if not ok:
        print("VERIFICATION FAILED")
        sys.exit(1)
    print("\nfixture verified")


if __name__ == "__main__":
    main()
