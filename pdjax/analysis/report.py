"""The analysis sheet: every roofline / KV / MoE / pipeline quantity of (config, hardware),
returned as data and printed readably; plus a short markdown section for reports.

The ``[decode]`` section is the op-level model's (:func:`pdjax.analysis.predict`): the KV
bytes per token DeepSeek's decode kernels read and, at a few contexts, the attention (and with
DeepSeek-V3.2's sparse attention the lightning indexer) per request and layer and the step
of a decode instance.

Keys carry their unit as a suffix: ``_B`` bytes, ``_GB`` 1e9 bytes, ``_GiB`` 2**30 bytes,
``_s`` seconds, ``_B_per_s`` bytes/s, ``_flop_per_B`` FLOP per byte; fractions are in
[0, 1] and unit-free.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from pdjax.analysis import afd_bounds, bubbles, kv, moe_bounds, roofline
from pdjax.analysis.hardware import HardwareLike, hardware
from pdjax.param_counts import param_counts
from pdjax.arguments import check_fraction, check_int, check_nonnegative, check_positive
from pdjax.analysis.units import GB, GiB, format_bytes, format_count
from pdjax.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Report:
    """The whole sheet; each section is a flat dict of unit-suffixed keys."""

    model: str
    hardware: str
    params: dict
    roofline: dict
    attention: dict
    memory: dict
    handoff: dict
    moe: dict
    pipeline: dict
    afd: dict
    decode: dict = dataclasses.field(default_factory=dict)

    SECTIONS = ("params", "roofline", "attention", "memory", "handoff", "moe", "pipeline", "afd", "decode")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(str(self))}</pre>"

    def __str__(self) -> str:
        lines = [f"pdjax analysis: {self.model} on {self.hardware}"]
        for name in self.SECTIONS:
            lines.append(f"[{name}]")
            for key, value in getattr(self, name).items():
                lines.append(f"  {key:<40} {_fmt(value)}")
        return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 1e6 or (value and abs(value) < 1e-3):
        return f"{value:.4g}"
    return f"{value:,.4g}"


def describe(cfg: ModelConfig) -> str:
    """A one-line name of a config (ModelConfig carries no name)."""
    counts = param_counts(cfg)
    return (f"{cfg.model_type} ({format_count(counts.total)} total, {format_count(counts.active)} active, "
            f"{cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok})")


def _optional(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError:
        return None  # a figure the hardware does not publish


def _check_sizes(cfg, *, context_len, handoff_context_len, ep_size, pipeline_stages, act_bytes, weight_dtype_bytes,
                 kv_dtype_bytes, bubble_target, microbatches, decode_contexts=()) -> None:
    """report's numeric arguments, each named when it is not what it must be (``ep_size``
    also against ``cfg``'s routed experts, :func:`moe_bounds.check_ep_size`)."""
    for name, value in (("context_len", context_len), ("handoff_context_len", handoff_context_len),
                        ("ep_size", ep_size), ("pipeline_stages", pipeline_stages)):
        check_int(name, value)
    moe_bounds.check_ep_size(cfg, ep_size)
    check_nonnegative("act_bytes", act_bytes)
    check_positive("weight_dtype_bytes", weight_dtype_bytes)
    check_positive("kv_dtype_bytes", kv_dtype_bytes)
    check_fraction("bubble_target", bubble_target)
    for m in microbatches:
        check_int("microbatches entry", m)
    for c in decode_contexts:
        check_int("decode_contexts entry", c)


#: report's ``dtype`` shorthands: (compute dtype, weight bytes, KV bytes per cached value).
DTYPES = {"bf16": ("bf16", 2, 2), "fp8": ("fp8", 1, 1)}
#: The contexts of the [decode] section by default.
DECODE_CONTEXTS = (4096, 32768, 131072)


