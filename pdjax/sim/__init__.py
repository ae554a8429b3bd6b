"""Discrete-event simulator of colocated, PD-disaggregated and AF-disaggregated serving.

    cost = pdjax.sim.LinearStepCost.from_roofline(pdjax.configs.deepseek_v3(), "h800", ep_size=32)
    reqs = pdjax.sim.generate(pdjax.sim.WorkloadSpec(num_requests=1000, rate=20.0,
                                                     input=2048, output=256, seed=0))
    res = pdjax.sim.simulate(pdjax.sim.PDDisaggregated(2, 2, link_bw=32 * 50e9), cost, reqs,
                             slo=pdjax.sim.SLO(ttft=2.0, tpot=0.05))
    res.summary["goodput_rps"]

Modules (one concept each): ``cost`` (the cost-model protocol, LinearStepCost),
``workload`` / ``trace`` (requests), ``prefix_cache`` (hash-chain LRU with TTL),
``policies`` (balancers, chunk sizing), ``instances`` / ``colocated`` / ``afd`` (step planning),
``deployment`` (specs), ``controller`` (dynamic P:D), ``simulator`` (the event loop), ``result``,
``metrics``, ``search`` (sweeps and SLO binary search); the experiments built on them:
``pdjax.experiments.serving``.
Pure Python + numpy (matplotlib for plots); no jax. See docs/sim.md.
"""

from pdjax.sim.afd import AFDStepModel, afd_layer_cycle, exchange_hidden
from pdjax.sim.controller import ControllerConfig, PDController
from pdjax.sim.cost import AFDCostModel, FittedStepCost, LinearStepCost, StepCostModel, check_cost_model
from pdjax.sim.deployment import AFDisaggregated, Colocated, PDDisaggregated
from pdjax.sim.result import SimResult
from pdjax.sim.simulator import Simulator, simulate
from pdjax.sim.metrics import SLO, percentiles, summarize
from pdjax.sim.policies import (DEFAULT_BUCKET_EDGES, chunk_for_budget, length_bucket,
                                pick_by_quota, pick_decode)
from pdjax.sim.prefix_cache import PrefixCache, segment_chain_hashes, token_chain_hashes
from pdjax.sim.search import (af_ratio_sweep, max_rate_under_slo, pd_ratio_sweep, rate_runner,
                              workload_at_rate)
from pdjax.sim.trace import load_trace
from pdjax.sim.workload import LengthDist, Request, WorkloadSpec, generate, length_dist

__all__ = [
    "AFDCostModel", "AFDStepModel", "AFDisaggregated", "Colocated", "ControllerConfig",
    "DEFAULT_BUCKET_EDGES", "FittedStepCost", "LengthDist", "LinearStepCost", "PDController", "PDDisaggregated",
    "PrefixCache", "Request", "SLO", "SimResult", "Simulator", "StepCostModel", "WorkloadSpec",
    "af_ratio_sweep", "afd_layer_cycle", "check_cost_model", "chunk_for_budget", "exchange_hidden", "generate",
    "length_bucket", "length_dist", "load_trace", "max_rate_under_slo", "pd_ratio_sweep", "percentiles", "pick_by_quota", "pick_decode",
    "rate_runner", "segment_chain_hashes", "simulate", "summarize", "token_chain_hashes",
    "workload_at_rate",
]
