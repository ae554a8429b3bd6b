"""The figures of DeepSeek's published training profile, read with pdjax.analysis.profile.

``train.json`` (deepseek-ai/profile-data; not in this repository: it carries no licence) is a
PyTorch-profiler capture of one DualPipe overlapped forward & backward chunk pair of 4 MoE
layers of DeepSeek-V3 (EP64, 4K sequence, H800). Run from the repository root:

    .venv/bin/python scripts/derive_train_profile.py path/to/train.json

It prints, in milliseconds: kernel time per op class and in all, the makespan, each stream's
busy time, the compute / communication overlap, kernel time per chunk (F, B, W) and class,
kernel time per annotation and layer by class, and each annotation's time per layer (kernel
time, and its kernels' extent on the GPU: first start to last end).
"""

import argparse

from pdjax.analysis.profile import read_profile
from pdjax.analysis.streams import OP_CLASSES, makespan

MS = 1e3


def _row(label: str, times: dict, width: int) -> str:
    cells = "".join(f"{times[c] * MS:>11.3f}" for c in OP_CLASSES)
    return f"{label:<{width}}{cells}{sum(times.values()) * MS:>11.3f}"


def _header(label: str, width: int) -> str:
    return f"{label:<{width}}" + "".join(f"{c:>11}" for c in (*OP_CLASSES, "total"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="path to train.json (a PyTorch-profiler Chrome trace)")
    prof = read_profile(parser.parse_args().trace)

    print(f"{prof!r}\n\nkernel time per op class (ms, all streams):")
    for op_class, seconds in prof.op_times().items():
        print(f"  {op_class:<10}{seconds * MS:>10.3f}")
    print(f"  {'total':<10}{prof.total_kernel_s * MS:>10.3f}")
    print(f"\nmakespan (first kernel start to last kernel end): {prof.makespan_s * MS:.3f} ms")
    print(f"compute streams {list(prof.compute_streams)}, communication streams {list(prof.comm_streams)}")
    print("busy time per stream (ms, union of its kernels):")
    for stream, seconds in prof.stream_busy().items():
        print(f"  stream {stream:<4}{seconds * MS:>10.3f}  ({seconds / prof.makespan_s:.1%} of the makespan)")
    print(f"compute / communication overlap: {prof.overlap_s * MS:.3f} ms")

    print("\nkernel time per chunk and op class (ms):")
    print("  " + _header("chunk", 8))
    for chunk, times in prof.chunk_times().items():
        print("  " + _row(chunk or '""', times, 8))

    groups, group_times = prof.group_spans(), prof.group_times()
    layers = sorted({index for _, index in groups})
    names = list(dict.fromkeys(name for name, _ in groups))
    print("\nkernel time per annotation, layer and op class (ms):")
    print("  " + _header("annotation, layer", 20))
    for name in names:
        for layer in layers:
            if (name, layer) in group_times:
                print("  " + _row(f"{name or '(none)'} {layer}", group_times[(name, layer)], 20))

    print("\ntime of each annotation per layer (ms): kernel time (all streams) / GPU extent of its kernels")
    print("  " + f"{'annotation':<14}" + "".join(f"{f'layer {i}':>20}" for i in layers) + f"{'mean kernel':>14}")
    for name in names:
        cells, kernel_ms = "", []
        for layer in layers:
            spans = groups.get((name, layer))
            if spans is None:
                cells += f"{'-':>20}"
                continue
            kernel_ms.append(sum(s.duration_s for s in spans) * MS)
            cells += f"{kernel_ms[-1]:>10.3f} /{makespan(spans) * MS:>8.3f}"
        print("  " + f"{name or '(none)':<14}{cells}{sum(kernel_ms) / len(kernel_ms):>14.3f}")

    calibration_figures(prof)


#: Forward "other" kernels only training needs: FP8 copies kept for the backward, transposes
#: for the weight gradients, the auxiliary-loss statistics and noise.
TRAINING_ONLY = ("special_fmt", "batched_transpose", "utils::transpose", "aux_fi", "DistributionNormal",
                 "reduce_kernel")
SHORT_US = 5.0     # a kernel this short at 4,096 tokens cannot stream one activation pass


def calibration_figures(prof) -> None:
    """The numbers pdjax.analysis.calibration.TRAIN_PROFILE_RAW records, derived here."""
    groups = prof.group_spans()
    fwd = [s for (name, _), spans in groups.items() if name in ("attn(F)", "mlp(F)") for s in spans]
    other = [s for s in fwd if s.op_class == "other"]
    train_only = [s for s in other if any(t in s.label for t in TRAINING_ONLY)]
    short = [s for s in other if s not in train_only and s.duration_s * 1e6 <= SHORT_US]
    fa = [s for s in fwd if s.op_class == "attention"]
    bwd_attn = [s for (name, _), spans in groups.items() if name == "attn(B)" for s in spans
                if s.op_class == "attention"]
    wgrad = [s for (name, _), spans in groups.items() if name in ("mlp(W)", "attn(W)") for s in spans
             if s.op_class == "gemm"]
    comm = [s for s in prof.spans if s.op_class in ("dispatch", "combine")]
    print("\nfigures for pdjax.analysis.calibration.TRAIN_PROFILE_RAW (us):")
    print(f"  FlashAttention forward kernels: {[round(s.duration_s * 1e6) for s in fa]}")
    print(f"  FlashAttention backward per layer (with pre/post-processing): {sum(s.duration_s for s in bwd_attn) * 1e6 / 4:.0f}")
    print(f"  forward other: {sum(s.duration_s for s in other) * 1e6:.0f} in {len(other)} kernels")
    print(f"    of which training-only {sum(s.duration_s for s in train_only) * 1e6:.0f} ({len(train_only)} kernels)")
    print(f"    of which the rest <= {SHORT_US:g} us: {sum(s.duration_s for s in short) * 1e6:.0f} ({len(short)} kernels)")
    print(f"  weight-gradient GEMMs (mlp(W), attn(W)): {sum(s.duration_s for s in wgrad) * 1e6:.0f}")
    print(f"  DeepEP kernel grids are not in Span; the comm stream's kernels: {len(comm)}")


if __name__ == "__main__":
    main()
