"""Deployment arithmetic from a ModelConfig and a hardware description (pure Python).

    hw = pdjax.analysis.hardware("h100-sxm")          # also h800, h200, a100, mi300x, gb200, ascend-910c
    pdjax.analysis.machine_balance(hw, dtype="bf16")  # FLOP per byte
    pdjax.analysis.kv_bytes_per_token(cfg, dtype_bytes=2, attention="mla")  # or mha, gqa, mqa
    pdjax.analysis.bubble_ratio_1f1b(num_stages, num_microbatches)
    print(pdjax.analysis.report(cfg, hw))             # the whole sheet (returned; verbose=True prints)

Modules: ``units`` (GB vs GiB), ``hardware`` (presets, registry), ``pdjax.param_counts``
(total and active parameter counts), ``roofline`` (intensity, machine balance), ``kv`` (KV bytes,
C_max, handoff), ``moe_bounds`` (k/E bound, EP weight bytes), ``afd_bounds`` (ping-pong bound, speedup),
``bubbles`` (1F1B), ``published`` (deployment facts used as inputs), ``report``; the
deployment predictor: ``deploy`` (:class:`Deployment`, :func:`predict`, and the two factors
DeepSeek's inference profiles calibrate), built from
``calibration`` (DeepSeek's published kernel measurements), ``kernels`` (kernel times on
any hardware), ``routing`` (where routed tokens go), ``opmodel`` (a layer's ops),
``overlap`` / ``streams`` (micro-batches on streams: the one overlap model), ``memory_fit``
(the saturation batch), ``profile``
(:func:`read_profile`, PyTorch-profiler traces), ``train_pair`` (a DualPipe chunk pair);
``validation_set`` holds the independent measurements it is held against.
See docs/analysis.md for the formulas and the assumptions behind the reference figures
(the worked results of the source articles, recomputed in tests/analysis).

``__all__`` is the face a notebook starts with; every other function is importable from its
module (``pdjax.analysis.kv.kv_elements_per_token``, ``pdjax.analysis.units.GiB``, ...).
"""

from pdjax.deprecation import package_getattr
from pdjax.analysis.afd_bounds import afd_min_microbatches, afd_speedup
from pdjax.analysis.costmodel import Efficiency, RooflineCostModel
from pdjax.analysis.deploy import Deployment, predict
from pdjax.analysis.hardware import HardwareSpec, hardware, register_hardware
from pdjax.analysis.kv import (concurrency_bound, free_memory_bytes, handoff_to_prefill_ratio, kv_bytes_per_token,
                               kv_handoff_time)
from pdjax.analysis.moe_bounds import decode_batch_for_context, ep_weight_bytes_per_gpu
from pdjax.analysis.profile import read_profile
from pdjax.analysis.report import report
from pdjax.analysis.roofline import attention_intensity, machine_balance, weight_intensity
from pdjax.param_counts import param_counts
from pdjax.schedules.formulas import bubble_ratio_1f1b, min_microbatches_1f1b

__all__ = [
    "Deployment", "Efficiency", "HardwareSpec", "RooflineCostModel", "afd_min_microbatches", "afd_speedup",
    "attention_intensity", "bubble_ratio_1f1b", "concurrency_bound", "decode_batch_for_context",
    "ep_weight_bytes_per_gpu", "free_memory_bytes", "handoff_to_prefill_ratio", "hardware", "kv_bytes_per_token",
    "kv_handoff_time", "machine_balance", "min_microbatches_1f1b", "param_counts", "predict", "read_profile",
    "register_hardware", "report", "weight_intensity",
]

# ---- names that left the face: importable from their module; these aliases go next release ----
_MOVED = {
    **dict.fromkeys(("afd_min_microbatches_int", "attention_share", "dbo_hides_ffn"), "afd_bounds"),
    "bubble_table": "bubbles",
    **dict.fromkeys(("OpCost", "expected_distinct_experts"), "costmodel"),
    **dict.fromkeys(("CalibrationResult", "DecodeCalibrationResult"), "costmodel_calibrate"),
    **dict.fromkeys(("DecodeCostFit", "PrefillCostFit", "fit_decode_cost", "fit_prefill_cost"), "costmodel_fit"),
    **dict.fromkeys(("FIGURES", "PRESET_NAMES", "dtype_bytes", "hardware_names", "unregister_hardware"), "hardware"),
    **dict.fromkeys(("ATTENTION_KINDS", "concurrency_bound_both_units", "kv_bytes_per_sequence",
                     "kv_elements_per_token", "link_bw_for_handoff_ratio", "prefill_compute_time"), "kv"),
    **dict.fromkeys(("expert_balance_batch", "moe_mfu_bound", "tokens_per_expert", "tokens_per_expert_at_balance"),
                    "moe_bounds"),
    **dict.fromkeys(("DEEPSEEK_V3_SERVING", "FASTAFD_EXAMPLE", "MEGASCALE_INFER_EXAMPLE", "QWEN3_GB200_COLOCATED"),
                    "published"),
    **dict.fromkeys(("Report", "describe", "quickstart_section"), "report"),
    **dict.fromkeys(("attention_flops_per_token", "compute_bound_batch", "decode_utilisation_bound",
                     "utilisation_bound"), "roofline"),
    **dict.fromkeys(("GB", "GiB", "KiB", "MiB", "from_bytes", "to_bytes", "unit_bytes"), "units"),
}


# moved out of analysis; the timing functions are runtime (they call the model), found by name at
# call time so that nothing here imports them
_ELSEWHERE = {"ParamCounts": "pdjax.param_counts",
              "microbatches_for_bubble": ("pdjax.schedules.formulas", "min_microbatches_1f1b"),
              **dict.fromkeys(("calibrate", "calibrate_decode", "measure_decode", "measure_prefill"), "pdjax.timing")}
_SUBMODULES = ("afd_bounds", "bubbles", "calibration", "costmodel", "costmodel_calibrate", "costmodel_fit", "deploy",
               "kernels", "kv", "memory_fit", "moe_bounds", "opmodel", "overlap", "profile", "profile_plot",
               "published", "roofline", "routing", "streams", "train_pair", "units", "validation_set")
_RENAMED = {"afd": "afd_bounds", "moe": "moe_bounds"}   # module names that said less than they hold

__getattr__ = package_getattr(__name__, {**{name: f"{__name__}.{module}" for name, module in _MOVED.items()},
                                         **_ELSEWHERE,
                                         **{name: (f"{__name__}.{module}", None) for name, module in _RENAMED.items()}},
                              _SUBMODULES)
