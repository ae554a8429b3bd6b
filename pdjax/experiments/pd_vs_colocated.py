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

import dataclasses

import numpy as np

from pdjax.configs import PRESETS
from pdjax.experiments import progress
from pdjax.experiments.results import Result, markdown_table
from pdjax.experiments.schema import Header, knob, table

DEVICES = 8                 # prefill on devices 0-3, decode on 4-7
DECODE_RANKS = 4            # the decode mesh: data 2 x expert 2


@dataclasses.dataclass(frozen=True)
class Model:
    preset: str = knob("tiny", choices=PRESETS)
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Workload:
    short_requests: int = knob(8, minimum=1)      # decoding from t = 0
    short_prompt: int = knob(16, minimum=1)
    short_new_tokens: int = knob(160, minimum=2)
    long_requests: int = knob(3, minimum=1)       # long prompts arriving during decode
    long_prompt: int = knob(768, minimum=1)
    long_new_tokens: int = knob(4, minimum=1)
    long_first_arrival_s: float = knob(0.4, minimum=0)
    long_interval_s: float = knob(0.5, minimum=0)
    seed: int = 1


@dataclasses.dataclass(frozen=True)
class Engine:
    block_size: int = knob(16, minimum=1)
    max_decode_slots: int = knob(12, minimum=1)   # over the 4 decode DP ranks
    max_context: int = knob(1024, minimum=1)
    chunk_tokens: int = knob(128, minimum=0)      # a third engine: colocated with chunked prefill (0 = skip)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Header):
    model: Model = table(Model)
    workload: Workload = table(Workload)
    engine: Engine = table(Engine)

    def __post_init__(self):
        super().__post_init__()
        w, e, s = self.workload, self.engine, self.scale
        if e.max_decode_slots * s % DECODE_RANKS:
            raise ValueError(f"engine.max_decode_slots: x scale ({e.max_decode_slots} x {s}) must divide over the "
                             f"{DECODE_RANKS} decode DP ranks")
        for kind, need in (("short", w.short_prompt + w.short_new_tokens),
                           ("long", w.long_prompt * s + w.long_new_tokens)):
            if need > e.max_context * s:
                raise ValueError(f"engine.max_context: x scale ({e.max_context * s}) must hold a {kind} request's "
                                 f"prompt and new tokens ({need})")

    def devices_needed(self) -> int:
        return DEVICES

    def scaled(self) -> "Config":
        """The config with ``scale`` applied (request counts, long prompts, slots, context, chunk)."""
        s, w, e = self.scale, self.workload, self.engine
        return dataclasses.replace(
            self, scale=1,
            workload=dataclasses.replace(w, short_requests=w.short_requests * s, long_requests=w.long_requests * s,
                                         long_prompt=w.long_prompt * s),
            engine=dataclasses.replace(e, max_decode_slots=e.max_decode_slots * s, max_context=e.max_context * s,
                                       chunk_tokens=e.chunk_tokens * s))


def workload(w: Workload, vocab: int):
    """(prompts, new tokens, arrival times) of the requests: the short ones at t = 0, then
    the long ones."""
    rng = np.random.RandomState(w.seed)
    prompts, new, arrivals = [], [], []
    for _ in range(w.short_requests):
        prompts.append(rng.randint(0, vocab, w.short_prompt).tolist())
        new.append(w.short_new_tokens)
        arrivals.append(0.0)
    for i in range(w.long_requests):
        prompts.append(rng.randint(0, vocab, w.long_prompt).tolist())
        new.append(w.long_new_tokens)
        arrivals.append(w.long_first_arrival_s + i * w.long_interval_s)
    return prompts, new, arrivals


def _engines(params, mcfg, e: Engine) -> dict:
    """name -> a function building that engine on the first 8 devices."""
    import jax

    from pdjax.disagg import ColocatedEngine, PDEngine
    devs = jax.devices()
    common = dict(block_size=e.block_size, max_decode_slots=e.max_decode_slots, max_context=e.max_context)
    engines = {
        "colocated": lambda: ColocatedEngine(params, mcfg, devices=devs[:4], mesh={"data": 2, "expert": 2}, **common),
        "pd": lambda: PDEngine(params, mcfg, prefill_devices=devs[:4], decode_devices=devs[4:DEVICES],
                               prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2}, **common),
    }
    if e.chunk_tokens:
        engines["colocated_chunked"] = lambda: ColocatedEngine(
            params, mcfg, devices=devs[:4], mesh={"data": 2, "expert": 2}, prefill_chunk_tokens=e.chunk_tokens,
            **common)
    return engines


