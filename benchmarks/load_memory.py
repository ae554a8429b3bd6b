"""Peak host memory of loading a HF checkpoint onto 8 devices: sharded vs unsharded.

A random DeepSeek-V3-shaped checkpoint whose routed experts are most of its bytes is written
to a temporary directory; then, each in a fresh subprocess (8 simulated CPU devices):

* ``unsharded``: ``load_hf(path)``, everything on one device;
* ``unsharded + shard_params``: the same, then ``shard_params`` onto an 8-way expert mesh
  (the way to reach the mesh without ``mesh=``);
* ``sharded``: ``load_hf(path, mesh=mesh)``, each device reading only its experts;
* ``sharded, 2 processes``: the same mesh over two processes of 4 devices each
  (``jax.distributed``), as on two hosts: each process reads its own devices' experts and
  every replicated tensor (the columns are the larger of the two processes').

Columns: the largest number of bytes one device ends up holding; the peak of numpy's host
allocations during the load (tracemalloc: the staging copies the loader makes, not the
memory-mapped files); and the growth of the process' peak resident set (VmHWM, reset just
before the load) over its size before the load (Linux /proc). On XLA:CPU the devices' buffers live in host memory too, so the RSS
column includes what the devices hold (8 copies of every replicated tensor when sharded)
and the file pages read; the staging column is the loader's own overhead. In one process
holding all 8 devices the sharded load still reads every expert once (for one device or
another), so its staging matches the unsharded load's; what it saves is the full copy on one
device (and, on a real accelerator, that device's memory). Split over processes, each reads
only its part.

Run: .venv/bin/python benchmarks/load_memory.py [--experts 64] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MiB = 2 ** 20


def write_checkpoint(path: str, args) -> int:
    """A random checkpoint of ``expected_tensors(cfg)``, ~100 MiB per file. Returns its bytes."""
    import numpy as np
    import pdjax
    from pdjax.model.hf import expected_tensors, write_safetensors

    cfg = pdjax.configs.small(n_routed_experts=args.experts, num_hidden_layers=args.layers, n_group=8,
                              topk_group=4, moe_intermediate_size=args.expert_width)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    rng = np.random.default_rng(0)
    tensors = {name: (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)
               for name, shape in expected_tensors(cfg).items()}
    write_safetensors(path, tensors, max_shard_bytes=100 * MiB)
    total = sum(t.nbytes for t in tensors.values())
    return total


def _rss(field: str) -> int:
    """Bytes of this process' resident set now (VmRSS) or at its peak (VmHWM), from /proc."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(mode: str, path: str, process: int = 0, port: int = 0) -> None:
    """One load in this process; prints a JSON line of its measurements."""
    import tracemalloc

    import jax

    if mode.startswith("sharded, 2"):
        jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)

    import pdjax
    from pdjax.parallel import make_mesh, shard_params

    mesh = make_mesh({"expert": len(jax.devices())})
    jax.block_until_ready(jax.device_put(0.0))          # the runtime is up before the baseline
    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:      # reset the peak (VmHWM) to the current RSS
        f.write("5")
    tracemalloc.start()
    if mode.startswith("sharded"):
        cfg, params = pdjax.load_hf(path, mesh=mesh)
    else:
        cfg, params = pdjax.load_hf(path)
        if mode == "unsharded + shard_params":
            params = shard_params(params, cfg, mesh)
    jax.block_until_ready(params)
    _, staging = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peak = _rss("VmHWM")
    per_device: dict = {}
    for x in jax.tree.leaves(params):
        for s in x.addressable_shards:
            per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
    print(json.dumps({"device_max": max(per_device.values()), "staging": staging, "rss_growth": peak - before}),
          flush=True)
    if mode.startswith("sharded, 2"):
        jax.distributed.shutdown()


def _run(mode: str, path: str, env: dict) -> dict:
    """Run the mode's child process(es); the larger of each measurement over processes."""
    import socket

    n = 2 if mode.startswith("sharded, 2") else 1
    with socket.socket() as sock:                       # a free port for the coordinator
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    if n == 2:
        env = dict(env, XLA_FLAGS=env["XLA_FLAGS"].replace("count=8", "count=4"))
    procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, path, str(i), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i in range(n)]
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:               # jax catches SIGTERM: kill outright
            p.kill()
            raise
        if p.returncode:
            raise RuntimeError(f"{mode}: child exited with {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {k: max(r[k] for r in results) for k in results[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=256, help="moe_intermediate_size")
    ap.add_argument("--child", nargs=4, metavar=("MODE", "PATH", "PROCESS", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, path, process, port = args.child
        return child(mode, path, int(process), int(port))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    with tempfile.TemporaryDirectory() as tmp:
        total = write_checkpoint(tmp, args)
        print(f"checkpoint: {total / MiB:.0f} MiB float32 ({args.layers} layers, {args.experts} experts), "
              f"8 CPU devices, mesh {{expert: 8}}\n")
        print(f"| {'load':<26} | device max MiB | staging peak MiB | RSS growth MiB |")
        print(f"|{'-' * 28}|----------------|------------------|----------------|")
        for mode in ("unsharded", "unsharded + shard_params", "sharded", "sharded, 2 processes"):
            r = _run(mode, tmp, env)
            print(f"| {mode:<26} | {r['device_max'] / MiB:14.0f} | {r['staging'] / MiB:16.0f} | "
                  f"{r['rss_growth'] / MiB:14.0f} |")


if __name__ == "__main__":
    main()
