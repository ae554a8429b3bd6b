"""Discrete-event simulator of colocated, PD-disaggregated and AF-disaggregated serving.

    cost = pdjax.sim.LinearStepCost.from_roofline(pdjax.configs.deepseek_v3(), "h800", ep_size=32)
    reqs = pdjax.sim.sample_requests(pdjax.sim.WorkloadSpec(num_requests=1000, rate=20.0,
                                                            input=2048, output=256, seed=0))
    res = pdjax.sim.simulate_serving(pdjax.sim.PDDisaggregated(2, 2, link_bw=32 * 50e9), cost, reqs,
                                     slo=pdjax.sim.SLO(ttft=2.0, tpot=0.05))
    res.summary["goodput_rps"]

Modules (one concept each): ``cost`` (the cost-model protocol, LinearStepCost),
``workload`` / ``trace`` (requests), ``prefix_cache`` (hash-chain LRU with TTL),
``policies`` (balancers, chunk sizing), ``instances`` / ``colocated`` / ``afd_step`` (step planning),
``deployment`` (specs), ``controller`` (dynamic P:D), ``simulator`` (the event loop), ``result``,
``metrics``, ``sweeps`` (ratio sweeps and the SLO rate search); the experiments built on them:
one module per kind in :mod:`pdjax.experiments` (``sim_pd_vs_colocated``, ``pd_ratio_sweep``, ...).
Pure Python + numpy (matplotlib for plots); no jax. See docs/sim.md.

``__all__`` is the face a notebook starts with; every other name is importable from its
module (``pdjax.sim.policies.chunk_for_budget``, ``pdjax.sim.afd_step.AFDStepModel``, ...).
"""

from pdjax.submodules import lazy_submodules
from pdjax.sim.controller import ControllerConfig
from pdjax.sim.cost import FittedStepCost, LinearStepCost
from pdjax.sim.deployment import AFDisaggregated, Colocated, PDDisaggregated
from pdjax.sim.metrics import SLO
from pdjax.sim.prefix_cache import PrefixCache
from pdjax.sim.result import SimResult
from pdjax.sim.sweeps import af_ratio_sweep, max_rate_under_slo, pd_ratio_sweep, workload_at_rate
from pdjax.sim.simulator import Simulator, simulate_serving
from pdjax.sim.trace import load_trace
from pdjax.sim.workload import SimRequest, WorkloadSpec, length_dist, sample_requests

__all__ = [
    "AFDisaggregated", "Colocated", "ControllerConfig", "FittedStepCost", "LinearStepCost", "PDDisaggregated",
    "PrefixCache", "SLO", "SimRequest", "SimResult", "Simulator", "WorkloadSpec", "af_ratio_sweep", "length_dist",
    "load_trace", "max_rate_under_slo", "pd_ratio_sweep", "sample_requests", "simulate_serving", "workload_at_rate",
]

__getattr__ = lazy_submodules(__name__)
