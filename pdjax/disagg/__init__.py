"""Prefill/decode disaggregation on real meshes: PDEngine, ColocatedEngine, AFDEngine
(attention-FFN disaggregated decode), the paged decode pool, the layer-wise latent-KV
handoff, and two-process serving (launch_two_process), all driving one decode scheduler (DecodeScheduler, a state machine of typed events and actions)
over a pluggable KV link (DevicePutLink in one process, TransferLink across processes).

The engines need jax (and the prefix store tensorstore): they load on first use, so the
pure-Python parts (``pdjax.disagg.prefix_index``, shared with the serving simulator) import
without them."""

import importlib

_LAZY = {"AFDEngine": "afd", "ColocatedEngine": "engine", "PDEngine": "engine", "TwoProcessServer": "launcher",
         "launch_two_process": "launcher", "Request": "request", "RequestError": "request",
         "SamplingParams": "request", "DecodeScheduler": "scheduler", "Chunk": "link", "DevicePutLink": "link",
         "TransferLink": "transfer"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AFDEngine", "Chunk", "ColocatedEngine", "DecodeScheduler", "DevicePutLink", "PDEngine", "Request", "RequestError",
           "SamplingParams", "TransferLink", "TwoProcessServer", "launch_two_process"]