def _serve(make, prompts, new, arrivals, n_short: int) -> tuple[list, dict]:
    """One engine: a warm-up run (compiles everything), then the timed one; its tokens and
    latency summary."""
    eng = make()
    eng.generate(prompts, max_new_tokens=new)
    out = eng.generate(prompts, max_new_tokens=new, arrival_times=arrivals)
    st = eng.stats
    itl = [x for r in st["requests"][:n_short] for x in r["itl"]]
    ttft_long = [r["ttft"] for r in st["requests"][n_short:]]
    series = sorted(pt for r in st["requests"][:n_short] for pt in zip(r["token_times"][1:], r["itl"]))
    return out, {"itl_p50_ms": 1e3 * float(np.percentile(itl, 50)), "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)),
                 "itl_max_ms": 1e3 * float(np.max(itl)), "ttft_long_mean_ms": 1e3 * float(np.mean(ttft_long)),
                 "kv_bytes_sent": st["kv_bytes_sent"], "series": series}


def _headline(summary: dict, c: Config, n_long: int, same: bool) -> str:
    co, pd = summary["colocated"], summary["pd"]
    headline = (f"decode ITL P99 {co['itl_p99_ms']:.1f} ms colocated vs {pd['itl_p99_ms']:.1f} ms PD "
                f"(max {co['itl_max_ms']:.1f} vs {pd['itl_max_ms']:.1f} ms) while {n_long} "
                f"prompts of {c.workload.long_prompt} tokens arrive; identical tokens: {same}")
    if "colocated_chunked" in summary:
        ch = summary["colocated_chunked"]
        headline += (f"; colocated with {c.engine.chunk_tokens}-token prefill chunks: ITL P99 "
                     f"{ch['itl_p99_ms']:.1f} ms, long-prompt TTFT {ch['ttft_long_mean_ms']:.0f} vs "
                     f"{co['ttft_long_mean_ms']:.0f} ms")
    return headline


def run(c: Config, out_dir: str) -> Result:
    import jax

    import pdjax
    c = c.scaled()
    mcfg = pdjax.configs.preset(c.model.preset)
    params = pdjax.init_params(mcfg, jax.random.key(c.model.seed))
    prompts, new, arrivals = workload(c.workload, mcfg.vocab_size)
    n_short = c.workload.short_requests
    tokens, summary = {}, {}
    for name, make in progress.track(list(_engines(params, mcfg, c.engine).items()),
                                     "pd_vs_colocated: engines (compile + serve)"):
        tokens[name], summary[name] = _serve(make, prompts, new, arrivals, n_short)
    same = all(out == tokens["colocated"] for out in tokens.values())
    measured = [{"engine": k, **{kk: vv for kk, vv in v.items() if kk not in ("series", "kv_bytes_sent")}}
                for k, v in summary.items()]
    series = [{"engine": k, "time_s": t, "itl_ms": 1e3 * x} for k, v in summary.items() for t, x in v["series"]]
    body = (f"Real engines, {mcfg.num_hidden_layers}-layer {c.model.preset} model on 8 CPU devices.\n\n"
            + markdown_table(measured) + "\n\nThe simulated CPU devices share the host's cores, so a prefill on the "
            "prefill devices still slows the decode devices down: the PD spikes are compute contention, the "
            "colocated ones add the wait behind the whole prefill.")
    metrics = {"identical_tokens": same, "requests": len(prompts), "long_prompt": c.workload.long_prompt,
               "kv_bytes_sent": {k: v["kv_bytes_sent"] for k, v in summary.items()},
               "tokens": [list(map(int, o)) for o in tokens["colocated"]]}
    return Result("PD vs colocated (real engines)", _headline(summary, c, len(arrivals) - n_short, same),
                  metrics=metrics,
                  wall_clock={m["engine"]: {k: v for k, v in m.items() if k != "engine"} for m in measured},
                  tables={"engines": measured, "itl_series": series}, measured_tables=("engines", "itl_series"),
                  figures={"itl_over_time": _plot(summary, arrivals[n_short:])}, body=body)


def _plot(summary, long_arrivals):
    from pdjax.schedules.figure import Figure
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
