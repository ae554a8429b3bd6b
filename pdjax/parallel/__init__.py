"""Meshes, logical-axis sharding rules, expert parallelism (all-to-all dispatch), dual-batch
overlap and EPLB expert placement. The sharding rules (``ShardingRules``) and the params'
logical axes and shardings (``param_logical_axes``, ``param_shardings``) are the model's
(:mod:`pdjax.model.sharding`, :mod:`pdjax.model.params`), on this face too."""

from pdjax.model.params import param_logical_axes, param_shardings
from pdjax.model.sharding import ShardingRules
from pdjax.parallel import eplb
from pdjax.parallel.dbo import DualBatchOverlap, dbo_gain, overlap_timeline
from pdjax.parallel.ep import ExpertParallel, ep_moe, place_experts
from pdjax.parallel.mesh import batch_sharding, check_batch, make_mesh, shard_params

__all__ = ["DualBatchOverlap", "ExpertParallel", "dbo_gain", "overlap_timeline", "ShardingRules", "batch_sharding", "check_batch", "ep_moe", "eplb",
           "make_mesh", "param_logical_axes", "param_shardings", "place_experts", "shard_params"]
