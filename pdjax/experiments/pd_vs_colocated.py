"""Experiment: real PD-disaggregated vs colocated serving on the CPU devices.

Short requests decode while long prompts arrive. In the colocated engine the long prefills
run on the same devices as the decode steps, so a decode step queues behind a prefill layer
(the inter-token-latency stall); in the PD engine they run on disjoint devices. Both engines
serve the same requests with the same scheduler; the run records every token's time and
plots ITL over time, and reports TTFT. A third engine, colocated with chunked prefill
(``engine.chunk_tokens``; 0 skips it), lets decode steps run between a long prompt's chunks:
the classic middle ground, trading the long prompts' TTFT for shorter stalls.

Note: simulated CPU devices share the host's cores, so the disaggregated side still feels
compute contention; the structural difference (a decode step waiting behind a prefill on
its own devices) is what the plot shows.

``scale`` multiplies the request counts, the long prompts' length, the decode slots, the
context bound and the prefill chunk. Every latency is measured (``wall_clock``); the tokens
and the KV bytes handed off are reproducible (``metrics``).
"""

from __future__ import annotations

import jax
import numpy as np

import pdjax
from pdjax.disagg import ColocatedEngine, PDEngine
from pdjax.experiments import progress, schema
from pdjax.experiments.results import Result, markdown_table
from pdjax.experiments.runner import with_defaults

DEFAULTS = {
    "model": {"preset": "tiny", "seed": 0},
    "workload": {"short_requests": 8, "short_prompt": 16, "short_new_tokens": 160,
                 "long_requests": 3, "long_prompt": 768, "long_new_tokens": 4,
                 "long_first_arrival_s": 0.4, "long_interval_s": 0.5, "seed": 1},
    "engine": {"block_size": 16, "max_decode_slots": 12, "max_context": 1024, "chunk_tokens": 128},
}
CONFIG = schema.from_defaults("pd_vs_colocated", DEFAULTS)
SCALED = {"workload": ("short_requests", "long_requests", "long_prompt"),
          "engine": ("max_decode_slots", "max_context", "chunk_tokens")}


def workload(cfg: dict, vocab: int):
    w = cfg["workload"]
    rng = np.random.RandomState(w["seed"])
    prompts, new, arrivals = [], [], []
    for _ in range(w["short_requests"]):
        prompts.append(rng.randint(0, vocab, w["short_prompt"]).tolist())
        new.append(w["short_new_tokens"])
        arrivals.append(0.0)
    for i in range(w["long_requests"]):
        prompts.append(rng.randint(0, vocab, w["long_prompt"]).tolist())
        new.append(w["long_new_tokens"])
        arrivals.append(w["long_first_arrival_s"] + i * w["long_interval_s"])
    return prompts, new, arrivals


def _itl_series(stats, n_short):
    pts = []
    for r in stats["requests"][:n_short]:
        pts += list(zip(r["token_times"][1:], r["itl"]))
    return sorted(pts)


