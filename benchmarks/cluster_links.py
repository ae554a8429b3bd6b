"""Latency and bandwidth of the links between devices: all_to_all, all_gather, psum and
ppermute over 8 devices inside one process and across the process boundary (a 2 x 4 local
cluster under pdjax.cluster.launch, mesh over both processes), a cross-process
``jax.device_put`` and a transfer-server pull (pdjax.cluster.transfer), at each size.

Size S = the bytes one device holds: all_to_all splits its S over the 8 devices, all_gather
gathers S (S/8 from each device), psum sums S, ppermute sends S to the device 4 places on
(in the other process, when there are two); device_put and the pull move one S-byte array
from a device of process 0 to one of process 1. Each time is the median of ``--repeats``
runs after a warm-up (the processes meet at a barrier before each run; the receiver's clock).
A fit per row, t = latency_s + bytes / bw, with bytes what one device sends over links
(all_to_all and all_gather (n-1)/n S, psum 2(n-1)/n S, the others S), gives the figures in
the form pdjax.analysis takes them: bytes/s per device and direction (HardwareSpec's
``scale_up_bw``: ppermute inside one process, ``scale_out_bw``: ppermute across processes),
seconds of latency. ``--link-params FILE`` (.toml or .json) writes them, so that a deployment
is calibrated from the user's own cluster: ``pdjax.analysis.HardwareSpec(**data["hardware"])``.

The local CPU cluster is a correctness rig, not a performance model: its processes share
this machine's cores, its collectives go over gloo on loopback, and the figures say nothing
about a GPU cluster's links. Run this on the cluster you want to model.

Run: .venv/bin/python benchmarks/cluster_links.py [--sizes 4K,256K,4M,64M] [--repeats 5]
     [--link-params links.toml]   (~2 min on 2 shared cores with the defaults)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

COLLECTIVES = ("all_to_all", "all_gather", "psum", "ppermute")
POINT_TO_POINT = ("device_put", "transfer_pull")
N = 8                                    # devices: 1 x 8 or 2 x 4
SEND_FACTOR = {"all_to_all": (N - 1) / N, "all_gather": (N - 1) / N, "psum": 2 * (N - 1) / N,
               "ppermute": 1.0, "device_put": 1.0, "transfer_pull": 1.0}
NOTE = ("The local CPU cluster is a correctness rig, not a performance model: processes share "
        "this machine's cores and collectives run over gloo on loopback.")


def parse_size(text: str) -> int:
    """'4K' / '64M' / '4096' -> bytes (binary units); a multiple of 32 bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    n = int(float(text[:-1] if scale > 1 else text) * scale)
    if n <= 0 or n % 32:
        raise argparse.ArgumentTypeError(f"size {text!r}: must be a positive multiple of 32 bytes")
    return n


def rate(bps: float) -> str:
    """Bytes/s as '1.23 GB/s' or '45.6 MB/s' (decimal units, as pdjax.analysis)."""
    return f"{bps / 1e9:.2f} GB/s" if bps >= 1e9 else f"{bps / 1e6:.1f} MB/s"


