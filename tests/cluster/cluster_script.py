"""What the cluster tests launch: ``python cluster_script.py MODE OUT``. Every mode starts
with pdjax.cluster.initialize() (except ``startup``, which dies before) and prints its pid.
:func:`serve` is imported by the test too: the single-process reference makes the same calls."""

import os
import signal
import sys
import time


def serve(pdjax, params, cfg, tokens, mesh, steps=4):
    """(name, logits) of forward, prefill and ``steps`` greedy decode steps on ``mesh``."""
    import jax.numpy as jnp

    yield "forward", pdjax.forward(params, cfg, tokens, mesh=mesh)
    logits, cache = pdjax.prefill(params, cfg, tokens, mesh=mesh, max_len=tokens.shape[1] + steps)
    yield "prefill", logits
    nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    for i in range(steps):
        logits, cache = pdjax.decode_step(params, cfg, nxt, cache, mesh=mesh)
        yield f"decode {i}", logits
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)


def main(mode: str, out: str) -> None:
    print("pid", os.getpid(), flush=True)
    if mode == "startup":                         # dies before joining the cluster, once every
        me = os.environ["PDJAX_PROCESS_ID"]       # process has printed its pid (on a loaded machine
        open(os.path.join(out, f"started{me}"), "w").close()   # the first exit could otherwise
        deadline = time.monotonic() + 30          # kill the other before it prints)
        while len([f for f in os.listdir(out) if f.startswith("started")]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(3)
    import jax
    import numpy as np

    import pdjax

    pdjax.cluster.initialize()
    me = jax.process_index()
    if mode == "forward":
        from jax.experimental import multihost_utils
        cfg = pdjax.configs.tiny()
        params = pdjax.init_params(cfg, jax.random.key(0))
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16), dtype=np.int32)
        got = {}
        for data, expert in ((2, 4), (1, 8)):
            mesh = pdjax.parallel.make_mesh({"data": data, "expert": expert})
            for name, logits in serve(pdjax, params, cfg, tokens, mesh):
                got[f"{data}x{expert} {name}"] = np.asarray(multihost_utils.process_allgather(logits, tiled=True))
        if me == 0:
            np.savez(out, **got)
    elif mode in ("raise", "sigkill"):
        mesh = pdjax.parallel.make_mesh({"data": 8})
        x = jax.device_put(np.ones(8, np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        total = jax.jit(lambda a: a.sum())
        for step in range(1000):
            if me == 1 and step == 3:
                if mode == "raise":
                    raise ValueError("boom in process 1")
                os.kill(os.getpid(), signal.SIGKILL)   # mid-collective: the other waits in a sum
            float(total(x))
    elif mode == "hang":
        time.sleep(3600)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
