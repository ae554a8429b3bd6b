"""Serving-simulator speed: 100,000 requests on a 16-instance deployment, with the old linear
roofline cost and with the op-level model's cost (a LinearStepCost fitted once to
pdjax.analysis.predict, pdjax.sim.cost_fit) in the same run.

Prints, per deployment (colocated 16, PD 8P8D, PD with a prefix cache) and cost, the median
of ``REPEATS`` runs of wall time and simulated requests per second, and the op model's
requests/s over the roofline's (the goal: at least 0.95): the runs alternate between the two
costs, and the ratio is the median over the pairs (roofline wall / op-model wall of the same
round), so a change in the shared machine's load between rounds cancels. DeepSeek-V3 on
32 x H800 per instance. Run: python benchmarks/serving_sim.py [N]
"""

import statistics
import sys
import time

import pdjax
from pdjax import analysis as A, sim
from pdjax.sim.cost_fit import linear_cost_from_deployments

REPEATS = 3


def costs():
    v3 = pdjax.configs.deepseek_v3()
    t = time.perf_counter()
    fitted = linear_cost_from_deployments(A.Deployment(v3, "h800", "prefill", gpus=32, ep=32),
                                          A.Deployment(v3, "h800", "decode", gpus=32, ep=32))
    print(f"op-model cost fitted in {time.perf_counter() - t:.2f} s ({fitted.note})")
    return {"roofline": sim.LinearStepCost.from_roofline(v3, "h800", ep_size=32), "op model": fitted}


def main(n: int = 100_000) -> None:
    cost = costs()
    t = time.perf_counter()
    spec = sim.WorkloadSpec(num_requests=n, rate=200.0, seed=0,
                            input={"kind": "lognormal", "mean": 4096, "cv": 1.0, "high": 32768},
                            output={"kind": "lognormal", "mean": 256, "cv": 0.8, "high": 2048},
                            system_prompts=16, system_prompt_len=1024,
                            turns={"kind": "uniform", "low": 1, "high": 3}, think_time=5.0)
    reqs = sim.sample_requests(spec)
    print(f"workload: {n:,} requests generated in {time.perf_counter() - t:.2f} s")
    slo = sim.SLO(ttft=2.0, tpot=0.03)
    link = 32 * 50e9
    cases = [("colocated 16", sim.Colocated(16), None),
             ("PD 8P8D", sim.PDDisaggregated(8, 8, link_bw=link), None),
             ("PD 8P8D + prefix cache", sim.PDDisaggregated(8, 8, link_bw=link),
              lambda: sim.PrefixCache(1 << 16, 64))]
    print(f"{'deployment':<24} {'cost':<9} {'wall s':>7} {'requests/s':>11} {'events':>10} {'goodput':>8} "
          f"{'op/roofline':>11}")
    for label, dep, cache in cases:
        walls = {name: [] for name in cost}
        res = {}
        for _ in range(REPEATS):                 # interleaved: a drift of the machine's load
            for name, c in cost.items():         # falls on both costs alike
                t = time.perf_counter()
                res[name] = sim.simulate_serving(dep, c, reqs, slo=slo, prefix_cache=cache() if cache else None)
                walls[name].append(time.perf_counter() - t)
        pair = statistics.median(o / r for r, o in zip(walls["roofline"], walls["op model"]))
        for name in cost:
            wall = statistics.median(walls[name])
            ratio = f"{1 / pair:11.2f}" if name != "roofline" else f"{'':>11}"
            print(f"{label:<24} {name:<9} {wall:7.2f} {n / wall:11,.0f} {res[name].events:10,} "
                  f"{res[name].summary['goodput_rps']:8.1f} {ratio}")

if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
