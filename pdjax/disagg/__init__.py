"""Prefill/decode disaggregation on real meshes: PDEngine, ColocatedEngine, the paged decode
pool and the layer-wise latent-KV handoff."""

from pdjax.disagg.engine import ColocatedEngine, PDEngine
from pdjax.disagg.request import Request, RequestError, SamplingParams

__all__ = ["ColocatedEngine", "PDEngine", "Request", "RequestError", "SamplingParams"]
