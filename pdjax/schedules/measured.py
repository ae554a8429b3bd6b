"""Measured op durations of an executed schedule, and the simulator fed with them.

:meth:`pdjax.pipeline.Executor.measure_ops` times every op kind of every stage in isolation
(one op at a time, inputs ready before the clock starts, outputs ready when it stops);
:class:`OpCosts` turns those medians into the per-stage cost arrays :func:`simulate` takes,
so a measured run and its simulation can be compared op for op.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ops import OverlapFB


@dataclass(frozen=True)
class OpCosts:
    """Median measured durations (ms): ``durations[key]`` with keys ``("F", stage)``,
    ``("B", stage)``, ``("I", stage)``, ``("W", stage)`` and ``("FB", fwd stage, bwd stage,
    bwd kind)`` for overlapped pairs; ``dispatch_ms``: median time a program call takes to
    return (host dispatch, the work itself runs asynchronously)."""

    num_stages: int
    durations: dict
    dispatch_ms: float

    @staticmethod
    def key(op) -> tuple:
        if isinstance(op, OverlapFB):
            return ("FB", op.forward.stage, op.backward.stage, op.backward.kind)
        return (op.kind, op.stage)

    def _per_stage(self, kind: str, default) -> np.ndarray:
        return np.array([self.durations.get((kind, s), default[s]) for s in range(self.num_stages)], dtype=float)

    def simulate_kwargs(self) -> dict:
        """``F, B, I, W, FB, FI`` per stage for :func:`pdjax.schedules.simulate`. A stage with
        no measured B gets ``I + W``; no measured W (1F1B): 0 and ``I = B``; a pair's cost goes
        to its forward's stage (the mean over its partners), ``FB = F + B`` where none ran."""
        n = self.num_stages
        zero = np.zeros(n)
        F = self._per_stage("F", zero)
        W = self._per_stage("W", zero)
        I_measured = self._per_stage("I", np.full(n, np.nan))
        B = self._per_stage("B", np.where(np.isnan(I_measured), 0.0, I_measured) + W)
        I_cost = np.where(np.isnan(I_measured), np.maximum(B - W, 0.0), I_measured)
        FB, FI = F + B, F + I_cost
        for kind, target in (("B", FB), ("I", FI)):
            pairs: dict[int, list[float]] = {}
            for k, v in self.durations.items():
                if k[0] == "FB" and k[3] == kind:
                    pairs.setdefault(k[1], []).append(v)
            for s, vals in pairs.items():
                target[s] = float(np.mean(vals))
        return dict(F=F, B=B, I=I_cost, W=W, FB=FB, FI=FI)

    def table(self) -> str:
        """A text table of the medians (ms) per stage and op kind."""
        kinds = ("F", "B", "I", "W")
        lines = ["stage " + "".join(f"{k:>9}" for k in kinds)]
        for s in range(self.num_stages):
            cells = "".join(f"{self.durations[(k, s)]:9.3f}" if (k, s) in self.durations else f"{'-':>9}"
                            for k in kinds)
            lines.append(f"{s:>5} {cells}")
        for k, v in sorted((k, v) for k, v in self.durations.items() if k[0] == "FB"):
            lines.append(f"pair F{k[1]}&{k[3]}{k[2]}: {v:.3f}")
        lines.append(f"dispatch per op: {self.dispatch_ms:.3f} ms")
        return "\n".join(lines)


def op_costs_from_timeline(timeline) -> OpCosts:
    """Median per-op durations (ms) of a measured overlapped run (its timeline), keyed as
    :class:`OpCosts`: the op times *as they ran*, contention with the other ranks included.
    Fed to the simulator they test its schedule model (dependencies, order, idle time)
    apart from how op times change when the ranks run at once."""
    samples: dict = {}
    for r, ops in enumerate(timeline.schedule.ops):
        for op, s, e in zip(ops, timeline.starts[r], timeline.ends[r]):
            samples.setdefault(OpCosts.key(op), []).append(float(e - s))
    return OpCosts(timeline.schedule.num_stages, {k: float(np.median(v)) for k, v in samples.items()}, float("nan"))