def run_pd_vs_colocated(cfg: dict, out_dir: str) -> Result:
    c = with_defaults(cfg, DEFAULTS, "pd_vs_colocated")
    scale = cfg.get("scale", 1)
    for sec, keys in SCALED.items():
        c[sec].update({k: c[sec][k] * scale for k in keys})
    if jax.device_count() < 8:
        raise ValueError(f"pd_vs_colocated needs 8 devices, got {jax.device_count()} "
                         "(set XLA_FLAGS=--xla_force_host_platform_device_count=8; `pdjax run` does)")
    mcfg = pdjax.configs.preset(c["model"]["preset"])
    params = pdjax.init_params(mcfg, jax.random.key(c["model"]["seed"]))
    prompts, new, arrivals = workload(c, mcfg.vocab_size)
    e = c["engine"]
    devs = jax.devices()
    engines = {
        "colocated": lambda: ColocatedEngine(params, mcfg, devices=devs[:4], mesh={"data": 2, "expert": 2},
                                             block_size=e["block_size"], max_decode_slots=e["max_decode_slots"],
                                             max_context=e["max_context"]),
        "pd": lambda: PDEngine(params, mcfg, prefill_devices=devs[:4], decode_devices=devs[4:],
                               prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2},
                               block_size=e["block_size"], max_decode_slots=e["max_decode_slots"],
                               max_context=e["max_context"]),
    }
    if e["chunk_tokens"]:
        engines["colocated_chunked"] = lambda: ColocatedEngine(
            params, mcfg, devices=devs[:4], mesh={"data": 2, "expert": 2}, block_size=e["block_size"],
            max_decode_slots=e["max_decode_slots"], max_context=e["max_context"],
            prefill_chunk_tokens=e["chunk_tokens"])
    n_short = c["workload"]["short_requests"]
    results, summary = {}, {}
    for name, make in progress.track(list(engines.items()), "pd_vs_colocated: engines (compile + serve)"):
        eng = make()
        eng.generate(prompts, max_new_tokens=new)                       # warm-up: compile everything
        out = eng.generate(prompts, max_new_tokens=new, arrival_times=arrivals)
        results[name] = out
        st = eng.stats
        itl = [x for r in st["requests"][:n_short] for x in r["itl"]]
        ttft_long = [r["ttft"] for r in st["requests"][n_short:]]
        summary[name] = {"itl_p50_ms": 1e3 * float(np.percentile(itl, 50)),
                         "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)),
                         "itl_max_ms": 1e3 * float(np.max(itl)),
                         "ttft_long_mean_ms": 1e3 * float(np.mean(ttft_long)),
                         "kv_bytes_sent": st["kv_bytes_sent"],
                         "series": _itl_series(st, n_short)}
    same = all(out == results["colocated"] for out in results.values())
    fig = _plot(summary, arrivals[n_short:])
    co, pd = summary["colocated"], summary["pd"]
    headline = (f"decode ITL P99 {co['itl_p99_ms']:.1f} ms colocated vs {pd['itl_p99_ms']:.1f} ms PD "
                f"(max {co['itl_max_ms']:.1f} vs {pd['itl_max_ms']:.1f} ms) while {len(arrivals) - n_short} "
                f"prompts of {c['workload']['long_prompt']} tokens arrive; identical tokens: {same}")
    if "colocated_chunked" in summary:
        ch = summary["colocated_chunked"]
        headline += (f"; colocated with {e['chunk_tokens']}-token prefill chunks: ITL P99 {ch['itl_p99_ms']:.1f} ms, "
                     f"long-prompt TTFT {ch['ttft_long_mean_ms']:.0f} vs {co['ttft_long_mean_ms']:.0f} ms")
    measured = [{"engine": k, **{kk: vv for kk, vv in v.items() if kk not in ("series", "kv_bytes_sent")}}
                for k, v in summary.items()]
    series = [{"engine": k, "time_s": t, "itl_ms": 1e3 * x} for k, v in summary.items() for t, x in v["series"]]
    body = (f"Real engines, {mcfg.num_hidden_layers}-layer {c['model']['preset']} model on 8 CPU devices.\n\n"
            + markdown_table(measured) + "\n\nThe simulated CPU devices share the host's cores, so a prefill on the "
            "prefill devices still slows the decode devices down: the PD spikes are compute contention, the "
            "colocated ones add the wait behind the whole prefill.")
    metrics = {"identical_tokens": same, "requests": len(prompts), "long_prompt": c["workload"]["long_prompt"],
               "kv_bytes_sent": {k: v["kv_bytes_sent"] for k, v in summary.items()},
               "tokens": [list(map(int, o)) for o in results["colocated"]]}
    return Result("PD vs colocated (real engines)", headline, metrics=metrics,
                  wall_clock={m["engine"]: {k: v for k, v in m.items() if k != "engine"} for m in measured},
                  tables={"engines": measured, "itl_series": series}, measured_tables=("engines", "itl_series"),
                  figures={"itl_over_time": fig}, body=body)


def _plot(summary, long_arrivals):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 3.5))
    ax = fig.subplots()
    for name, style in (("colocated", "tab:red"), ("colocated_chunked", "tab:orange"), ("pd", "tab:blue")):
        pts = summary.get(name, {}).get("series")
        if pts:
            t, itl = zip(*pts)
            ax.plot(t, [1e3 * x for x in itl], ".", ms=3, color=style, label=name)
    for a in long_arrivals:
        ax.axvline(a, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("time since start (s); dashed: a long prompt arrives")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    return fig