def report(cfg: ModelConfig, hw: HardwareLike, *, dtype: Optional[str] = None, context_len: int = 4096,
           handoff_context_len: int = 32768, compute_dtype: Optional[str] = None,
           weight_dtype_bytes: Optional[float] = None, kv_dtype_bytes: Optional[float] = None,
           ep_size: Optional[int] = None, ep_layout: str = "even", act_bytes: float = 0.0, link: str = "scale_out",
           num_kv_groups: Optional[int] = None, pipeline_stages: int = 16,
           microbatches: Sequence[int] = (16, 32, 64, 128, 256), bubble_target: float = 0.1,
           speculative: Optional[str] = None, decode_contexts: Sequence[int] = DECODE_CONTEXTS,
           verbose: bool = False) -> Report:
    """Compute the analysis sheet of ``cfg`` on ``hw``; returns it (``print(sheet)`` or
    ``verbose=True`` prints it; in a notebook it displays as a table).

    ``dtype`` ("bf16", the default, or "fp8": :data:`DTYPES`) sets ``compute_dtype``,
    ``weight_dtype_bytes`` and ``kv_dtype_bytes`` together; any of the three given explicitly
    overrides it. ``decode_contexts``: the contexts of the [decode] section (() for none).

    ``context_len`` S for the concurrency bound; ``handoff_context_len`` for the P->D KV
    transfer; weights held as ``weight_dtype_bytes`` per param split over ``ep_size``
    ranks with ``ep_layout`` ("even" or "replicated", see ``ep_weight_bytes_per_gpu``; an
    ``ep_size`` above a MoE model's routed experts per layer is refused; None, the default:
    the smallest EP at which the weights and ``act_bytes`` fit,
    :func:`~pdjax.analysis.moe_bounds.smallest_fitting_ep`, and ``memory["ep_size_chosen"]``
    says so);
    ``act_bytes`` reserved for activations; ``link`` the handoff link ("scale_out" or
    "scale_up"); ``num_kv_groups`` adds a GQA row. ``speculative="mtp"``: the MTP modules'
    weights and their layers' KV count too (they are served only for speculative decoding;
    ``params["mtp"]`` says how many). Figures the hardware lacks are None,
    except the ones every row needs (bf16 peak, HBM bytes and bandwidth): ValueError."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"report expects a ModelConfig, got {type(cfg).__name__}")
    compute_dtype, weight_dtype_bytes, kv_dtype_bytes = _dtypes(dtype, compute_dtype, weight_dtype_bytes,
                                                                kv_dtype_bytes)
    hw = hardware(hw)
    mtp = _served_mtp_layers(cfg, speculative)
    chosen = ep_size is None
    ep_size = _ep_that_fits(cfg, hw, weight_dtype_bytes, ep_layout, act_bytes, mtp) if chosen else ep_size
    _check_sizes(cfg, context_len=context_len, handoff_context_len=handoff_context_len, ep_size=ep_size,
                 pipeline_stages=pipeline_stages, act_bytes=act_bytes, weight_dtype_bytes=weight_dtype_bytes,
                 kv_dtype_bytes=kv_dtype_bytes, bubble_target=bubble_target, microbatches=microbatches,
                 decode_contexts=decode_contexts)
    hbm = hw.require("hbm_bytes", "the memory sheet")
    counts = param_counts(cfg, mtp_layers=mtp)
    p_w = weight_dtype_bytes
    roof = _roofline_section(hw, compute_dtype, p_w)
    attention, mla_kv = _attention_section(cfg, kv_dtype_bytes, num_kv_groups)
    mha_kv = attention["mha_kv_per_token_B"]
    memory = _memory_section(cfg, counts, hbm, p_w, ep_size, ep_layout, act_bytes, context_len,
                             mla_kv * (cfg.num_hidden_layers + mtp) / cfg.num_hidden_layers, mha_kv)
    memory["ep_size_chosen"] = chosen
    handoff = _handoff_section(hw, counts, link, handoff_context_len, compute_dtype, mla_kv, mha_kv)
    moe_sheet = _moe_section(cfg, hw, compute_dtype, p_w)
    pipeline, afd_sheet = _pipeline_sections(pipeline_stages, microbatches, bubble_target)
    out = Report(model=describe(cfg), hardware=hw.name, params=_params_section(counts, p_w), roofline=roof,
                 attention=attention, memory=memory, handoff=handoff, moe=moe_sheet,
                 pipeline=pipeline, afd=afd_sheet, decode=decode_section(cfg, hw, ep_size, p_w, decode_contexts))
    if verbose:
        print(out)
    return out


def _pipeline_sections(pipeline_stages: int, microbatches, bubble_target: float) -> tuple[dict, dict]:
    """The [pipeline] section (1F1B bubbles) and the [afd] section (micro-batches to hide the exchange)."""
    table = bubbles.bubble_table(pipeline_stages, microbatches)
    pipeline = {"stages": pipeline_stages,
                "bubble_1f1b": {m: round(r, 4) for m, r in table.items()},
                f"microbatches_for_bubble_below_{bubble_target:g}":
                    bubbles.min_microbatches_1f1b(pipeline_stages, bubble_target)}
    afd_sheet = {"min_microbatches_Tc_half_Tf": afd_bounds.afd_min_microbatches(0.5, 1.0),
                 "min_microbatches_Tc_eq_Tf": afd_bounds.afd_min_microbatches(1.0, 1.0)}
    return pipeline, afd_sheet


def _dtypes(dtype: Optional[str], compute_dtype, weight_dtype_bytes, kv_dtype_bytes) -> tuple:
    """(compute dtype, weight bytes, KV bytes) of report's arguments: ``dtype``'s
    (:data:`DTYPES`; None: "bf16") where not given explicitly."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {dtype!r}")
    default = DTYPES[dtype or "bf16"]
    return tuple(d if v is None else v for d, v in zip(default, (compute_dtype, weight_dtype_bytes, kv_dtype_bytes)))


