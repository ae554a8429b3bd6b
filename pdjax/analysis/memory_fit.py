"""The saturation batch of a deployment: the largest batch its kernels and its memory allow.

* **Kernel limit.** Decode: DeepEP's low-latency kernels take at most the tokens per GPU
  their buffers were sized for; DeepSeek's production setting (its low-latency benchmark,
  "a typical DeepSeek-V3/R1 production setting") is 128 per micro-batch, so 128 per
  micro-batch of tokens (a request with MTP runs 2). Prefill: 16,384 tokens per GPU, the
  batch of DeepSeek's prefill profile (profile-data README).
* **Memory limit.** HBM minus the weights this GPU holds (attention, dense and shared
  layers replicated under data-parallel attention, its routed-expert slots; embedding and
  LM head in BF16, the rest at the weight dtype) minus an activation reserve, over the KV
  cache a request holds at its longest (decode: input + output tokens, in the layout
  DeepSeek's decode kernels read, :func:`pdjax.analysis.kv.serving_kv_bytes_per_token`: the
  BF16 latent, or with sparse attention the FP8 latent and indexer key with their scales)
  or the activations a prefill token keeps alive in its micro-batch.
"""

from __future__ import annotations

from pdjax.analysis import calibration as C
from pdjax.analysis.kv import serving_kv_bytes_per_token
from pdjax.param_counts import param_counts

PREFILL_TOKENS_PER_GPU = next(p.batch_per_gpu for p in C.DEEPSEEK_PROFILE if p.role == "prefill")
LL_TOKENS_PER_MICROBATCH = C.DEEPEP_LOW_LATENCY_BENCH["tokens"]
ACTIVATION_RESERVE = 0.10     # share of HBM kept for activations, workspaces and fragmentation


def weight_bytes_per_gpu(d) -> float:
    """Bytes of weights one GPU of deployment ``d`` holds."""
    cfg, counts = d.model, param_counts(d.model)
    p = 1 if d.weight_dtype == "fp8" else 2
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    per_expert = counts.routed_experts / (n_moe * cfg.n_routed_experts)
    replicated = counts.attention + counts.dense_mlp + counts.shared_experts + counts.router + counts.norms
    routed = n_moe * per_expert * d.slots / d.ep
    return (replicated + routed) * p + (counts.embedding + counts.lm_head) * 2


def prefill_activation_bytes_per_token(cfg) -> float:
    """Bytes a prefill token keeps alive through one MoE layer: the residual and attention
    output (BF16), its top-k dispatched copies (FP8) and their gate/up and down outputs (BF16)."""
    h, k, inter = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    return 4 * h * 2 + k * (h * 1 + 2 * inter * 2 + h * 2)


def saturation_batch(d) -> tuple[int, tuple]:
    """(batch, notes): tokens per GPU (prefill) or requests per GPU (decode) of ``d``."""
    hbm = d.hardware.require("hbm_bytes", "the saturation batch")
    free = hbm * (1 - ACTIVATION_RESERVE) - weight_bytes_per_gpu(d)
    if free <= 0:
        raise ValueError(f"the weights ({weight_bytes_per_gpu(d) / 1e9:.1f} GB per GPU) do not fit "
                         f"{d.hardware.name}'s {hbm / 1e9:.0f} GB at ep={d.ep}")
    m = d.microbatches
    if d.role == "decode":
        kernel = LL_TOKENS_PER_MICROBATCH * m // d.tokens_per_request
        memory = int(free // (serving_kv_bytes_per_token(d.model) * (d.input_len + d.output_len)))
        which = "kernel" if kernel <= memory else "memory"
        return max(1, min(kernel, memory)), (f"decode batch: {min(kernel, memory)} requests per GPU, "
                                             f"{which}-limited (kernel {kernel}, memory {memory})",)
    memory = int(free * m // prefill_activation_bytes_per_token(d.model))
    batch = min(PREFILL_TOKENS_PER_GPU, memory)
    which = "kernel" if batch == PREFILL_TOKENS_PER_GPU else "memory"
    return max(1, batch), (f"prefill batch: {batch} tokens per GPU, {which}-limited",)