def human(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


# ---- inside a worker process -------------------------------------------------------------
def _programs(mesh):
    """name -> (jitted f, per-device input elements for an S-byte row) on a 1-D mesh "x"."""
    import jax
    from jax.sharding import PartitionSpec as P

    def mapped(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    shift = [(i, (i + N // 2) % N) for i in range(N)]
    return {"all_to_all": (mapped(lambda a: jax.lax.all_to_all(a, "x", 0, 0, tiled=True)), 1),
            "all_gather": (mapped(lambda a: jax.lax.all_gather(a, "x", tiled=True)), N),
            "psum": (mapped(lambda a: jax.lax.psum(a, "x")), 1),
            "ppermute": (mapped(lambda a: jax.lax.ppermute(a, "x", shift)), 1)}


def _timed(run, repeats: int, barrier) -> float:
    """Median seconds of ``run()`` (which blocks until done) after one warm-up."""
    import numpy as np

    run()
    times = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_collectives(sizes, repeats: int, barrier) -> dict:
    """{collective: {size: seconds}} over every device of the cluster (or the process)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    out: dict = {}
    for name, (f, shrink) in _programs(mesh).items():
        for size in sizes:
            n = size // 4 // shrink * N
            x = jax.make_array_from_callback((n,), NamedSharding(mesh, P("x")),
                                             lambda i: np.ones(n, np.float32)[i])
            out.setdefault(name, {})[size] = _timed(lambda: f(x).block_until_ready(), repeats, barrier)
    return out


def measure_device_put(sizes, repeats: int, barrier) -> dict:
    """{size: seconds} of a device_put from process 0's first device to process 1's (both
    processes issue the same transfers in the same order; the receiver's time)."""
    import jax
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    me = jax.process_index()
    src_dev = jax.devices()[0]
    src = SingleDeviceSharding(src_dev)
    dst = SingleDeviceSharding(next(d for d in jax.devices() if d.process_index == 1))
    out, sent = {}, []
    for size in sizes:
        if me == 0:     # the sender keeps what it sent until the receiver has it all
            host = np.ones(size // 4, np.float32)
            out[size] = _timed(lambda: sent.append(jax.device_put(
                jax.device_put(host, src_dev).block_until_ready(), dst)), repeats, barrier)
        else:
            x = jax.make_array_from_single_device_arrays((size // 4,), src, [], dtype=np.float32)
            out[size] = _timed(lambda: jax.device_put(x, dst).block_until_ready(), repeats, barrier)
    barrier()
    sent.clear()
    return out


def measure_pull(sizes, repeats: int, control_port: int) -> dict:
    """{size: seconds} of a transfer-server pull by process 1 of an array process 0 offers
    (descriptors over a control socket; the pull alone is timed)."""
    import jax
    import numpy as np
    from pdjax.cluster.transfer import ArrayReceiver, ArraySender, Control, listen

    out = {}
    if jax.process_index() == 0:
        sock = listen(port=control_port)
        control = Control(sock.accept()[0])
        sender = ArraySender()
        control.send({"address": sender.address})
        for size in sizes:
            x = jax.device_put(np.ones(size // 4, np.float32), jax.local_devices()[0])
            for _ in range(repeats + 1):
                control.send(sender.offer(x))
        control.recv()                                  # the receiver is done
        sock.close()
        return out
    control = Control.connect(f"127.0.0.1:{control_port}")
    receiver = ArrayReceiver(control.recv()["address"])
    for size in sizes:
        descs = iter([control.recv() for _ in range(repeats + 1)])
        out[size] = _timed(lambda: receiver.pull(next(descs), jax.local_devices()[0]), repeats, lambda: None)
    control.send({"done": True})
    return out


def worker(args) -> None:
    """``--worker one``: 8 devices in this process; ``--worker cluster``: a process of the
    2 x 4 launch (collectives across processes, device_put, pull). Writes JSON to --out."""
    import jax

    if args.worker == "one":
        result = {"inside one process": measure_collectives(args.sizes, args.repeats, lambda: None)}
    else:
        me = int(os.environ["PDJAX_PROCESS_ID"])
        jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{args.ports[me]}")
        jax.config.update("jax_force_dcn_cross_host_transfers", True)
        import pdjax
        from pdjax.cluster import store

        pdjax.cluster.initialize()
        count = iter(range(1 << 30))

        def barrier():
            """Through the coordinator's key-value store, not a device collective: a CPU
            device waiting in a collective serves no transfer (a sender that entered one
            right after its device_put hung the receiver)."""
            i = next(count)
            store.put(f"cluster_links/{i}/{me}", "")
            store.get(f"cluster_links/{i}/{1 - me}", timeout_s=120)
        result = {"across processes": measure_collectives(args.sizes, args.repeats, barrier)}
        result["across processes"]["device_put"] = measure_device_put(args.sizes, args.repeats, barrier)
        result["across processes"]["transfer_pull"] = measure_pull(args.sizes, args.repeats, args.ports[2])
        if me != 1:                                  # the receiver's clock is the one that counts
            return
    with open(args.out, "w") as f:
        json.dump(result, f)


# ---- the driver ----------------------------------------------------------------------------
def fit(times: dict, factor: float) -> tuple[float, float]:
    """(latency_s, bw bytes/s) of t = latency_s + factor * S / bw over the sizes, least
    squares on relative error; latency clipped at 0 (then bw refitted through the origin)."""
    import numpy as np

    sizes = np.array(sorted(times), float)
    t = np.array([times[s] for s in sorted(times)], float)
    x = factor * sizes
    if len(sizes) >= 2:
        (a, b), *_ = np.linalg.lstsq(np.stack([1 / t, x / t], 1), np.ones_like(t), rcond=None)
        if a >= 0 and b > 0:
            return float(a), float(1 / b)
    b = float(np.sum(x / t) / np.sum((x / t) ** 2))
    return 0.0, float(1 / b)


def run_workers(args, tmp: str) -> dict:
    """Run the one-process and the 2-process measurements; their merged results."""
    from pdjax.cluster.launch import free_port, launch

    base = [sys.executable, os.path.abspath(__file__), "--sizes", ",".join(map(str, args.sizes)),
            "--repeats", str(args.repeats)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={N}"])
    one = os.path.join(tmp, "one.json")
    subprocess.run(base + ["--worker", "one", "--out", one], env=env, check=True, timeout=args.timeout)
    cluster = os.path.join(tmp, "cluster.json")
    ports = ",".join(str(free_port()) for _ in range(3))
    launch(base + ["--worker", "cluster", "--out", cluster, "--ports", ports], 2, N // 2,
           timeout_s=args.timeout, stream=None if args.quiet else sys.stdout)
    results = {}
    for path in (one, cluster):
        with open(path) as f:
            results.update({k: {name: {int(s): t for s, t in row.items()} for name, row in v.items()}
                            for k, v in json.load(f).items()})
    return results


def table(results: dict, sizes) -> tuple[str, dict]:
    """The printed table (median time and bandwidth S/t per size, the fit per row) and the
    fits {where: {name: (latency_s, bw)}}."""
    head = f"{'link':<36}" + "".join(f"{human(s):>22}" for s in sizes) + f"{'latency us':>12}{'fitted bw':>12}"
    lines, fits = [head, "-" * len(head)], {}
    for where, rows in results.items():
        for name, times in rows.items():
            latency, bw = fits.setdefault(where, {})[name] = fit(times, SEND_FACTOR[name])
            cells = "".join(f"{times[s] * 1e3:.3f} ms {rate(s / times[s])}".rjust(22) for s in sizes)
            lines.append(f"{name + ' (' + where + ')':<36}{cells}{latency * 1e6:>12.1f}{rate(bw):>12}")
    return "\n".join(lines), fits


def link_params(fits: dict) -> dict:
    """The fitted figures as pdjax.analysis takes them: ``hardware`` (HardwareSpec fields,
    bytes/s per device and direction) and ``links`` (latency_s, bw per path and collective)."""
    data = {"hardware": {"name": "measured-cluster",
                         "scale_up_bw": fits["inside one process"]["ppermute"][1],
                         "scale_out_bw": fits["across processes"]["ppermute"][1],
                         "description": "fitted by benchmarks/cluster_links.py (ppermute per device)"},
            "links": {}}
    for where, rows in fits.items():
        key = "in_process" if where == "inside one process" else "cross_process"
        data["links"][key] = {name: {"latency_s": a, "bw": b} for name, (a, b) in rows.items()}
    return data


def write_link_params(path: str, data: dict) -> None:
    """JSON for a .json path, TOML otherwise (with the correctness-rig note as a comment)."""
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump({"note": NOTE, **data}, f, indent=2)
        return
    lines = [f"# {NOTE}", "# t(bytes) = latency_s + bytes / bw; bw in bytes/s per device and direction",
             "", "[hardware]   # pdjax.analysis.HardwareSpec(**data['hardware'])"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in data["hardware"].items()]
    for key, rows in data["links"].items():
        for name, row in rows.items():
            lines += ["", f"[links.{key}.{name}]"] + [f"{k} = {v!r}" for k, v in row.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                    default=[4 << 10, 256 << 10, 4 << 20, 64 << 20], help="bytes per device, e.g. 4K,64K,1M,64M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--link-params", metavar="FILE", help="write the fitted figures (.toml or .json)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for each of the two runs")
    ap.add_argument("--quiet", action="store_true", help="hide the cluster's own output")
    ap.add_argument("--worker", choices=("one", "cluster"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ports", type=lambda s: [int(p) for p in s.split(",")], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    # a SIGTERM (e.g. `timeout`) unwinds through the launcher, which kills the cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory() as tmp:
        results = run_workers(args, tmp)
    text, fits = table(results, args.sizes)
    print(f"\nLinks over 8 CPU devices (1 x 8 vs 2 x 4 processes), median of {args.repeats}; "
          "each cell: time and S/t per device")
    print(text)
    print(f"\n{NOTE} Run it on the cluster you model.")
    if args.link_params:
        write_link_params(args.link_params, link_params(fits))
        print(f"wrote {args.link_params}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
