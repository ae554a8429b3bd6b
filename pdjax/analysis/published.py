"""Published deployment facts used as *inputs* by the analysis (never as answers).

Each figure is what a source reports about a deployment or an experiment, with the
source next to it. The reference figures (the worked results of the source articles,
recomputed in tests/analysis) are computed from these, the model configs
(``pdjax.configs``) and the hardware presets (``pdjax.analysis.hardware``).
"""

from __future__ import annotations

import dataclasses

_DAY6 = ("DeepSeek open-infra-index, 202502OpenSourceWeek day 6, 'DeepSeek-V3/R1 inference "
         "system overview'")


@dataclasses.dataclass(frozen=True)
class ServingDeployment:
    """A published serving deployment (per-GPU figures unless stated)."""

    name: str
    hardware: str                 # hardware preset name
    gpus_per_node: int
    prefill_nodes: int
    prefill_ep: int
    prefill_routed_per_gpu: int
    decode_nodes: int
    decode_ep: int
    decode_routed_per_gpu: int
    shared_per_gpu: int
    weight_dtype_bytes: int       # bytes per weight as served (fp8 = 1)
    mean_kv_len: int              # mean KV length per output token, tokens
    source: str = ""

    @property
    def ep_ratio(self) -> float:
        """Decode EP degree over prefill EP degree (DeepSeek: 144 / 32 = 4.5)."""
        return self.decode_ep / self.prefill_ep


#: DeepSeek-V3/R1 production serving: EP32 prefill / EP144 decode on H800, fp8 weights, mean KV 4,989.
DEEPSEEK_V3_SERVING = ServingDeployment(
    name="DeepSeek-V3/R1 production (Feb 2025)", hardware="h800", gpus_per_node=8,
    prefill_nodes=4, prefill_ep=32, prefill_routed_per_gpu=9,
    decode_nodes=18, decode_ep=144, decode_routed_per_gpu=2, shared_per_gpu=1,
    weight_dtype_bytes=1, mean_kv_len=4989,
    source=(f"{_DAY6}: prefill EP32/DP32 over 4 nodes, 9 routed + 1 shared expert per GPU; "
            "decode EP144/DP144 over 18 nodes, 2 routed + 1 shared per GPU; FP8 weights; "
            "'average KV cache length per output token 4,989'"),
)


@dataclasses.dataclass(frozen=True)
class AFDSpeedupExample:
    """The three factors of an AFD speedup decomposition as reported."""

    batch_gain: float          # B_AFD / B_base
    step_time_gain: float      # T_base / T_AFD
    attention_share: float     # M / (M + N)
    source: str = ""


#: The FastAFD speedup decomposition: batch gain 1.50 x step-time gain 1.15 x M/(M+N) 0.85.
FASTAFD_EXAMPLE = AFDSpeedupExample(
    batch_gain=1.50, step_time_gain=1.15, attention_share=0.85,
    source=("vLLM AFD Plugin / FastAFD talk (Chinese write-up of the vLLM AFD/FastAFD "
            "lesson, sec. 6): resident-request gain 1.50, full-step latency ratio 1.15, "
            "FFN node tax M/(M+N) 0.85; measured 1.35-1.45x"),
)


@dataclasses.dataclass(frozen=True)
class MoEExample:
    """An MoE routing shape quoted as an example (not a model we have a config for)."""

    n_routed_experts: int
    num_experts_per_tok: int
    hardware: str
    source: str = ""


#: MegaScale-Infer's MoE example: 8 experts, top-2, on A100.
MEGASCALE_INFER_EXAMPLE = MoEExample(
    n_routed_experts=8, num_experts_per_tok=2, hardware="a100",
    source="MegaScale-Infer (arXiv 2504.02263) sec. 2: 8 experts, top-2, on A100 (312 TFLOPS / 2 TB/s)",
)


@dataclasses.dataclass(frozen=True)
class DecodeBatchMeasurement:
    """A measured colocated decode setting: the per-rank KV capacity bounds the batch."""

    model: str
    hardware: str
    kv_token_capacity: int        # KV-cache tokens one rank can hold
    context_len: int              # context of the reference point, tokens
    moe_mfu: float                # measured MoE FFN MFU at that point
    source: str = ""


#: Colocated Qwen3-235B decode on GB200: per-rank KV capacity and the measured MoE MFU at 2K context.
QWEN3_GB200_COLOCATED = DecodeBatchMeasurement(
    model="Qwen3-235B-A22B-FP8", hardware="gb200", kv_token_capacity=808_704,
    context_len=2 * 1024, moe_mfu=0.28,
    source=("FastAFD talk (Chinese write-up of the vLLM AFD/FastAFD lesson, sec. 1, slide 20): "
            "colocated decode on GB200 NVL72, 'KV cache limit 808,704 tokens per rank'; "
            "MoE FFN MFU 28 % at 2K (B = 395), 0.5 % at 128K (B = 6), measured"),
)
