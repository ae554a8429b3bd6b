"""Predicted throughput of a real deployment: :class:`Deployment` describes it, :func:`predict`
times one step of it with the op model and the overlap model.

    import pdjax, pdjax.analysis as A
    d = A.Deployment(model=pdjax.configs.deepseek_v3(), hardware="h100-sxm", role="prefill",
                     gpus=32, gpus_per_node=8, ep=32, input_len=4096, batch_per_gpu=16384, overlap="tbo")
    p = A.predict(d)
    p.tokens_per_s_per_node, p.step_time_s, p.breakdown

A step on one GPU: every layer of the model for the GPU's batch, split into one micro-batch
(``overlap=None``) or two (``"tbo"``) and scheduled on a compute and a communication stream
(:mod:`pdjax.analysis.overlap`); then the LM head on the sampled positions and, with MTP,
the draft module. Prefill batches are whole prompts (``batch_per_gpu`` tokens of
``input_len``-token prompts, the prefix-cached share not recomputed); decode batches are
``batch_per_gpu`` requests at a KV length of ``input_len`` + half the output. The expert
all-to-all is DeepEP's: normal kernels (holding SMs) for prefill, low-latency kernels
(holding none) for decode. Every kernel time comes from :mod:`pdjax.analysis.kernels`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from pdjax import configs
from pdjax.analysis import calibration as C, memory_fit
from pdjax.analysis.hardware import HardwareLike, hardware
from pdjax.analysis.kernels import KernelModel, train_calibration
from pdjax.analysis.opmodel import (LayerParts, Part, a2a_parts, attention_part, dense_part, lm_head_part,
                                    moe_parts)
from pdjax.analysis.overlap import layer_program, run
from pdjax.analysis.routing import route_stats
from pdjax.analysis.streams import class_times, makespan
from pdjax.arguments import check_fraction, check_int
from pdjax.model_config import ModelConfig

ROLES = ("prefill", "decode")
OVERLAPS = (None, "tbo")
EXPERT_LOADS = ("default", "balanced")
DTYPES = ("fp8", "bf16")


@dataclasses.dataclass(frozen=True)
class Deployment:
    """One serving instance of ``gpus`` GPUs (``gpus_per_node`` a node) running ``role``,
    attention data-parallel and experts over ``ep`` GPUs; see the module docstring.

    ``batch_per_gpu``: tokens (prefill) or requests (decode) per GPU per step, None for the
    saturation batch; ``mtp``: the draft acceptance rate of one MTP token, or None;
    ``expert_load``: "balanced" (every GPU the mean load) or "default" (the busiest GPU of
    uniform group-limited routing over this placement); ``redundant_experts``: extra expert
    slots (EPLB), default enough to spread the experts evenly; ``gemm_kernels``: a GEMM kernel
    set of :data:`pdjax.analysis.calibration.GEMM_KERNELS`."""

    model: ModelConfig
    hardware: HardwareLike
    role: str
    gpus: int
    gpus_per_node: int = 8
    ep: Optional[int] = None
    input_len: int = 4096
    output_len: int = 100
    weight_dtype: str = "fp8"
    attention_dtype: str = "bf16"
    overlap: Optional[str] = "tbo"
    mtp: Optional[float] = None
    batch_per_gpu: Optional[int] = None
    expert_load: str = "default"
    cache_hit_rate: float = 0.0
    redundant_experts: Optional[int] = None
    gemm_kernels: str = "deepgemm-2025-04"

    def __post_init__(self):
        if not isinstance(self.model, ModelConfig):
            raise TypeError(f"Deployment.model must be a ModelConfig, got {type(self.model).__name__}")
        if not self.model.n_routed_experts:
            raise ValueError("Deployment.model must be an MoE model (n_routed_experts > 0)")
        object.__setattr__(self, "hardware", hardware(self.hardware))
        _check_choice("role", self.role, ROLES)
        _check_choice("overlap", self.overlap, OVERLAPS)
        _check_choice("expert_load", self.expert_load, EXPERT_LOADS)
        _check_choice("weight_dtype", self.weight_dtype, DTYPES)
        _check_choice("attention_dtype", self.attention_dtype, ("bf16",))
        check_int("Deployment.gpus", self.gpus)
        check_int("Deployment.gpus_per_node", self.gpus_per_node)
        if self.ep is None:
            object.__setattr__(self, "ep", self.gpus)
        check_int("Deployment.ep", self.ep)
        if self.gpus % self.ep:
            raise ValueError(f"Deployment.gpus={self.gpus} is not a multiple of ep={self.ep}")
        check_int("Deployment.input_len", self.input_len)
        check_int("Deployment.output_len", self.output_len)
        if self.batch_per_gpu is not None:
            check_int("Deployment.batch_per_gpu", self.batch_per_gpu)
        if self.mtp is not None:
            check_fraction("Deployment.mtp", self.mtp, open_low=False)
        check_fraction("Deployment.cache_hit_rate", self.cache_hit_rate, open_low=False)
        if self.cache_hit_rate >= 1:
            raise ValueError(f"Deployment.cache_hit_rate must be < 1, got {self.cache_hit_rate!r}")
        if self.role == "prefill" and self.mtp is not None:
            raise ValueError("Deployment.mtp applies to decode; a prefill deployment takes mtp=None")
        if self.redundant_experts is None:
            E = self.model.n_routed_experts
            object.__setattr__(self, "redundant_experts", -E % self.ep)
        check_int("Deployment.redundant_experts", self.redundant_experts, 0)
        if (self.model.n_routed_experts + self.redundant_experts) % self.ep:
            raise ValueError(f"{self.model.n_routed_experts} experts + {self.redundant_experts} redundant do "
                             f"not split evenly over ep={self.ep} GPUs")

    @property
    def slots(self) -> int:
        """Physical expert slots (experts + redundant)."""
        return self.model.n_routed_experts + self.redundant_experts

    @property
    def microbatches(self) -> int:
        """Micro-batches a step is split into: 2 with two-batch overlap, else 1."""
        return 2 if self.overlap == "tbo" else 1

    @property
    def decode_kv_len(self) -> int:
        """KV length a decode request attends to on average: input + half the output."""
        return self.input_len + self.output_len // 2

    @property
    def tokens_per_request(self) -> int:
        """Tokens a decode request runs per step: 1, or 2 with MTP (the draft verified)."""
        return 2 if self.mtp is not None else 1


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"Deployment.{name} must be one of {choices}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted step: ``tokens_per_s_per_gpu`` (input tokens for prefill, output tokens
    for decode), ``tokens_per_s_per_node``, ``step_time_s``, ``batch_per_gpu``,
    ``breakdown`` (op class -> seconds per step, summed over the ops on both streams),
    ``spans`` (the step's timeline), ``imbalance`` (busiest GPU over the mean) and ``notes``."""

    deployment: Deployment
    tokens_per_s_per_gpu: float
    tokens_per_s_per_node: float
    step_time_s: float
    batch_per_gpu: int
    breakdown: dict
    spans: list = dataclasses.field(repr=False)
    imbalance: float = 1.0
    notes: tuple = ()


