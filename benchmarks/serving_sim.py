"""Serving-simulator speed: 100,000 requests on a 16-instance deployment.

Prints wall time and events/s for colocated (16), PD (8P8D) and PD with a prefix cache,
DeepSeek-V3 on 32 x H800 per instance (LinearStepCost from the roofline). The target is
< 30 s per run on this machine (2 cores). Run: python benchmarks/serving_sim.py [N]
"""

import sys
import time

import pdjax
from pdjax import sim


def main(n: int = 100_000) -> None:
    cost = sim.LinearStepCost.from_roofline(pdjax.configs.deepseek_v3(), "h800", ep_size=32)
    t = time.perf_counter()
    spec = sim.WorkloadSpec(num_requests=n, rate=200.0, seed=0,
                            input={"kind": "lognormal", "mean": 4096, "cv": 1.0, "high": 32768},
                            output={"kind": "lognormal", "mean": 256, "cv": 0.8, "high": 2048},
                            system_prompts=16, system_prompt_len=1024,
                            turns={"kind": "uniform", "low": 1, "high": 3}, think_time=5.0)
    reqs = sim.generate(spec)
    print(f"workload: {n:,} requests generated in {time.perf_counter() - t:.2f} s")
    slo = sim.SLO(ttft=2.0, tpot=0.03)
    link = 32 * 50e9
    cases = [("colocated 16", sim.Colocated(16), None),
             ("PD 8P8D", sim.PDDisaggregated(8, 8, link_bw=link), None),
             ("PD 8P8D + prefix cache", sim.PDDisaggregated(8, 8, link_bw=link),
              lambda: sim.PrefixCache(1 << 16, 64))]
    print(f"{'deployment':<24} {'wall s':>7} {'events':>10} {'events/s':>10} {'sim span s':>10} "
          f"{'finished':>9} {'goodput':>8}")
    for label, dep, cache in cases:
        t = time.perf_counter()
        res = sim.simulate(dep, cost, reqs, slo=slo, prefix_cache=cache() if cache else None)
        wall = time.perf_counter() - t
        s = res.summary
        print(f"{label:<24} {wall:7.2f} {res.events:10,} {res.events / wall:10,.0f} {s['span_s']:10.1f} "
              f"{s['finished']:9,} {s['goodput_rps']:8.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
