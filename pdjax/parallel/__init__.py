"""Meshes, logical-axis sharding rules, expert parallelism (all-to-all dispatch), dual-batch
overlap and EPLB expert placement."""

from pdjax.parallel import eplb
from pdjax.parallel.dbo import DualBatchOverlap, dbo_gain, overlap_timeline
from pdjax.parallel.ep import ExpertParallel, ep_moe, place_experts
from pdjax.parallel.mesh import (ShardingRules, batch_sharding, check_batch, make_mesh,
                                 param_logical_axes, param_shardings, shard_params)

__all__ = ["DualBatchOverlap", "ExpertParallel", "dbo_gain", "overlap_timeline", "ShardingRules", "batch_sharding", "check_batch", "ep_moe", "eplb",
           "make_mesh", "param_logical_axes", "param_shardings", "place_experts", "shard_params"]
