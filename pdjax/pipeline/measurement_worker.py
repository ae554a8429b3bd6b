"""The process of :func:`pdjax.pipeline.measurement.measure_in_cluster` (``python -m
pdjax.pipeline.measurement_worker SPEC OUT``, one per rank of a ``jax.distributed`` launch,
pinned to its rank's CPU core by the launch): it joins the cluster, builds the multi-controller
:class:`~pdjax.pipeline.Executor` over every process's device (:mod:`pdjax.pipeline.multiprocess`)
and measures the schedule; process 0 writes the row."""

from __future__ import annotations

import pickle
import sys


def _main(spec_path: str, out: str) -> None:
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    import dataclasses

    import jax

    import pdjax
    from pdjax.pipeline.measurement import measure_executor
    from pdjax.pipeline.executor import Executor

    pdjax.cluster.initialize()
    ex = Executor(spec["schedule"], spec["cfg"], devices=jax.devices(), layers_per_stage=spec["layers_per_stage"],
                  measure=True)
    params = jax.device_put(spec["params"], ex.replicated)
    row = measure_executor(ex, params, spec["tokens"], repeats=spec["repeats"], op_repeats=spec["op_repeats"])
    if jax.process_index() == 0:
        with open(out, "wb") as f:
            pickle.dump(dataclasses.replace(row, mode="cluster"), f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