def _params_section(counts, p_w: float) -> dict:
    """The [params] section: the counts, MTP apart (0 unless served), and the weights' size."""
    return {"total": counts.total, "active": counts.active, "active_with_embedding": counts.active_with_embedding,
            "routed_experts": counts.routed_experts, "non_routed": counts.non_routed, "mtp": counts.mtp,
            "weights_total_GB": counts.total * p_w / GB, "weight_dtype_bytes": p_w}


def _roofline_section(hw, compute_dtype: str, p_w: float) -> dict:
    """The [roofline] section: weight intensity, machine balance, decode bound."""
    return {
        "compute_dtype": compute_dtype,
        "weight_intensity_B1_flop_per_B": roofline.weight_intensity(1, p_w),
        "machine_balance_bf16_flop_per_B": roofline.machine_balance(hw, "bf16"),
        "machine_balance_fp8_flop_per_B": _optional(roofline.machine_balance, hw, "fp8"),
        "decode_utilisation_bound_B1": roofline.decode_utilisation_bound(
            hw, 1, compute_dtype, weight_dtype_bytes=p_w),
        "compute_bound_batch": roofline.compute_bound_batch(hw, compute_dtype, p_w),
    }


def _attention_section(cfg: ModelConfig, kv_dtype_bytes: float,
                       num_kv_groups: Optional[int]) -> tuple[dict, float]:
    """The [attention] section: KV bytes per token and intensity of MLA, MHA, (GQA,) MQA;
    and MLA's KV bytes per token."""
    kinds = [("mla", None), ("mha", None), ("mqa", None)]
    if num_kv_groups is not None:
        kinds.insert(2, ("gqa", num_kv_groups))
    mla_kv = kv.kv_bytes_per_token(cfg, kv_dtype_bytes, "mla")
    attention = {}
    for kind, groups in kinds:
        name = kind if groups is None else f"gqa{groups}"
        per_tok = kv.kv_bytes_per_token(cfg, kv_dtype_bytes, kind, groups)
        attention[f"{name}_kv_per_token_B"] = per_tok
        attention[f"{name}_intensity_flop_per_B"] = roofline.attention_intensity(
            cfg, kind, kv_dtype_bytes, groups)
    mha_kv = attention["mha_kv_per_token_B"]
    attention["mha_over_mla_kv_ratio"] = mha_kv / mla_kv
    attention["kv_dtype_bytes"] = kv_dtype_bytes
    attention["mla_kv_per_token_deepseek_fp8_B"] = _optional(kv.kv_bytes_per_token, cfg, layout="deepseek-fp8")
    if cfg.sparse_attention:
        attention["indexer_kv_per_token_B"] = kv.kv_row_bytes(cfg, "uniform", kv_dtype_bytes)["indexer"] * \
            cfg.num_hidden_layers
        attention["index_topk"] = cfg.index_topk
    return attention, mla_kv


def _served_mtp_layers(cfg: ModelConfig, speculative) -> int:
    """The MTP modules a server holds: the config's with ``speculative="mtp"``, else none."""
    if speculative not in (None, "mtp"):
        raise ValueError(f"speculative must be None or 'mtp', got {speculative!r}")
    if speculative and not cfg.num_nextn_predict_layers:
        raise ValueError("speculative='mtp' needs a config with MTP modules (num_nextn_predict_layers >= 1)")
    return cfg.num_nextn_predict_layers if speculative else 0


