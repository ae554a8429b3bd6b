"""AF-disaggregated decode on simulated CPU devices: measured stages and step time against the
models fed those stages (pdjax.experiments.afd_measure.measure_afd).

Per micro-batch count m: T_attn, T_ffn, T_a2f, T_f2a (medians per MoE layer per micro-batch,
from the engine's timeline), the measured decode step (median inter-token latency once every
prefill is done), the issue-order model (XLA:CPU runs the attention and FFN programs one at a
time in issue order), the overlap model (pdjax.sim.afd_step.AFDStepModel, both sides at once, as on
GPUs), their errors, the ping-pong bound m >= 2(1 + T_c/T_f), the DBO condition and the
speedup model against a colocated engine on the attention devices alone.

Run: PYTHONPATH=. .venv/bin/python benchmarks/afd_stages.py [--preset tiny] [--ratio 4:4]
     [--microbatches 1 2 3] [--slots 24] [--new-tokens 40] [--quick] [--repeats 1]
(--quick: m = 1 and 2, 8 slots, 12 new tokens, no baseline)
"""

from __future__ import annotations

import argparse
import os
import subprocess

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import pdjax  # noqa: E402
from pdjax.experiments.afd_measure import measure_afd  # noqa: E402
from pdjax.experiments.results import markdown_table  # noqa: E402

COLUMNS = ("M", "N", "m", "slots", "t_attn_ms", "t_ffn_ms", "t_a2f_ms", "t_f2a_ms", "t_head_ms", "host_issue_ms",
           "step_measured_ms", "step_traced_ms",
           "step_issue_order_ms", "err_issue_order_pct", "step_overlap_ms", "err_overlap_pct", "pingpong_min_m",
           "pingpong_hides", "dbo_hides_ffn", "speedup_measured", "speedup_predicted")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ratio", default="4:4", help="M:N attention:FFN devices")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--slots", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=1, help="measure this many times (rows of each)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.microbatches, args.slots, args.new_tokens, args.no_baseline = [1, 2], 8, 12, True
    M, N = (int(x) for x in args.ratio.split(":"))
    cfg = pdjax.configs.preset(args.preset)
    params = pdjax.init_params(cfg, jax.random.key(0))
    for rep in range(args.repeats):
        out = measure_afd(params, cfg, attention=M, ffn=N, microbatches=args.microbatches, slots=args.slots,
                          new_tokens=args.new_tokens, baseline=not args.no_baseline)
        print(f"\n{args.preset}, {M}:{N} on {jax.device_count()} CPU devices, repeat {rep + 1}; colocated baseline "
              f"step on the {M} attention devices: {out['baseline_step_ms']} ms")
        print(markdown_table(out["rows"], columns=[c for c in COLUMNS if c in out["rows"][0]]))
    print("\nmachine load:\n" + subprocess.run(["top", "-bn1"], capture_output=True, text=True).stdout
          .split("\n\n")[0])


if __name__ == "__main__":
    main()