def predict(d: Deployment) -> Prediction:
    """The predicted step of deployment ``d`` (see the module docstring)."""
    if not isinstance(d, Deployment):
        raise TypeError(f"predict takes a Deployment, got {type(d).__name__}")
    return _predict(d, comm_factor(d.role) if d.overlap == "tbo" else 1.0)


def _predict(d: Deployment, a2a_factor: float) -> Prediction:
    """:func:`predict` with the all-to-all ``a2a_factor`` times its unit time."""
    km = KernelModel(d.hardware, d.gemm_kernels)
    batch, notes = memory_fit.saturation_batch(d) if d.batch_per_gpu is None else (d.batch_per_gpu, ())
    m = d.microbatches
    if d.role == "prefill":
        tokens = batch
        computed = max(1, round(tokens * (1 - d.cache_hit_rate)))
        per_mb = _prefill_chunks(d, computed)
        mb_tokens = sum(q for q, _ in per_mb[0])
    else:
        tokens = batch * d.tokens_per_request
        per_mb = [[(d.tokens_per_request, d.decode_kv_len)] * (batch // m + (i < batch % m)) for i in range(m)]
        mb_tokens = max(len(r) for r in per_mb) * d.tokens_per_request
    parts, imbalance = _layer_parts(km, d, per_mb[0], mb_tokens, a2a_factor)
    spans = run(layer_program(parts, m, comm_holds_sms=d.role == "prefill"),
                comm_sm_share=train_calibration()["comm_sm_share"])
    step = makespan(spans)
    tail = _step_tail(km, d, batch)
    step += tail.compute
    breakdown = class_times(spans)
    for cls in ("gemm", "other", "indexer"):
        breakdown[cls] += getattr(tail, cls)
    if d.role == "prefill":
        per_gpu = tokens / step
    else:
        per_gpu = batch * (1 + (d.mtp or 0.0)) / step
    return Prediction(d, per_gpu, per_gpu * d.gpus_per_node, step, batch, breakdown, spans, imbalance, notes)


def _prefill_chunks(d: Deployment, computed: int) -> list:
    """Each micro-batch's [(q, c)]: whole prompts of input_len split in two micro-batches of
    equal tokens (DeepSeek balances attention between them, splitting a prompt if needed)."""
    q_len = max(1, round(d.input_len * (1 - d.cache_hit_rate)))
    c_len = d.input_len - q_len
    per = computed / q_len / d.microbatches     # prompts per micro-batch
    whole = int(per)
    chunks = [(q_len, c_len)] * whole
    if per - whole > 1e-9:                      # the share of a prompt split between micro-batches
        chunks.append((max(1, round(q_len * (per - whole))), c_len))
    return [chunks] * d.microbatches


def _layer_parts(km, d: Deployment, reqs, tokens: int, a2a_factor: float) -> tuple[list, float]:
    """The :class:`LayerParts` of every layer for one micro-batch, and the imbalance used."""
    cfg = d.model
    prefill = d.role == "prefill"
    stats = route_stats(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, d.ep,
                        d.gpus_per_node, max(1, tokens), slots=d.slots, samples=2)
    imbalance = 1.0 if d.expert_load == "balanced" else stats.rows_imbalance
    kw = {"chunks": reqs} if prefill else {"decode": reqs}
    attn = attention_part(km, cfg, weight_dtype=d.weight_dtype, **kw)
    attn_dense = attention_part(km, cfg, weight_dtype=d.weight_dtype, moe=False, **kw)
    shared, experts = moe_parts(km, cfg, tokens, ep=d.ep, slots=d.slots, imbalance=imbalance,
                                weight_dtype=d.weight_dtype)
    disp, comb = a2a_parts(km, cfg, tokens, ep=d.ep, stats=stats, kernels="normal" if prefill else "low_latency",
                           intranode=d.ep <= km.hw_domain,
                           imbalance=imbalance)
    disp, comb = Part(comm=disp.comm * a2a_factor), Part(comm=comb.comm * a2a_factor)
    dense = LayerParts(attn_dense, dense=dense_part(km, cfg, tokens, d.weight_dtype))
    moe = LayerParts(attn, shared, experts, disp, comb)
    return [moe if cfg.is_moe_layer(i) else dense for i in range(cfg.num_hidden_layers)], imbalance


def _step_tail(km, d: Deployment, batch: int) -> Part:
    """LM head on the sampled positions (one per prompt in prefill; every token in decode)
    and, with MTP, the draft module (one more MoE layer and LM head over the requests)."""
    cfg = d.model
    if d.role == "prefill":
        return lm_head_part(km, cfg, max(1, batch // d.input_len))
    tail = lm_head_part(km, cfg, batch * d.tokens_per_request)
    if d.mtp is not None:
        attn = attention_part(km, cfg, decode=[(1, d.decode_kv_len)] * batch, weight_dtype=d.weight_dtype)
        shared, experts = moe_parts(km, cfg, batch, ep=d.ep, slots=d.slots, imbalance=1.0, weight_dtype=d.weight_dtype)
        tail = tail + attn + shared + experts + lm_head_part(km, cfg, batch)
    return tail


# ---- what DeepSeek's inference profiles calibrate ------------------------------------------
# The two numbers DeepSeek's inference profiles calibrate, each solved so that pdjax
# predicts the profile's throughput (lm-sys blog 2025-05-05, 'Profile Results', column
# 'DeepSeek Profile'; :data:`pdjax.analysis.calibration.DEEPSEEK_PROFILE`):
#
# * :func:`comm_factor` ("prefill"): how much longer DeepEP's normal kernels take inside
#   DeepSeek's two-micro-batch prefill than in their unit benchmark (SGLang's blog: "both
#   DeepSeek and SGLang have a communication time slower than unit test results");
# * :func:`comm_factor` ("decode"): the same for the low-latency kernels inside DeepSeek's
#   two-micro-batch decode (the blog: dispatch and combine "busy-waiting for data").
#
# Everything else in the prediction of those profiles comes from the kernel tables and
# train.json, so reproducing them is a consistency check of one parameter each, in sample.

#: The kernels DeepSeek's February 2025 profiles ran at (see pdjax.analysis.train_pair).
PROFILE_KERNELS = "deepgemm-2025-02"


def profile_deployment(role: str):
    """The :class:`~pdjax.analysis.deploy.Deployment` of DeepSeek's ``role`` profile."""
    p = next(p for p in C.DEEPSEEK_PROFILE if p.role == role)
    kw = dict(mtp=0.6) if role == "decode" else {}
    return Deployment(configs.deepseek_v3(), p.hardware, role, gpus=p.ep, gpus_per_node=8, ep=p.ep,
                      input_len=p.input_len, output_len=1 if role == "prefill" else 2, batch_per_gpu=p.batch_per_gpu,
                      overlap=p.overlap, expert_load="balanced", gemm_kernels=PROFILE_KERNELS, **kw)


@functools.lru_cache(maxsize=None)
def comm_factor(role: str) -> float:
    """The factor (>= 1) on the all-to-all's unit time at which the ``role`` profile's
    predicted throughput equals its published figure (bisection; 1.0 if even unit-time
    all-to-alls predict less than that)."""
    d = profile_deployment(role)
    target = next(p.tokens_per_s_per_node for p in C.DEEPSEEK_PROFILE if p.role == role)
    lo, hi = 1.0, 8.0
    if _predict(d, lo).tokens_per_s_per_node <= target:
        return lo
    for _ in range(30):
        mid = (lo + hi) / 2
        if _predict(d, mid).tokens_per_s_per_node > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clear_caches() -> None:
    """Forget everything derived from :mod:`pdjax.analysis.calibration` (after editing a
    calibration table in place, e.g. to see how a prediction moves with one source row)."""
    from pdjax.analysis import kernels, routing, train_pair
    for f in (kernels._gemm_curves, kernels.train_calibration, kernels._normal_bandwidths,
              train_pair.wgrad_speed, train_pair._unit_pair, comm_factor, routing.route_stats, routing._route_shape):
        f.cache_clear()
