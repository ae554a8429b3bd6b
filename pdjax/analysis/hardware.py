"""Accelerator presets with their published figures, and a registry users can extend.

A :class:`HardwareSpec` holds, per accelerator (one GPU/NPU package):

* ``peak_bf16_flops`` / ``peak_fp8_flops``: dense tensor-core peak, FLOP/s (no 2:4 sparsity);
* ``hbm_bytes``: HBM capacity in bytes, from the vendor label read in decimal units
  (an "80 GB" part is 80e9 B here; the physical stacks often hold 80 GiB, see docs);
* ``hbm_bw``: HBM bandwidth, bytes/s;
* ``scale_up_bw``: per-accelerator, per-direction bandwidth of the scale-up fabric
  (NVLink, Infinity Fabric, Huawei UB), bytes/s;
* ``scale_out_bw``: per-accelerator, per-direction bandwidth of the scale-out NIC
  (InfiniBand / RoCE), bytes/s;
* ``scale_up_domain``: accelerators one scale-up fabric joins (8 for an HGX board, 72 for
  a GB200 NVL72 rack): an expert all-to-all within it never crosses the NIC.

A figure the vendor does not publish (e.g. FP8 on A100) is ``None``; any computation
that needs it raises ValueError naming the hardware and the field. Every figure carries a
source note (``spec.source(field)``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from pdjax.arguments import check_positive
from pdjax.analysis.units import GB, TB

#: The numeric fields of a HardwareSpec (each may carry a source note).
FIGURES = ("peak_bf16_flops", "peak_fp8_flops", "hbm_bytes", "hbm_bw", "scale_up_bw", "scale_out_bw",
           "scale_up_domain")
DTYPES = {"bf16": ("peak_bf16_flops", 2), "fp8": ("peak_fp8_flops", 1)}
_DTYPE_ALIASES = {"bfloat16": "bf16", "fp16": "bf16", "float16": "bf16", "float8": "fp8",
                  "fp8_e4m3": "fp8", "e4m3": "fp8"}


def normalise_dtype(dtype: str) -> str:
    """``"bf16"`` or ``"fp8"`` (aliases: bfloat16/fp16, float8/e4m3)."""
    key = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if key not in DTYPES:
        raise ValueError(f"unknown compute dtype {dtype!r}; known: {sorted(DTYPES)}")
    return key


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a compute dtype: bf16 2, fp8 1."""
    return DTYPES[normalise_dtype(dtype)][1]


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """Published figures of one accelerator; SI units (FLOP/s, bytes, bytes/s).

    ``sources`` is a tuple of ``(field, note)`` pairs (a tuple keeps the spec hashable).
    """

    name: str
    peak_bf16_flops: Optional[float] = None
    peak_fp8_flops: Optional[float] = None
    hbm_bytes: Optional[float] = None
    hbm_bw: Optional[float] = None
    scale_up_bw: Optional[float] = None
    scale_out_bw: Optional[float] = None
    description: str = ""
    sources: tuple = ()
    scale_up_domain: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"HardwareSpec.name must be a non-empty string, got {self.name!r}")
        for field in FIGURES:
            value = getattr(self, field)
            if value is not None:
                check_positive(f"hardware {self.name!r} {field}", value)
        if isinstance(self.sources, dict):
            object.__setattr__(self, "sources", tuple(self.sources.items()))
        for item in self.sources:
            if not (isinstance(item, tuple) and len(item) == 2 and item[0] in FIGURES):
                raise ValueError(f"hardware {self.name!r}: sources must be (field, note) pairs with "
                                 f"field in {FIGURES}, got {item!r}")

    def require(self, field: str, purpose: str = "") -> float:
        """The figure ``field``, or ValueError naming this hardware and the missing field."""
        if field not in FIGURES:
            raise ValueError(f"unknown hardware figure {field!r}; known: {FIGURES}")
        value = getattr(self, field)
        if value is None:
            why = f" (needed for {purpose})" if purpose else ""
            raise ValueError(f"hardware {self.name!r} has no {field} figure{why}")
        return value

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype`` ("bf16" or "fp8")."""
        field, _ = DTYPES[normalise_dtype(dtype)]
        return self.require(field, f"{normalise_dtype(dtype)} compute")

    def link_bw(self, link: str) -> float:
        """Per-direction bandwidth of ``link`` ("scale_up" or "scale_out"), bytes/s."""
        if link not in ("scale_up", "scale_out"):
            raise ValueError(f"link must be 'scale_up' or 'scale_out', got {link!r}")
        return self.require(f"{link}_bw", f"{link} transfers")

    def source(self, field: str) -> str:
        """The source note of figure ``field`` ('' if none recorded)."""
        return dict(self.sources).get(field, "")

    def replace(self, **changes) -> "HardwareSpec":
        return dataclasses.replace(self, **changes)


HardwareLike = Union[str, HardwareSpec]
_REGISTRY: dict[str, HardwareSpec] = {}
_ALIASES = {"h100": "h100-sxm", "h800-sxm": "h800", "h200-sxm": "h200", "a100-sxm": "a100", "b200-sxm": "b200",
            "910c": "ascend-910c", "gb200-nvl72": "gb200"}


def _key(name: str) -> str:
    return str(name).strip().lower().replace("_", "-").replace(" ", "-")


def register_hardware(spec: HardwareSpec, *, overwrite: bool = False) -> HardwareSpec:
    """Add ``spec`` to the registry under ``spec.name`` (case/space/underscore-insensitive)."""
    if not isinstance(spec, HardwareSpec):
        raise TypeError(f"register_hardware expects a HardwareSpec, got {type(spec).__name__}")
    key = _key(spec.name)
    if key in _REGISTRY and not overwrite:
        raise ValueError(f"hardware {spec.name!r} is already registered (pass overwrite=True)")
    _REGISTRY[key] = spec
    return spec


def unregister_hardware(name: str) -> None:
    """Remove a user-registered spec (the built-in presets cannot be removed)."""
    key = _key(name)
    key = _ALIASES.get(key, key)
    if key in PRESET_NAMES:
        raise ValueError(f"hardware {name!r} is a built-in preset and cannot be unregistered")
    if _REGISTRY.pop(key, None) is None:
        raise ValueError(f"unknown hardware {name!r}; known: {hardware_names()}")


def hardware(name: HardwareLike) -> HardwareSpec:
    """The registered preset ``name`` (e.g. "h100-sxm", "H800", "ascend_910c"); a
    HardwareSpec passes through unchanged."""
    if isinstance(name, HardwareSpec):
        return name
    key = _key(name)
    try:
        return _REGISTRY[_ALIASES.get(key, key)]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {hardware_names()}") from None


def hardware_names() -> list[str]:
    """Sorted names of every registered hardware spec (the presets and your own)."""
    return sorted(_REGISTRY)


# ---- presets ---------------------------------------------------------------------------
# Dense figures: NVIDIA datasheets print "with sparsity" numbers; dense is half of them.
_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet, SXM column"
_NV_H200 = "NVIDIA H200 Tensor Core GPU datasheet, SXM column"
_NV_A100 = "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column"
_NV_H20 = "NVIDIA HGX H20 product specifications as published by NVIDIA partners (no public NVIDIA datasheet)"
_NV_B200 = "NVIDIA DGX B200 datasheet (8 GPUs)"
_NV_GB200 = "NVIDIA GB200 NVL72 datasheet, per-GPU share of the 72-GPU rack figures"
_AMD = "AMD Instinct MI300X data sheet / CDNA3 white paper"
_DSV3 = "DeepSeek-V3 technical report (arXiv 2412.19437) sec. 3.1/3.2.2"
_CM384 = "Huawei CloudMatrix384 paper (arXiv 2506.12708) sec. 3"

_PRESETS = [
    HardwareSpec(
        "h100-sxm", 989e12, 1979e12, 80 * GB, 3.35 * TB, 450 * GB, 50 * GB,
        "NVIDIA H100 SXM5 80GB (Hopper)",
        (("peak_bf16_flops", f"{_NV_H100}: BF16 1,979 TFLOPS with sparsity -> 989 dense"),
         ("peak_fp8_flops", f"{_NV_H100}: FP8 3,958 TFLOPS with sparsity -> 1,979 dense"),
         ("hbm_bytes", f"{_NV_H100}: 80GB HBM3"),
         ("hbm_bw", f"{_NV_H100}: 3.35TB/s"),
         ("scale_up_bw", f"{_NV_H100}: NVLink 900GB/s (bidirectional) -> 450 GB/s per direction"),
         ("scale_out_bw", "DGX H100: one 400 Gb/s ConnectX-7 NIC per GPU -> 50 GB/s"),
         ("scale_up_domain", "DGX/HGX H100: 8 GPUs joined by NVSwitch")), scale_up_domain=8),
    HardwareSpec(
        "h800", 989e12, 1979e12, 80 * GB, 3.35 * TB, 160 * GB, 50 * GB,
        "NVIDIA H800 SXM5 80GB (export Hopper: H100 compute, cut NVLink); DeepSeek's cluster",
        (("peak_bf16_flops", "NVIDIA H800 datasheet: BF16 1,979 TFLOPS with sparsity -> 989 dense "
                             "(same core as H100 SXM)"),
         ("peak_fp8_flops", "NVIDIA H800 datasheet: FP8 3,958 TFLOPS with sparsity -> 1,979 dense"),
         ("hbm_bytes", "NVIDIA H800 datasheet: 80GB HBM3"),
         ("hbm_bw", "NVIDIA H800 datasheet: 3.35TB/s"),
         ("scale_up_bw", f"{_DSV3}: 'NVLink offers a bandwidth of 160 GB/s' (achievable; datasheet "
                         "NVLink 400GB/s bidirectional = 200 GB/s per direction)"),
         ("scale_out_bw", f"{_DSV3}: IB 50 GB/s per GPU (400 Gb/s ConnectX-7)"),
         ("scale_up_domain", "HGX H800: 8 GPUs per NVLink domain (DeepSeek-V3 report sec. 3.1: 8 GPUs per node)")), scale_up_domain=8),
    HardwareSpec(
        "h200", 989e12, 1979e12, 141 * GB, 4.8 * TB, 450 * GB, 50 * GB,
        "NVIDIA H200 SXM 141GB (Hopper, HBM3e)",
        (("peak_bf16_flops", f"{_NV_H200}: BF16 1,979 TFLOPS with sparsity -> 989 dense"),
         ("peak_fp8_flops", f"{_NV_H200}: FP8 3,958 TFLOPS with sparsity -> 1,979 dense"),
         ("hbm_bytes", f"{_NV_H200}: 141GB HBM3e"),
         ("hbm_bw", f"{_NV_H200}: 4.8TB/s"),
         ("scale_up_bw", f"{_NV_H200}: NVLink 900GB/s (bidirectional) -> 450 GB/s per direction"),
         ("scale_out_bw", "HGX H200 reference: one 400 Gb/s NIC per GPU -> 50 GB/s"),
         ("scale_up_domain", "HGX H200: 8 GPUs joined by NVSwitch")), scale_up_domain=8),
    HardwareSpec(
        "h20", 148e12, 296e12, 96 * GB, 4.0 * TB, 450 * GB, 50 * GB,
        "NVIDIA H20 96GB (export Hopper: cut compute, full NVLink)",
        (("peak_bf16_flops", f"{_NV_H20}: BF16 148 TFLOPS dense"),
         ("peak_fp8_flops", f"{_NV_H20}: FP8 296 TFLOPS dense"),
         ("hbm_bytes", f"{_NV_H20}: 96 GB HBM3"),
         ("hbm_bw", f"{_NV_H20}: 4.0 TB/s"),
         ("scale_up_bw", f"{_NV_H20}: NVLink 900 GB/s (bidirectional) -> 450 GB/s per direction"),
         ("scale_out_bw", "HGX H20 reference: one 400 Gb/s NIC per GPU -> 50 GB/s"),
         ("scale_up_domain", "HGX H20: 8 GPUs joined by NVSwitch")), scale_up_domain=8),
    HardwareSpec(
        "b200", 2.25e15, 4.5e15, 180 * GB, 8 * TB, 900 * GB, 50 * GB,
        "NVIDIA B200 (Blackwell) in an 8-GPU HGX/DGX B200",
        (("peak_bf16_flops", f"{_NV_B200}: FP16/BF16 36 PFLOPS with sparsity / 8 GPUs / 2 = 2.25 PFLOPS dense"),
         ("peak_fp8_flops", f"{_NV_B200}: FP8 72 PFLOPS with sparsity / 8 GPUs / 2 = 4.5 PFLOPS dense"),
         ("hbm_bytes", f"{_NV_B200}: 1,440 GB HBM3e / 8 GPUs = 180 GB"),
         ("hbm_bw", f"{_NV_B200}: 64 TB/s / 8 GPUs = 8 TB/s"),
         ("scale_up_bw", f"{_NV_B200}: NVLink 5 1.8 TB/s per GPU (bidirectional) -> 900 GB/s per direction"),
         ("scale_out_bw", f"{_NV_B200}: 8 x 400 Gb/s ConnectX-7 -> 50 GB/s per GPU"),
         ("scale_up_domain", f"{_NV_B200}: 8 GPUs joined by NVSwitch")), scale_up_domain=8),
    HardwareSpec(
        "a100", 312e12, None, 80 * GB, 2039 * GB, 300 * GB, 25 * GB,
        "NVIDIA A100 SXM4 80GB (Ampere); no FP8 tensor cores",
        (("peak_bf16_flops", f"{_NV_A100}: BF16 312 TFLOPS dense (624 with sparsity)"),
         ("peak_fp8_flops", "A100 has no FP8 tensor-core support: no figure"),
         ("hbm_bytes", f"{_NV_A100}: 80GB HBM2e"),
         ("hbm_bw", f"{_NV_A100}: 2,039GB/s (MegaScale-Infer and the source articles round it "
                    "to 2 TB/s)"),
         ("scale_up_bw", f"{_NV_A100}: NVLink 600GB/s (bidirectional) -> 300 GB/s per direction"),
         ("scale_out_bw", "DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU -> 25 GB/s"),
         ("scale_up_domain", "DGX A100: 8 GPUs joined by NVSwitch")), scale_up_domain=8),
    HardwareSpec(
        "mi300x", 1307.4e12, 2614.9e12, 192 * GB, 5.3 * TB, 448 * GB, 50 * GB,
        "AMD Instinct MI300X 192GB (CDNA3)",
        (("peak_bf16_flops", f"{_AMD}: peak BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity)"),
         ("peak_fp8_flops", f"{_AMD}: peak FP8 2,614.9 TFLOPS dense (5,229.8 with sparsity)"),
         ("hbm_bytes", f"{_AMD}: 192 GB HBM3"),
         ("hbm_bw", f"{_AMD}: 5.3 TB/s peak"),
         ("scale_up_bw", f"{_AMD}: 7 Infinity Fabric links x 64 GB/s per direction = 448 GB/s "
                         "(896 GB/s aggregate bidirectional)"),
         ("scale_out_bw", "typical MI300X platform: one 400 Gb/s NIC per GPU -> 50 GB/s"),
         ("scale_up_domain", "MI300X platform: 8 GPUs fully connected by Infinity Fabric")), scale_up_domain=8),
    HardwareSpec(
        "gb200", 2.5e15, 5e15, 186 * GB, 8 * TB, 900 * GB, 50 * GB,
        "NVIDIA GB200 NVL72, one Blackwell GPU of the rack",
        (("peak_bf16_flops", f"{_NV_GB200}: FP16/BF16 360 PFLOPS with sparsity / 72 / 2 = 2.5 PFLOPS dense"),
         ("peak_fp8_flops", f"{_NV_GB200}: FP8 720 PFLOPS with sparsity / 72 / 2 = 5 PFLOPS dense"),
         ("hbm_bytes", f"{_NV_GB200}: up to 13.4 TB HBM3e / 72 = 186 GB"),
         ("hbm_bw", f"{_NV_GB200}: 576 TB/s / 72 = 8 TB/s"),
         ("scale_up_bw", f"{_NV_GB200}: NVLink 5 1.8 TB/s per GPU (bidirectional) -> 900 GB/s "
                         "per direction"),
         ("scale_out_bw", "GB200 NVL72 reference: one 400 Gb/s ConnectX-7 NIC per GPU -> 50 GB/s"),
         ("scale_up_domain", "GB200 NVL72: one NVLink domain of 72 GPUs (18 compute trays of 4)")), scale_up_domain=72),
    HardwareSpec(
        "ascend-910c", 752e12, None, 128 * GB, 3.2 * TB, 392 * GB, 50 * GB,
        "Huawei Ascend 910C (two 910B-class dies), as deployed in CloudMatrix384; no FP8",
        (("peak_bf16_flops", f"{_CM384}: up to 752 TFLOPS dense BF16/FP16 per 910C (2 x 376)"),
         ("peak_fp8_flops", "Ascend 910C has no native FP8 (INT8 only): no figure"),
         ("hbm_bytes", f"{_CM384}: 128 GB on-package HBM per 910C"),
         ("hbm_bw", f"{_CM384}: 3.2 TB/s per 910C (2 x 1.6 TB/s)"),
         ("scale_up_bw", f"{_CM384}: UB plane 392 GB/s unidirectional per NPU"),
         ("scale_out_bw", f"{_CM384}: RDMA plane up to 400 Gb/s unidirectional per NPU -> 50 GB/s"),
         ("scale_up_domain", "CloudMatrix384 (arXiv 2506.12708): 384 NPUs on one UB plane")), scale_up_domain=384),
]

for _spec in _PRESETS:
    register_hardware(_spec)
#: Names of the built-in hardware presets (h100-sxm, h800, h200, h20, b200, a100, mi300x, gb200, ascend-910c).
PRESET_NAMES = tuple(_key(s.name) for s in _PRESETS)