def _ep_that_fits(cfg: ModelConfig, hw, weight_dtype_bytes: float, ep_layout: str, act_bytes: float,
                  mtp: int = 0) -> int:
    """report's default EP size: the smallest at which the weights and ``act_bytes`` fit."""
    check_nonnegative("act_bytes", act_bytes)
    return moe_bounds.smallest_fitting_ep(cfg, hw.require("hbm_bytes", "the memory sheet"),
                                          check_positive("weight_dtype_bytes", weight_dtype_bytes), ep_layout,
                                          act_bytes, mtp)


def _moe_section(cfg: ModelConfig, hw, compute_dtype: str, p_w: float) -> dict:
    """The [moe] section (empty for a dense model)."""
    if not cfg.n_routed_experts:
        return {}
    return {"mfu_bound_k_over_E": moe_bounds.moe_mfu_bound(cfg),
            "tokens_per_expert_at_balance": moe_bounds.tokens_per_expert_at_balance(cfg, hw, compute_dtype, p_w),
            "expert_balance_batch": moe_bounds.expert_balance_batch(cfg, hw, compute_dtype, p_w)}


def _memory_section(cfg: ModelConfig, counts, hbm: float, p_w: float, ep_size: int, ep_layout: str,
                    act_bytes: float, context_len: int, mla_kv: float, mha_kv: float) -> dict:
    """The [memory] section: weights per device, what is left of HBM, C_max MLA vs MHA."""
    weights = moe_bounds.ep_weight_bytes_per_gpu(cfg, ep_size, p_w, ep_layout, counts.mtp_layers) \
        if cfg.n_routed_experts else (counts.total + counts.mtp) * p_w / check_int("ep_size", ep_size)
    free = hbm - weights - act_bytes
    fits = free > 0
    free_b = max(free, 0.0)
    return {
        "hbm_GB": hbm / GB,
        "weights_per_gpu_GB": weights / GB,
        "ep_size": ep_size,
        "ep_layout": ep_layout,
        "act_reserved_GB": act_bytes / GB,
        "weights_fit": fits,
        "free_GB": free_b / GB,
        "free_GiB": free_b / GiB,
        "context_len": context_len,
        "mla_kv_per_sequence_GB": context_len * mla_kv / GB,
        "mha_kv_per_sequence_GB": context_len * mha_kv / GB,
        "c_max_mla": free_b / (context_len * mla_kv),
        "c_max_mha": free_b / (context_len * mha_kv),
    }


def _handoff_section(hw, counts, link: str, handoff_context_len: int, compute_dtype: str,
                     mla_kv: float, mha_kv: float) -> dict:
    """The [handoff] section: P->D KV transfer time over ``link`` against the prefill."""
    if link not in ("scale_up", "scale_out"):              # a typo is an error, not a missing figure
        raise ValueError(f"link must be 'scale_up' or 'scale_out', got {link!r}")
    bw = _optional(hw.link_bw, link)
    peak = hw.peak_flops(compute_dtype)
    handoff = {"link": link, "link_bw_B_per_s": bw, "context_len": handoff_context_len}
    if bw is not None:
        handoff["mla_time_s"] = kv.kv_handoff_time(handoff_context_len, mla_kv, bw)
        handoff["mha_time_s"] = kv.kv_handoff_time(handoff_context_len, mha_kv, bw)
        handoff["mla_ratio_to_prefill"] = kv.handoff_to_prefill_ratio(mla_kv, counts.active, peak, bw)
    handoff["prefill_compute_s"] = kv.prefill_compute_time(handoff_context_len, counts.active, peak)
    handoff["link_bw_for_50pct_B_per_s"] = kv.link_bw_for_handoff_ratio(0.5, mla_kv, counts.active, peak)
    return handoff


