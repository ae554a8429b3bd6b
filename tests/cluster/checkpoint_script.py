"""What tests/cluster/test_checkpoints.py launches: ``python checkpoint_script.py MODE DIR``
as 2 processes x 4 devices. Every mode starts with pdjax.cluster.initialize().

* ``load``: ``load_hf(DIR/hf, mesh=)`` on each mesh of :data:`MESHES` (spanning both
  processes), counting the tensors each process reads from the files; process 0 writes the
  gathered params (``DIR/load.npz``), every process its reads (``DIR/reads{i}.json``).
* ``orbax``: restores ``DIR/one`` (written by one process) onto the (2, 4) mesh, gathered to
  ``DIR/restored.npz``, and writes its own params to ``DIR/two`` for one process to restore.

The helpers are imported by the test too: the single-process reference makes the same calls.
"""

import contextlib
import json
import os
import sys

#: name -> (mesh axes, experts' mesh axes or None for the default rules)
MESHES = {"2x4": ({"data": 2, "expert": 4}, None),
          "2x4 ep8": ({"data": 2, "expert": 4}, ("data", "expert")),
          "1x8": ({"data": 1, "expert": 8}, None)}


def mesh_and_rules(pdjax, name):
    axes, experts = MESHES[name]
    mesh = pdjax.parallel.make_mesh(axes)
    rules = None if experts is None else pdjax.parallel.ShardingRules.default(mesh).override(experts=experts)
    return mesh, rules


@contextlib.contextmanager
def counting_reads():
    """Yields a list that collects ``(file, tensor, bytes)`` for every tensor the loader takes
    out of a safetensors file while the block runs."""
    from pdjax.model.hf_files import SafetensorsFile

    reads, get = [], SafetensorsFile.get

    def counted(self, name):
        info = self.header[name]
        reads.append((os.path.basename(self.file), name, info["data_offsets"][1] - info["data_offsets"][0]))
        return get(self, name)
    SafetensorsFile.get = counted
    try:
        yield reads
    finally:
        SafetensorsFile.get = get


@contextlib.contextmanager
def counting_programs():
    """Yields a list that collects jax's compile events while the block runs: a program
    compiled (or fetched from the compilation cache) means a computation, e.g. the
    cross-process comparison ``jax.device_put`` makes of a host array it puts on a
    multi-process sharding."""
    import jax

    events, on = [], [True]

    def listen(key, *args, **kwargs):
        if on[0] and key.startswith(("/jax/compilation_cache/compile_requests", "/jax/core/compile/backend")):
            events.append(key)
    jax.monitoring.register_event_listener(listen)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        on[0] = False


def flat(params, prefix=""):
    """``{"layers/1/moe/w_gate": leaf}`` of a params tree."""
    import jax
    from pdjax.model.sharding import path_name

    return {prefix + path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def gathered(params, prefix=""):
    """Every leaf as a numpy array on every process, and its sharding's spec and processes."""
    import numpy as np
    from jax.experimental import multihost_utils

    values, where = {}, {}
    for name, x in flat(params, prefix).items():
        values[name] = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        where[name] = [str(tuple(x.sharding.spec)), sorted({d.process_index for d in x.sharding.device_set})]
    return values, where


def load(pdjax, d, me):
    import numpy as np

    import jax

    got, info = {}, {}
    # the one program a load runs: the PRNG key the params' logical axes are traced with
    # (pdjax.model.params), compiled here so that the count below sees any other
    jax.random.key(0)
    for name in MESHES:
        mesh, rules = mesh_and_rules(pdjax, name)
        with counting_reads() as reads, counting_programs() as programs:
            cfg, params = pdjax.load_hf(os.path.join(d, "hf"), mesh=mesh, rules=rules)
        values, where = gathered(params, name + " ")
        got.update(values)
        info[name] = {"reads": reads, "where": where, "programs": programs}
    with open(os.path.join(d, f"reads{me}.json"), "w") as f:
        json.dump(info, f)
    if me == 0:
        np.savez(os.path.join(d, "load.npz"), **got)


def orbax(pdjax, d, me):
    import jax
    import jax.numpy as jnp
    import numpy as np

    cfg = pdjax.configs.tiny()
    mesh, rules = mesh_and_rules(pdjax, "2x4 ep8")
    like = jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))
    sharding = pdjax.parallel.param_shardings(like, cfg, mesh, rules)
    restored = pdjax.restore_params(os.path.join(d, "one"), like=like, sharding=sharding)
    values, where = gathered(restored, "restored ")
    saved_default = pdjax.restore_params(os.path.join(d, "one"))       # no like: replicated everywhere
    more, where_default = gathered(saved_default, "default ")
    values.update(more)
    params = pdjax.init_params(cfg, jax.random.key(1), mesh=mesh, rules=rules)
    # a host-local scalar (this process's device) goes in too: saved replicated
    pdjax.save_params(os.path.join(d, "two"), {"params": params, "step": jnp.asarray(7, jnp.int32)})
    with open(os.path.join(d, f"orbax{me}.json"), "w") as f:
        json.dump({"restored": where, "default": where_default}, f)
    if me == 0:
        np.savez(os.path.join(d, "restored.npz"), **values)


def main(mode: str, d: str) -> None:
    import jax

    import pdjax

    pdjax.cluster.initialize()
    {"load": load, "orbax": orbax}[mode](pdjax, d, jax.process_index())
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
