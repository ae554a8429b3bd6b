"""Build a tiny, fully random DeepSeek-V3.2 checkpoint (DeepSeek sparse attention: a lightning
indexer in every layer) and transformers' reference outputs, for pdjax's torch-free tests.

Run from the repository root with the torch venv described in ``make_hf_fixtures.py``
(transformers >= 5.2, which has ``DeepseekV32ForCausalLM``; made with 5.25.0):

    .hfvenv/bin/python scripts/make_dsa_fixture.py             # writes the fixture
    .hfvenv/bin/python scripts/make_dsa_fixture.py --scan      # top-k margins of seeds 200-239

It writes ``tests/fixtures/hf/deepseek_v32_tiny/``: ``config.json`` (``model_type``
``deepseek_v32``; ``deepseek_v3_tiny``'s sizes with ``index_n_heads`` 8, ``index_head_dim`` 16,
``index_topk`` 4, so the 12-token rows attend sparsely from position 4 on),
``model.safetensors`` (every weight random, the indexer's LayerNorm bias too) and
``reference.npz``:

``tokens`` int32 [2, 12]; ``logits`` float32 [2, 12, V] (forward, eval, float32, eager
attention, no cache); ``dense_logits`` (the same weights with ``index_topk`` 12: every key
selected); ``decode_logits`` [2, 4, V] (a cached prefill of the first 8 tokens, then 4 one-token
steps, each step's logits); ``topk_layer{i}`` int32 [2, 12, 4] (the indexer's selections,
sorted); ``topk_margin`` (the smallest gap, over layers and queries with more than
``index_topk`` allowed keys, between the k-th and the (k+1)-th index score: the selection is
far from a tie).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import BATCH, OUT, SEQ, V3_CONFIG, randomize_  # noqa: E402

NAME = "deepseek_v32_tiny"
SEED = 202
DSA = dict(index_n_heads=8, index_head_dim=16, index_topk=4)
MIN_MARGIN = 1e-3
PREFIX = 8                       # decode_logits: prefill this many tokens, then one token a step


def config(topk=DSA["index_topk"]) -> DeepseekV32Config:
    kw = {k: v for k, v in V3_CONFIG.items() if k not in ("rope_interleave", "num_nextn_predict_layers")}
    cfg = DeepseekV32Config(**kw, **dict(DSA, index_topk=topk))
    cfg._attn_implementation = "eager"
    return cfg


def build(seed: int):
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(config()).eval()
    randomize_(model, seed)
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    return model, tokens


class IndexerRecorder:
    """Hooks on every layer's indexer: its selections and its scores (recomputed from the
    inputs it was called with, as its forward computes them)."""

    def __init__(self, model):
        self.records, self.hooks = {}, []
        for i, layer in enumerate(model.model.layers):
            self.hooks.append(layer.self_attn.indexer.register_forward_hook(self._hook(i), with_kwargs=True))

    def _hook(self, i):
        def fn(module, args, kwargs, out):
            self.records[i] = (out.detach().clone(), scores(module, *args, **kwargs))
        return fn

    def remove(self):
        for h in self.hooks:
            h.remove()


def scores(ix, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None):
    """The indexer's index scores [B, S, T], as DeepseekV32Indexer.forward computes them."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
    B, S, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    k = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    s = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
    w = ix.weights_proj(hidden_states.float()).float() * ix.n_heads ** -0.5
    out = torch.matmul(w.unsqueeze(-2), s).squeeze(-2)
    return out.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
        else out + attention_mask


def margin(records, k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th allowed score of any query that has
    more than k allowed keys."""
    gaps = []
    for _, s in records.values():
        top = torch.sort(s, dim=-1, descending=True).values
        allowed = top > -1e30             # the mask adds finfo.min (or -inf) to the keys it hides
        has = allowed[..., k]
        gaps.append((top[..., k - 1] - top[..., k])[has])
    return float(torch.cat(gaps).min())


def forward(model, tokens):
    rec = IndexerRecorder(model)
    with torch.no_grad():
        logits = model(input_ids=tokens, use_cache=False).logits.float()
    rec.remove()
    return logits, rec.records


def decode(model, tokens):
    with torch.no_grad():
        out = model(input_ids=tokens[:, :PREFIX], use_cache=True)
        cache, steps = out.cache, []
        for t in range(PREFIX, SEQ):
            out = model(input_ids=tokens[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits[:, -1].float())
    return torch.stack(steps, dim=1)


def scan():
    for seed in range(200, 240):
        model, tokens = build(seed)
        _, rec = forward(model, tokens)
        print(seed, f"{margin(rec, DSA['index_topk']):.2e}")


def main():
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.use_deterministic_algorithms(True)
    model, tokens = build(SEED)
    logits, rec = forward(model, tokens)
    m = margin(rec, DSA["index_topk"])
    assert m > MIN_MARGIN, f"seed {SEED}: top-k margin {m:.2e} (a near tie at the selection boundary)"
    dense = DeepseekV32ForCausalLM(config(topk=SEQ)).eval()
    dense.load_state_dict(model.state_dict())
    with torch.no_grad():
        dense_logits = dense(input_ids=tokens, use_cache=False).logits.float()
    decode_logits = decode(model, tokens)
    path = os.path.join(OUT, NAME)
    if os.path.exists(path):
        shutil.rmtree(path)
    model.save_pretrained(path)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    arrays = {"tokens": tokens.to(torch.int32).numpy(), "logits": logits.numpy(),
              "dense_logits": dense_logits.numpy(), "decode_logits": decode_logits.numpy(),
              "topk_margin": np.float32(m)}
    for i, (idx, _) in rec.items():
        arrays[f"topk_layer{i}"] = torch.sort(idx, dim=-1).values.to(torch.int32).numpy()
    np.savez(os.path.join(path, "reference.npz"), **arrays)
    # checks: reload, sparse differs from dense, cached decoding equals the forward's last positions
    re = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        again = re(input_ids=tokens, use_cache=False).logits.float()
    res = {"reload": float((again - logits).abs().max()),
           "decode_vs_forward": float((decode_logits - logits[:, PREFIX:]).abs().max()),
           "sparse_vs_dense": float((dense_logits - logits).abs().max()),
           "topk_margin": m}
    with open(os.path.join(path, "config.json")) as f:
        print(json.dumps({k: v for k, v in json.load(f).items() if k.startswith("index") or k == "model_type"}))
    print(res)
    if res["reload"] > 1e-5 or res["decode_vs_forward"] > 1e-4 or res["sparse_vs_dense"] < 1e-2:
        print("VERIFICATION FAILED")
        sys.exit(1)
    print("fixture verified")


if __name__ == "__main__":
    scan() if "--scan" in sys.argv else main()