def decode_section(cfg: ModelConfig, hw, ep_size: int, weight_dtype_bytes: float,
                   contexts: Sequence[int] = DECODE_CONTEXTS) -> dict:
    """The [decode] section (empty for a dense model or no ``contexts``): the layout and KV
    bytes per token DeepSeek's decode kernels read (:func:`pdjax.analysis.kv.serving_kv_layout`),
    and per context the op model's attention and indexer seconds for one request's token in one
    layer (:func:`pdjax.analysis.opmodel.attention_part`) and the step of a decode instance of
    ``ep_size`` GPUs at its saturation batch (:func:`pdjax.analysis.predict`); None where the
    hardware lacks a figure, the weights do not fit or the weight bytes are neither 1 nor 2."""
    from pdjax.analysis.deploy import Deployment, predict
    from pdjax.analysis.kernels import KernelModel
    from pdjax.analysis.opmodel import attention_part
    if not cfg.n_routed_experts or not contexts:
        return {}
    layout, _ = kv.serving_kv_layout(cfg)
    out = {"kv_layout": layout, "kv_per_token_B": kv.serving_kv_bytes_per_token(cfg)}
    km = _optional(KernelModel, hw)
    parts = {c: km and _optional(attention_part, km, cfg, decode=[(1, c)], moe=False, weight_dtype="bf16")
             for c in contexts}
    out["attention_per_request_layer_s"] = {c: p and p.attention for c, p in parts.items()}
    out["indexer_per_request_layer_s"] = {c: p and p.indexer for c, p in parts.items()}
    weights = {1: "fp8", 2: "bf16"}.get(weight_dtype_bytes)
    preds = {c: weights and _optional(lambda c=c: predict(Deployment(cfg, hw, "decode", gpus=ep_size, ep=ep_size,
                                                                      input_len=c, weight_dtype=weights)))
             for c in contexts}
    out["batch_per_gpu"] = {c: p and p.batch_per_gpu for c, p in preds.items()}
    out["step_time_s"] = {c: p and p.step_time_s for c, p in preds.items()}
    out["tokens_per_s_per_gpu"] = {c: p and p.tokens_per_s_per_gpu for c, p in preds.items()}
    return out


def _bytes_label(n: float) -> str:
    label = format_bytes(n)
    return f"{n:,.0f} B" + ("" if label.endswith(" B") else f" ({label})")


def quickstart_section(cfg: ModelConfig, hw: HardwareLike, *, context_len: int = 4096,
                       kv_dtype_bytes: float = 2, weight_dtype_bytes: float = 2,
                       ep_size: int = 1, compute_dtype: str = "bf16") -> str:
    """A few lines of markdown for the quick-start report: KV bytes per token MLA vs MHA,
    machine balance, and C_max (decimal bytes) at ``context_len``."""
    sheet = report(cfg, hw, context_len=context_len, kv_dtype_bytes=kv_dtype_bytes,
                   weight_dtype_bytes=weight_dtype_bytes, ep_size=ep_size, verbose=False,
                   compute_dtype=compute_dtype, decode_contexts=())
    a, r, m = sheet.attention, sheet.roofline, sheet.memory
    mla, mha = a["mla_kv_per_token_B"], a["mha_kv_per_token_B"]
    dtype = {2: "bf16", 1: "fp8"}.get(kv_dtype_bytes, f"{kv_dtype_bytes} B/elem")
    lines = [
        f"### Roofline and KV accounting ({sheet.hardware})",
        "",
        f"Model: {sheet.model}.",
        "",
        f"- KV cache per token ({dtype}): MLA {_bytes_label(mla)} vs MHA counterfactual "
        f"{_bytes_label(mha)}: {a['mha_over_mla_kv_ratio']:.1f}x smaller.",
        f"- Machine balance A* = peak / HBM bandwidth: {r['machine_balance_bf16_flop_per_B']:.0f} FLOP/B "
        f"(bf16), {r['machine_balance_fp8_flop_per_B'] or float('nan'):.0f} (fp8). With {compute_dtype} compute and "
        f"{weight_dtype_bytes:g}-byte weights, decode at B = 1 uses at most {100 * r['decode_utilisation_bound_B1']:.2f} % of peak "
        f"and needs ~{r['compute_bound_batch']:.0f} concurrent sequences to be compute-bound.",
    ]
    if m["weights_fit"]:
        lines.append(
            f"- C_max at S = {context_len:,} ({m['free_GB']:.1f} GB free after "
            f"{format_bytes(m['weights_per_gpu_GB'] * GB, binary=False)} of weights per device, EP{ep_size}, decimal units): "
            f"MLA {m['c_max_mla']:,.1f} vs MHA {m['c_max_mha']:,.2f} sequences per device.")
    else:
        lines.append(f"- C_max: the weights ({m['weights_per_gpu_GB']:.1f} GB per device at EP{ep_size}) "
                     f"do not fit in {m['hbm_GB']:.0f} GB; raise ep_size.")
    return "\n".join(lines) + "\n"
