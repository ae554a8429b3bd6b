"""Prefill/decode disaggregation on real meshes: PDEngine, ColocatedEngine, the paged decode
pool, the layer-wise latent-KV handoff, and two-process serving (launch_two_process)."""

from pdjax.disagg.engine import ColocatedEngine, PDEngine
from pdjax.disagg.launcher import TwoProcessServer, launch_two_process
from pdjax.disagg.request import Request, RequestError, SamplingParams

__all__ = ["ColocatedEngine", "PDEngine", "Request", "RequestError", "SamplingParams", "TwoProcessServer",
           "launch_two_process"]
