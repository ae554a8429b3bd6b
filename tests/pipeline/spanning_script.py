"""What tests/pipeline/test_spanning.py launches: ``python spanning_script.py SCHEDULE OUT``
in each process of a 2-process launch. The executor's ranks (one device each) are split over
the processes; process 0 saves the step's loss, grads and measurements to OUT (npz).
``python spanning_script.py SCHEDULE PIDS kill``: each process writes its pid to PIDS.<i>,
runs one step, then process 1 SIGKILLs itself and process 0 runs the next step."""

import os
import signal
import sys

import jax
import numpy as np

import pdjax
import pdjax.pipeline as pp
from pdjax.cluster import store
from timeline_checks import check_dependencies

RANKS, ROWS, T = 4, 1, 8
MICROBATCHES = {"zb1p": 4, "dualpipe": 8, "1f1b": 4}


def setup(name):
    cfg = pdjax.configs.tiny(num_hidden_layers=4, first_k_dense_replace=2)
    params = pdjax.init_params(cfg, jax.random.key(0))
    m = MICROBATCHES[name]
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (m * ROWS, T), dtype=np.int32)
    return cfg, params, pp.build(name, RANKS, m), tokens


def kill(name: str, pids: str) -> None:
    pdjax.cluster.initialize()
    with open(f"{pids}.{jax.process_index()}", "w") as f:
        f.write(str(os.getpid()))
    cfg, params, schedule, tokens = setup(name)
    ex = pp.Executor(schedule, cfg, devices=jax.devices(), timeout_s=40, measure=False)
    params = jax.device_put(jax.tree.map(np.asarray, params), ex.replicated)
    jax.block_until_ready(ex.step(params, tokens))
    if jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    ex.step(params, tokens)                      # its peer is gone: never returns normally
    print("the step after the kill returned", flush=True)


def main(name: str, out: str) -> None:
    pdjax.cluster.initialize()
    cfg, params, schedule, tokens = setup(name)
    ex = pp.Executor(schedule, cfg, devices=jax.devices(), timeout_s=40)
    params = jax.device_put(jax.tree.map(np.asarray, params), ex.replicated)
    loss, grads = ex.step(params, tokens)
    loss2, _ = ex.step(params, tokens)           # a second step: the transfers' ids move on
    ex.step(params, tokens)
    # the cluster's store keeps only the last step's measurements: nothing grows per step
    # (the offers' announcements are deleted by their pullers)
    left = store.keys(f"pdjax/pipeline/{ex.spanning.nonce}/")
    assert left and all(k.startswith(f"pdjax/pipeline/{ex.spanning.nonce}/2/measured/") for k in left), left
    leaves = {f"g{i}": np.asarray(g) for i, g in enumerate(jax.tree.leaves(grads))}
    if jax.process_index() == 0:
        tl = ex.last_timeline
        np.savez(out, loss=np.asarray(loss), loss2=np.asarray(loss2), memory=ex.last_memory,
                 stage_F=ex.stage_memory["F"], stage_I=ex.stage_memory["I"], stage_I_free=ex.stage_memory["I_free"],
                 starts=np.concatenate(tl.starts), ends=np.concatenate(tl.ends),
                 deps=check_dependencies(tl), local=np.array(sorted(ex.local_ranks)), **leaves)
    print("done", flush=True)


if __name__ == "__main__":
    (kill if sys.argv[3:] == ["kill"] else main)(sys.argv[1], sys.argv[2])
