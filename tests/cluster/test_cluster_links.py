"""benchmarks/cluster_links.py end to end at its smallest (two sizes, two repeats: a
one-process run and a 2 x 4 launch, ~10 s): the table is printed with the correctness-rig
note, and the fitted link parameters it writes (TOML and JSON) are what pdjax.analysis
takes: a HardwareSpec with scale_up_bw / scale_out_bw in bytes/s, and latency_s, bw per
collective and path."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import tomllib

import pdjax.analysis as A

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "cluster_links.py")


def _module():
    spec = importlib.util.spec_from_file_location("cluster_links", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cluster_links_smallest_run_writes_link_parameters(tmp_path):
    bench = _module()
    out = tmp_path / "links.toml"
    run = subprocess.run([sys.executable, SCRIPT, "--sizes", "4K,16K", "--repeats", "2", "--quiet", "--timeout", "90",
                          "--link-params", str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "correctness rig, not a performance model" in run.stdout
    rows = [line for line in run.stdout.splitlines() if "(inside one process)" in line or "(across processes)" in line]
    assert len(rows) == 2 * len(bench.COLLECTIVES) + len(bench.POINT_TO_POINT)
    data = tomllib.loads(out.read_text())
    hw = A.HardwareSpec(**data["hardware"])
    assert hw.link_bw("scale_up") == data["links"]["in_process"]["ppermute"]["bw"]
    assert hw.link_bw("scale_out") == data["links"]["cross_process"]["ppermute"]["bw"]
    assert set(data["links"]["in_process"]) == set(bench.COLLECTIVES)
    assert set(data["links"]["cross_process"]) == set(bench.COLLECTIVES) | set(bench.POINT_TO_POINT)
    for rows_ in data["links"].values():
        for row in rows_.values():
            assert set(row) == {"latency_s", "bw"} and row["latency_s"] >= 0 and 0 < row["bw"] < math.inf
    bench.write_link_params(str(tmp_path / "links.json"), data)
    again = json.loads((tmp_path / "links.json").read_text())
    assert (again["hardware"], again["links"]) == (data["hardware"], data["links"]) and "rig" in again["note"]


def test_fit_recovers_latency_and_bandwidth():
    """t = 50 us + bytes / 2 GB/s over three sizes: the fit gives both back; all_to_all's
    bytes are 7/8 of S."""
    bench = _module()
    sizes = [4096, 65536, 1 << 20]
    latency, bw = bench.fit({s: 50e-6 + 7 / 8 * s / 2e9 for s in sizes}, bench.SEND_FACTOR["all_to_all"])
    assert math.isclose(latency, 50e-6, rel_tol=1e-6) and math.isclose(bw, 2e9, rel_tol=1e-6)
    assert bench.parse_size("64M") == 64 << 20 and bench.parse_size("4KiB") == 4096
