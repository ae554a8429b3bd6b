"""Trace the paths of docs/architecture.md through the package: which pdjax modules a flow
enters, and to which the calling thread comes back after leaving them (a return to a
module already left is a seam a reader follows back and forth).

    python scripts/trace_flows.py [executor|pd|experiment|train_launched ...] [--modules]

Each flow runs once, small, on the CPU (8 simulated devices), under ``sys.setprofile`` (and
``threading.setprofile`` for the threads it starts); only calls into ``pdjax/`` count, the
first in each module opens it. ``train_launched`` is ``pdjax.pipeline.train`` in a
2-process ``pdjax launch`` (process 0's trace). Prints one row per flow.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


class Trace:
    """Calls into pdjax modules: every module entered (any thread) and the calling
    thread's sequence of modules (consecutive calls in one module counted once)."""

    def __init__(self):
        self.entered: set = set()
        self.sequence: list = []
        self.main = threading.get_ident()

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        cut = path.rfind(os.sep + "pdjax" + os.sep)
        if cut < 0 or os.sep + "tests" + os.sep in path:
            return
        module = path[cut + 1:-3].replace(os.sep, ".")
        self.entered.add(module)
        if threading.get_ident() == self.main and (not self.sequence or self.sequence[-1] != module):
            self.sequence.append(module)

    def row(self) -> dict:
        """``modules``: entered (any thread); ``returned``: modules the calling thread came
        back to after leaving them; ``returns``: how often it did; ``steps``: its module
        changes + 1."""
        left, returned, returns = set(), set(), 0
        for prev, cur in zip(self.sequence, self.sequence[1:]):
            left.add(prev)
            if cur in left:
                returned.add(cur)
                returns += 1
        return {"modules": len(self.entered), "returned": len(returned), "returns": returns,
                "steps": len(self.sequence), "entered": sorted(self.entered)}


def traced(fn) -> dict:
    t = Trace()
    sys.setprofile(t)
    threading.setprofile(t)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return t.row()


def executor_flow():
    import jax
    import numpy as np

    import pdjax
    import pdjax.pipeline as pp
    cfg = pdjax.configs.tiny()
    params = pdjax.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16), dtype=np.int32)
    ex = pp.Executor(pp.build("zb1p", num_ranks=2, num_microbatches=4), cfg, devices=jax.devices()[:2])
    ex.step(params, tokens)


def pd_flow():
    import jax

    import pdjax
    cfg = pdjax.configs.tiny()
    params = pdjax.init_params(cfg, jax.random.key(0))
    eng = pdjax.disagg.PDEngine(params, cfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:],
                                max_context=256)
    eng.generate([[1, 2, 3, 4, 5], [7] * 40], max_new_tokens=8)


def experiment_flow():
    from pdjax.experiments import runner
    rebuild = getattr(runner, "rebuild_report", None) or getattr(runner, "report")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, _ = runner.run("bubble_sweep", tmp, ["sweep.num_stages=[4]", "sweep.microbatch_multipliers=[1]"])
        rebuild(run_dir)


TRAIN = """
import json, sys, inspect
sys.path.insert(0, {here!r})
import trace_flows as tf
import jax, numpy as np, pdjax, pdjax.pipeline as pp

def run():
    pdjax.cluster.initialize()
    cfg = pdjax.configs.tiny(num_hidden_layers=4, first_k_dense_replace=2)
    s = pp.build("zb1p", num_ranks=4, num_microbatches=4)
    data = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 4, 8), dtype=np.int32)
    first = list(inspect.signature(pp.train).parameters)[0]
    args = (s, cfg) if first == "schedule" else (cfg, s)
    pp.train(*args, data, steps=2, devices=jax.devices())
row = tf.traced(run)
if jax.process_index() == 0:
    print("ROW", json.dumps(row), flush=True)
"""


def train_launched_flow() -> dict:
    import io

    from pdjax.cluster import launch
    out = io.StringIO()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(TRAIN.format(here=os.path.dirname(os.path.abspath(__file__))))
    try:
        launch([sys.executable, f.name], 2, 2, timeout_s=600, stream=out)
    finally:
        os.unlink(f.name)
    line = next(ln for ln in out.getvalue().splitlines() if "ROW " in ln)
    return json.loads(line.split("ROW ", 1)[1])


FLOWS = {"executor": executor_flow, "pd": pd_flow, "experiment": experiment_flow}


def main(argv) -> None:
    listing = "--modules" in argv
    names = [a for a in argv if a != "--modules"] or [*FLOWS, "train_launched"]
    for name in names:
        row = train_launched_flow() if name == "train_launched" else traced(FLOWS[name])
        print(f"{name:<15} modules entered {row['modules']:>3}   modules returned to {row['returned']:>3} "
              f"({row['returns']:>5} returns in {row['steps']:>5} module steps)", flush=True)
        if listing:
            print("  " + " ".join(row["entered"]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
