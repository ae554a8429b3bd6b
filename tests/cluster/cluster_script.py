"""What the cluster tests launch: ``python cluster_script.py MODE OUT``. Every mode starts
with pdjax.cluster.initialize() (except ``startup``, which dies before) and prints its pid."""

import os
import signal
import sys
import time

MODE, OUT = sys.argv[1], sys.argv[2]
print("pid", os.getpid(), flush=True)
if MODE == "startup":
    sys.exit(3)                                   # dies before joining the cluster

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pdjax  # noqa: E402

pdjax.cluster.initialize()
me = jax.process_index()

if MODE == "forward":
    from jax.experimental import multihost_utils
    cfg = pdjax.configs.tiny()
    params = pdjax.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16), dtype=np.int32)
    out = {}
    for data, expert in ((2, 4), (1, 8)):
        mesh = pdjax.parallel.make_mesh({"data": data, "expert": expert})
        logits = pdjax.forward(params, cfg, tokens, mesh=mesh)
        out[f"{data}x{expert}"] = np.asarray(multihost_utils.process_allgather(logits, tiled=True))
    if me == 0:
        np.savez(OUT, **out)
elif MODE in ("raise", "sigkill"):
    mesh = pdjax.parallel.make_mesh({"data": 8})
    x = jax.device_put(np.ones(8, np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    total = jax.jit(lambda a: a.sum())
    for step in range(1000):
        if me == 1 and step == 3:
            if MODE == "raise":
                raise ValueError("boom in process 1")
            os.kill(os.getpid(), signal.SIGKILL)  # mid-collective: the others wait in a sum
        float(total(x))
elif MODE == "hang":
    time.sleep(3600)
print("done", flush=True)
