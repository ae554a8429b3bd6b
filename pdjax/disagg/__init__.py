"""Prefill/decode disaggregation on real meshes: PDEngine, ColocatedEngine, AFDEngine
(attention-FFN disaggregated decode), the paged decode pool, the layer-wise latent-KV
handoff, and serving across processes (launch_pd: one prefill and one or more decode
processes behind one router; launch_ffn: AFD's FFN side as its own process, AFDEngine(ffn_address=...) its attention side), all driving one decode scheduler
(DecodeScheduler, a state machine of typed events and actions) over a pluggable KV link
(DevicePutLink in one process, TransferLink across processes).

The serving runtime (jax, tensorstore); the pure prefix index it shares with the serving
simulator is :mod:`pdjax.prefix_index`."""

from pdjax.disagg.afd_engine import AFDEngine
from pdjax.disagg.afd_process import launch_ffn
from pdjax.disagg.engine import ColocatedEngine, PDEngine
from pdjax.disagg.launcher import PDCluster, launch_pd
from pdjax.disagg.link import DevicePutLink, KVChunk, TransferLink
from pdjax.disagg.request import Request, RequestError, SamplingParams
from pdjax.disagg.scheduler import DecodeScheduler

__all__ = ["AFDEngine", "ColocatedEngine", "DecodeScheduler", "DevicePutLink", "KVChunk", "PDCluster", "PDEngine",
           "Request", "RequestError", "SamplingParams", "TransferLink", "launch_ffn", "launch_pd"]
