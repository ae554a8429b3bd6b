"""Deployment arithmetic from a ModelConfig and a hardware description (pure Python).

    hw = pdjax.analysis.hardware("h100-sxm")          # also h800, h200, a100, mi300x, gb200, ascend-910c
    pdjax.analysis.machine_balance(hw, dtype="bf16")  # FLOP per byte
    pdjax.analysis.kv_bytes_per_token(cfg, dtype_bytes=2, attention="mla")  # or mha, gqa, mqa
    pdjax.analysis.bubble_ratio_1f1b(num_stages, num_microbatches)
    print(pdjax.analysis.report(cfg, hw))             # the whole sheet (returned; verbose=True prints)

Modules: ``units`` (GB vs GiB), ``hardware`` (presets, registry), ``pdjax.param_counts``
(total and active parameter counts), ``roofline`` (intensity, machine balance), ``kv`` (KV bytes,
C_max, handoff), ``moe`` (k/E bound, EP weight bytes), ``afd`` (ping-pong bound, speedup),
``bubbles`` (1F1B), ``published`` (deployment facts used as inputs), ``report``.
See docs/analysis.md for the formulas and the assumptions behind the reference figures
(the worked results of the source articles, recomputed in tests/analysis).
"""

from pdjax.analysis.afd import (afd_min_microbatches, afd_min_microbatches_int, afd_speedup,
                                attention_share, dbo_hides_ffn)
from pdjax.analysis.bubbles import bubble_ratio_1f1b, bubble_table, min_microbatches_1f1b
from pdjax.analysis.hardware import (FIGURES, PRESET_NAMES, HardwareSpec, dtype_bytes,
                                     hardware, hardware_names, register_hardware,
                                     unregister_hardware)
from pdjax.analysis.kv import (ATTENTION_KINDS, concurrency_bound, concurrency_bound_both_units,
                               free_memory_bytes, handoff_to_prefill_ratio, kv_bytes_per_sequence,
                               kv_bytes_per_token, kv_elements_per_token, kv_handoff_time,
                               link_bw_for_handoff_ratio, prefill_compute_time)
from pdjax.analysis.moe import (decode_batch_for_context, ep_weight_bytes_per_gpu,
                                expert_balance_batch, moe_mfu_bound, tokens_per_expert,
                                tokens_per_expert_at_balance)
from pdjax.param_counts import ParamCounts, param_counts
from pdjax.analysis.published import (DEEPSEEK_V3_SERVING, FASTAFD_EXAMPLE,
                                      MEGASCALE_INFER_EXAMPLE, QWEN3_GB200_COLOCATED)
from pdjax.analysis.report import Report, describe, quickstart_section, report
from pdjax.analysis.roofline import (attention_flops_per_token, attention_intensity,
                                     compute_bound_batch, decode_utilisation_bound,
                                     machine_balance, utilisation_bound, weight_intensity)
from pdjax.analysis.units import GB, GiB, KiB, MiB, from_bytes, to_bytes, unit_bytes

__all__ = [
    "ATTENTION_KINDS", "DEEPSEEK_V3_SERVING", "FASTAFD_EXAMPLE", "FIGURES", "GB", "GiB",
    "HardwareSpec", "KiB", "MEGASCALE_INFER_EXAMPLE", "MiB", "PRESET_NAMES", "ParamCounts",
    "QWEN3_GB200_COLOCATED", "Report", "afd_min_microbatches", "afd_min_microbatches_int",
    "afd_speedup", "attention_flops_per_token", "attention_intensity", "attention_share",
    "bubble_ratio_1f1b", "bubble_table", "compute_bound_batch", "concurrency_bound",
    "concurrency_bound_both_units", "dbo_hides_ffn", "decode_batch_for_context",
    "decode_utilisation_bound", "describe", "dtype_bytes", "ep_weight_bytes_per_gpu",
    "expert_balance_batch", "free_memory_bytes", "from_bytes", "handoff_to_prefill_ratio",
    "hardware", "hardware_names", "kv_bytes_per_sequence", "kv_bytes_per_token",
    "kv_elements_per_token", "kv_handoff_time", "link_bw_for_handoff_ratio", "machine_balance",
    "min_microbatches_1f1b", "moe_mfu_bound", "param_counts", "prefill_compute_time",
    "quickstart_section", "register_hardware", "report", "to_bytes", "tokens_per_expert",
    "tokens_per_expert_at_balance", "unit_bytes", "unregister_hardware", "utilisation_bound", "weight_intensity",
]

# Cost model (docs/analysis.md, "Cost model"): roofline op costs, the fitted prefill cost
# a q^2 + b q c + g q and its time-budget inverse, calibration against the real prefill.
from pdjax.analysis.costmodel import (Efficiency, OpCost, RooflineCostModel,  # noqa: E402
                                      expected_distinct_experts)
from pdjax.analysis.costmodel_calibrate import (CalibrationResult, calibrate,  # noqa: E402
                                                measure_prefill)
from pdjax.analysis.costmodel_fit import PrefillCostFit, fit_prefill_cost  # noqa: E402

__all__ += ["CalibrationResult", "Efficiency", "OpCost", "PrefillCostFit", "RooflineCostModel",
            "calibrate", "expected_distinct_experts", "fit_prefill_cost", "measure_prefill"]

# Decode-step calibration: t(B, K) = d0 + d1 B + d2 K fitted to real pdjax.decode_step times.
from pdjax.analysis.costmodel_calibrate import (DecodeCalibrationResult,  # noqa: E402
                                                calibrate_decode, measure_decode)
from pdjax.analysis.costmodel_fit import DecodeCostFit, fit_decode_cost  # noqa: E402

__all__ += ["DecodeCalibrationResult", "DecodeCostFit", "calibrate_decode", "fit_decode_cost",
            "measure_decode"]


def __getattr__(name):
    """Deprecated aliases, kept for one release."""
    if name == "microbatches_for_bubble":
        import warnings

        warnings.warn("pdjax.analysis.microbatches_for_bubble is min_microbatches_1f1b (one formula, in "
                      "pdjax.schedules.formulas); this alias goes in the next release", DeprecationWarning,
                      stacklevel=2)
        return min_microbatches_1f1b
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
