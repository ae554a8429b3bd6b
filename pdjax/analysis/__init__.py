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
any hardware), ``routing`` (where routed tokens go), ``layer_gemms`` (a layer's matmuls and
their shapes, the one description the op model, the training pair and the pipeline costs
read), ``opmodel`` (a layer's ops),
``overlap`` / ``streams`` (micro-batches on streams: the one overlap model), ``memory_fit``
(the saturation batch), ``pipeline_costs`` (a pipeline schedule's per-stage training FLOPs,
activations and params from a config, MTP included, for the simulator), ``profile``
(:func:`read_profile`, PyTorch-profiler traces), ``train_pair`` (a DualPipe chunk pair);
``validation_set`` holds the independent measurements it is held against.
See docs/analysis.md for the formulas and the assumptions behind the reference figures
(the worked results of the source articles, recomputed in tests/analysis).

``__all__`` is the face a notebook starts with; every other function is importable from its
module (``pdjax.analysis.kv.kv_elements_per_token``, ``pdjax.analysis.units.GiB``, ...).
"""

from pdjax.submodules import lazy_submodules
from pdjax.analysis.afd_bounds import afd_min_microbatches, afd_speedup
from pdjax.analysis.costmodel import Efficiency, RooflineCostModel
from pdjax.analysis.deploy import Deployment, predict
from pdjax.analysis.hardware import HardwareSpec, hardware, register_hardware
from pdjax.analysis.kv import (concurrency_bound, free_memory_bytes, handoff_to_prefill_ratio, kv_bytes_per_token,
                               kv_handoff_time)
from pdjax.analysis.moe_bounds import decode_batch_for_context, ep_weight_bytes_per_gpu
from pdjax.analysis.pipeline_costs import pipeline_costs
from pdjax.analysis.profile import read_profile
from pdjax.analysis.report import report
from pdjax.analysis.roofline import attention_intensity, machine_balance, weight_intensity
from pdjax.param_counts import param_counts
from pdjax.schedules.formulas import bubble_ratio_1f1b, min_microbatches_1f1b

__all__ = [
    "Deployment", "Efficiency", "HardwareSpec", "RooflineCostModel", "afd_min_microbatches", "afd_speedup",
    "attention_intensity", "bubble_ratio_1f1b", "concurrency_bound", "decode_batch_for_context",
    "ep_weight_bytes_per_gpu", "free_memory_bytes", "handoff_to_prefill_ratio", "hardware", "kv_bytes_per_token",
    "kv_handoff_time", "machine_balance", "min_microbatches_1f1b", "param_counts", "pipeline_costs", "predict",
    "read_profile", "register_hardware", "report", "weight_intensity",
]

__getattr__ = lazy_submodules(__name__)
