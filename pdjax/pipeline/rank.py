"""A pipeline rank of the executor: its devices, where its batch-major arrays and params go,
and its MoE implementation (expert-parallel over the rank's devices when it has several)."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding


class Rank:
    """One pipeline rank: its devices, where batch-major arrays and params go, its MoE."""

    def __init__(self, index: int, devices):
        self.index, self.devices = index, tuple(devices)
        if len(self.devices) == 1:
            self.mesh, self.moe_impl = None, None
            self._single = SingleDeviceSharding(self.devices[0])
        else:
            from pdjax.parallel import ExpertParallel, make_mesh

            self.mesh = make_mesh({"data": 1, "expert": len(self.devices)}, self.devices)
            self.moe_impl = ExpertParallel(self.mesh)

    def batch(self, ndim: int):
        """Sharding of a batch-major array: split over every device of the rank (DP attention)."""
        if self.mesh is None:
            return self._single
        return NamedSharding(self.mesh, P(("data", "expert"), *([None] * (ndim - 1))))

    def place_params(self, sp, cfg):
        if self.mesh is None:
            return jax.device_put(sp, self._single)
        from pdjax.parallel import shard_params

        return shard_params(sp, cfg, self.mesh)
