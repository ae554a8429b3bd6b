"""Experiment: DeepSeek-V3 against DeepSeek-V3.2 (sparse attention) across context lengths:
the deployment decisions each model's costs lead to, prompts of ``workload.contexts`` tokens
and short outputs, each model reading the KV row its DeepSeek kernels read (``[v3]``,
``[v32]``: ``kv_layout`` and ``kv_dtype``; V3 a BF16 row, V3.2 DeepSeek's FP8 one,
:func:`pdjax.analysis.kv.serving_kv_layout`).

Per model and context, one cost (:meth:`pdjax.sim.LinearStepCost.from_roofline` on
``hardware.ep_size`` accelerators an instance):

1. **Decode batch**: a decode instance holds floor(kv_capacity / (context + output))
   requests (the simulator reserves a request's whole context), kv_capacity = (ep x HBM -
   weights) / KV bytes per token; its decode throughput per GPU is the largest batch both
   that and the TPOT SLO allow, at a KV length of context + output / 2.
2. **P:D**: pd_ratio_sweep's decision (:func:`pdjax.sim.sweeps.pd_ratio_sweep` per split of
   ``pd.instances``, :func:`pdjax.experiments.pd_ratio_sweep.best_split`): the split with the
   highest rate meeting the SLO. The splits simulated are ``pd.prefill``, or the analytic
   best split (:func:`analytic_split`, the bound min(P x prefill rate, D x decode rate)) and
   its neighbours, then the simulated best's neighbours until both are in. Each rate search
   is bracketed by ``search.lo`` and ``search.hi`` times its split's bound; every split of a
   context simulates the same window of arrivals, long enough for ``search.lifetimes``
   request lifetimes (a shorter window lets a rate above the steady state pass before the
   decode batch has filled).
3. **AF**: afd_ratio's decision (:func:`pdjax.experiments.afd_ratio.sim_rows`,
   :func:`pdjax.experiments.afd_ratio.best_ratio`): M attention accelerators of ``af.attention``
   and N of ``af.ffn`` against colocated instances of the ``[hardware]`` ones, at a KV length
   of context + output; AFD is chosen where its best M:N beats the baseline per accelerator.

``scale`` multiplies the simulated window of arrivals (the same rates, tighter statistics).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from pdjax.analysis.kv import KV_LAYOUTS, kv_bytes_per_token
from pdjax.configs import PRESETS
from pdjax.experiments import afd_ratio, progress
from pdjax.experiments.pd_ratio_sweep import best_split
from pdjax.experiments.results import Result, markdown_table
from pdjax.experiments.schema import Header, knob, table
from pdjax.experiments.serving import SIMULATOR_NOTE, check_split, figure
from pdjax.sim.cost import LinearStepCost
from pdjax.sim.metrics import SLO
from pdjax.sim.sweeps import pd_ratio_sweep
from pdjax.sim.workload import WorkloadSpec

MODELS = (("v3", "V3"), ("v32", "V3.2"))          # config table, label
DTYPE_BYTES = {"bf16": 2, "fp8": 1}


@dataclasses.dataclass(frozen=True)
class ModelKnobs:
    preset: str = knob("deepseek_v3", choices=PRESETS)
    kv_layout: str = knob("uniform", choices=KV_LAYOUTS)
    kv_dtype: str = knob("bf16", choices=tuple(DTYPE_BYTES))     # a cached value's bytes ("uniform" layout)


@dataclasses.dataclass(frozen=True)
class V32Knobs(ModelKnobs):
    preset: str = knob("deepseek_v32", choices=PRESETS)
    kv_layout: str = knob("deepseek-fp8", choices=KV_LAYOUTS)


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str = "h200"
    dtype: str = knob("fp8", choices=tuple(DTYPE_BYTES))        # weights and compute
    ep_size: int = knob(8, minimum=1)                            # accelerators per instance
    mfu: float = knob(1.0, above=0)
    mbu: float = knob(1.0, above=0)
    link_gbps_per_gpu: Optional[float] = knob(None, above=0)    # KV link; none: the preset's scale-out

    def __post_init__(self):
        from pdjax.analysis import hardware
        try:
            hardware(self.name)
        except ValueError as e:
            raise ValueError(f"name: {e}") from None
        for key in ("mfu", "mbu"):
            if getattr(self, key) > 1:
                raise ValueError(f"{key}: must lie in (0, 1] (a fraction of peak), got {getattr(self, key)!r}")


@dataclasses.dataclass(frozen=True)
class Workload:
    contexts: list[int] = knob([4096, 8192, 16384, 32768, 65536, 131072], minimum=1, nonempty=True)
    output: int = knob(256, minimum=2)
    cv: float = knob(1.0, above=0)            # arrival gaps' coefficient of variation (1: Poisson)
    seed: int = knob(0, minimum=0)


@dataclasses.dataclass(frozen=True)
class Slo:
    ttft: float = knob(1.0, above=0)          # seconds, plus ttft_per_1k per 1,000 input tokens
    ttft_per_1k: float = knob(0.04, minimum=0)
    tpot: float = knob(0.05, above=0)         # seconds per output token after the first
    target: float = knob(0.9, above=0)

    def __post_init__(self):
        if self.target > 1:
            raise ValueError(f"target: must lie in (0, 1], got {self.target!r}")


@dataclasses.dataclass(frozen=True)
class PD:
    instances: int = knob(16, minimum=2)                # the budget: instances of ep_size accelerators
    prefill: Optional[list[int]] = knob(None, minimum=1)    # P values; none: 1 .. instances - 1
    token_budget: int = knob(16384, minimum=1)          # prefill tokens per step

    def __post_init__(self):
        for p in self.prefill or ():
            check_split(self.instances, p)


@dataclasses.dataclass(frozen=True)
class Search:
    duration: float = knob(5.0, above=0)      # seconds of arrivals per simulation, at least ...
    lifetimes: float = knob(4.0, above=0)     # ... this many request lifetimes (TTFT SLO + decode) and ...
    min_requests: int = knob(200, minimum=1)  # ... this many requests at the analytic best split's bound
    lo: float = knob(0.5, above=0)            # fractions of a split's analytic rate bound
    hi: float = knob(1.2, above=0)

    def __post_init__(self):
        if self.hi <= self.lo:
            raise ValueError(f"hi: must exceed lo = {self.lo}, got {self.hi}")


@dataclasses.dataclass(frozen=True)
class AF:
    attention: str = "h200"
    ffn: str = "h800"
    attention_counts: list[int] = knob([16, 32, 48, 64, 96, 128], minimum=1, nonempty=True)   # M
    ffn_count: int = knob(16, minimum=1)                                                  # N
    microbatches: int = knob(2, minimum=1)
    exchange_gbps: float = knob(50.0, above=0)

    def __post_init__(self):
        from pdjax.analysis import hardware
        for key in ("attention", "ffn"):
            try:
                hardware(getattr(self, key))
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Header):
    v3: ModelKnobs = table(ModelKnobs)
    v32: V32Knobs = table(V32Knobs)
    hardware: Hardware = table(Hardware)
    workload: Workload = table(Workload)
    slo: Slo = table(Slo)
    pd: PD = table(PD)
    search: Search = table(Search)
    af: AF = table(AF)

    def __post_init__(self):
        super().__post_init__()
        import pdjax
        from pdjax.analysis import hardware
        for key in ("attention", "ffn"):
            try:
                hardware(getattr(self.af, key)).peak_flops(self.hardware.dtype)
            except ValueError as e:
                raise ValueError(f"af.{key}: {e} (hardware.dtype = {self.hardware.dtype!r})") from None
        for key, _ in MODELS:
            m = getattr(self, key)
            cfg = pdjax.configs.preset(m.preset)
            try:
                kv_bytes_per_token(cfg, DTYPE_BYTES[m.kv_dtype], layout=m.kv_layout)
            except ValueError as e:
                raise ValueError(f"{key}.kv_layout: {m.preset}: {e}") from None
            try:
                cost = model_cost(cfg, m, self.hardware)
            except ValueError as e:
                raise ValueError(f"hardware: {m.preset} on {self.hardware.name} {self.hardware.dtype}: {e}") from None
            longest = max(self.workload.contexts) + self.workload.output
            if longest > cfg.max_position_embeddings:
                raise ValueError(f"workload.contexts: {longest} tokens with the output exceed {m.preset}'s "
                                 f"max_position_embeddings ({cfg.max_position_embeddings})")
            room = (f"leave KV room for {int(cost.kv_capacity)} tokens, less than one request of {longest}"
                    if cost.kv_capacity else f"do not hold {m.preset}'s {self.hardware.dtype} weights")
            if cost.kv_capacity is None or cost.kv_capacity < longest:
                raise ValueError(f"hardware.ep_size: {self.hardware.ep_size} x {self.hardware.name} {room}")


def kv_kwargs(m: ModelKnobs) -> dict:
    """``from_roofline``'s KV row arguments of a model table."""
    return {"kv_layout": m.kv_layout, "kv_dtype_bytes": DTYPE_BYTES[m.kv_dtype]}


def model_cost(cfg, m: ModelKnobs, hw: Hardware) -> LinearStepCost:
    """The step cost of one instance of ``hw.ep_size`` accelerators, reading ``m``'s KV row."""
    return LinearStepCost.from_roofline(cfg, hw.name, dtype=hw.dtype, ep_size=hw.ep_size, mfu=hw.mfu,
                                        mbu=hw.mbu, **kv_kwargs(m))


def decode_capacity(cost, context: int, output: int, tpot: float, ep_size: int) -> dict:
    """The decode instance at ``context``: ``batch_kv`` requests the KV holds (each reserving
    context + output tokens), ``batch`` the largest of those whose step (KV length context +
    output / 2) meets ``tpot``, that step, its output tok/s per GPU and requests/s."""
    batch_kv = int(cost.kv_capacity // (context + output))
    step = lambda b: cost.decode_step_time([context + output // 2] * b)     # noqa: E731
    lo, hi = 0, batch_kv                     # step(lo) meets tpot (or lo = 0); find the largest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step(mid) <= tpot else (lo, mid - 1)
    t = step(max(lo, 1))
    return {"decode_batch_kv": batch_kv, "decode_batch": lo, "decode_step_ms": 1e3 * t,
            "decode_tok_s_per_gpu": lo / t / ep_size if lo else 0.0,
            "decode_req_s_bound": lo / t / output if lo else 0.0}


def prefill_rate(cost, context: int, token_budget: int) -> float:
    """Prompts per second one prefill instance finishes alone: whole prompts packed
    ``token_budget`` tokens a step, or one prompt in chunks of ``token_budget``."""
    if context <= token_budget:
        n = token_budget // context
        return n / cost.prefill_step_time([(context, 0)] * n)
    t = sum(cost.prefill_step_time([(min(token_budget, context - c), c)])
            for c in range(0, context, token_budget))
    return 1.0 / t


def analytic_split(total: int, r_p: float, r_d: float) -> int:
    """The P of ``total`` instances with the highest bound min(P r_p, (total - P) r_d), the
    fewer prefill instances on a tie (``r_p``, ``r_d``: requests/s of one prefill, one decode
    instance)."""
    return max(range(1, total), key=lambda p: (min(p * r_p, (total - p) * r_d), -p))


def pd_decision(c: Config, cost, context: int, bounds: dict, link: float) -> tuple[list[dict], dict, float]:
    """pd_ratio_sweep's rows at ``context`` (one rate search per split, see the module
    docstring), its best split and the seconds of arrivals each simulation took. Without
    ``pd.prefill`` the splits are the analytic best and its neighbours, then the neighbours
    of the simulated best until it has both (or the end of the range)."""
    total, out = c.pd.instances, c.workload.output
    r_p, r_d = bounds["prefill_req_s_bound"], bounds["decode_req_s_bound"]
    est = lambda p: min(p * r_p, (total - p) * r_d) if r_d else p * r_p      # noqa: E731
    p0 = analytic_split(total, r_p, r_d)
    ttft = c.slo.ttft + c.slo.ttft_per_1k * context / 1e3
    lifetime = ttft + (out - 1) * bounds["decode_step_ms"] / 1e3
    duration = c.scale * max(c.search.duration, c.search.lifetimes * lifetime, c.search.min_requests / est(p0))
    done = {}
    todo = c.pd.prefill or [p for p in (p0 - 1, p0, p0 + 1) if 1 <= p < total]
    while todo:
        for p in todo:
            lo, hi = c.search.lo * est(p), c.search.hi * est(p)
            spec = WorkloadSpec(num_requests=1, rate=lo, input=context, output=out, cv=c.workload.cv,
                                seed=c.workload.seed)
            done[p], = pd_ratio_sweep(spec, cost, total, SLO(ttft, c.slo.tpot), prefill_counts=[p], lo=lo, hi=hi,
                                      target=c.slo.target, duration=duration,
                                      pd_kwargs={"link_bw": link, "token_budget": c.pd.token_budget})
        best = best_split(list(done.values()))["P"]
        todo = [] if c.pd.prefill else [p for p in (best - 1, best + 1) if 1 <= p < total and p not in done]
    rows = [{**done[p], "rate_bound": est(p)} for p in sorted(done)]
    return rows, best_split(rows), duration


def af_decisions(c: Config, cfg, m: ModelKnobs) -> tuple[dict, list[dict]]:
    """afd_ratio's M:N analysis at each context: {context: best row}, and all its rows."""
    hw, af = c.hardware, c.af
    ahw = afd_ratio.Hardware(attention=af.attention, ffn=af.ffn, baseline=hw.name, dtype=hw.dtype,
                             baseline_ep=hw.ep_size, cost="linear", exchange_gbps=af.exchange_gbps,
                             mfu=hw.mfu, mbu=hw.mbu)
    out = c.workload.output
    sweep = afd_ratio.Sweep(attention=af.attention_counts, ffn=af.ffn_count, microbatches=af.microbatches,
                            contexts=[ctx + out for ctx in c.workload.contexts])
    rows, _ = afd_ratio.sim_rows(cfg, ahw, sweep, kv=kv_kwargs(m))
    best = {}
    for ctx in c.workload.contexts:
        here = [r for r in rows if r["context"] == ctx + out]
        best[ctx] = afd_ratio.best_ratio(here) if here else None
    return best, rows


def _af_choice(row) -> str:
    if row is None:
        return "no fit"
    return row["label"] if row["speedup"] > 1 else "plain decode"


def model_rows(c: Config, key: str, label: str, link: float) -> tuple[list[dict], list[dict], list[dict]]:
    """One model's rows: one per context (the decisions), the P:D sweep's, the AF analysis's."""
    import pdjax
    m = getattr(c, key)
    cfg = pdjax.configs.preset(m.preset)
    cost = model_cost(cfg, m, c.hardware)
    af_best, af_rows = af_decisions(c, cfg, m)
    rows, sweep = [], []
    gpus = c.pd.instances * c.hardware.ep_size
    for ctx in progress.track(c.workload.contexts, f"dsa_context_sweep: {label} contexts"):
        b = decode_capacity(cost, ctx, c.workload.output, c.slo.tpot, c.hardware.ep_size)
        b["prefill_req_s_bound"] = prefill_rate(cost, ctx, c.pd.token_budget)
        pd_rows, best, duration = pd_decision(c, cost, ctx, b, link)
        sweep += [{"model": label, "context": ctx, **r} for r in pd_rows]
        af = af_best[ctx]
        rows.append({"model": label, "preset": m.preset, "kv_layout": m.kv_layout, "context": ctx,
                     "kv_bytes_per_token": cost.kv_bytes, "kv_capacity_tokens": int(cost.kv_capacity), **b,
                     "best_pd": best["label"], "max_rate": best["max_rate"], "rate_bound": best["rate_bound"],
                     "tok_s_per_gpu": best["max_rate"] * (ctx + c.workload.output) / gpus,
                     "sim_duration_s": duration, "af_best": af["label"] if af else "",
                     "af_speedup": af["speedup"] if af else math.nan, "af_choice": _af_choice(af)})
    return rows, sweep, [{"model": label, **r} for r in af_rows]


def compare(rows: list[dict]) -> list[dict]:
    """One row per context: V3 against V3.2, and what flipped since the context before."""
    by = {(r["model"], r["context"]): r for r in rows}
    contexts = sorted({r["context"] for r in rows})
    out = []
    for i, ctx in enumerate(contexts):
        row = {"context": ctx}
        for col, key in (("P:D", "best_pd"), ("tok/s/GPU", "tok_s_per_gpu"), ("decode batch", "decode_batch_kv"),
                         ("decode tok/s/GPU", "decode_tok_s_per_gpu"), ("AF", "af_choice")):
            for _, label in MODELS:
                row[f"{label} {col}"] = by[(label, ctx)][key]
        flips = [f"{label} {what} {by[(label, contexts[i - 1])][key]} -> {by[(label, ctx)][key]}"
                 for _, label in MODELS for what, key in (("P:D", "best_pd"), ("AF", "af_choice"))
                 if i and by[(label, contexts[i - 1])][key] != by[(label, ctx)][key]]
        row["flips"] = "; ".join(flips) or "-"
        out.append(row)
    return out


def _headline(rows: list[dict], cmp: list[dict]) -> str:
    (_, a), (_, b) = MODELS
    parts = []
    for _, label in MODELS:
        seq = [r[f"{label} P:D"] for r in cmp]
        parts.append(f"{label} P:D " + " -> ".join(dict.fromkeys(seq)))
    last = cmp[-1]
    ratio = last[f"{b} decode tok/s/GPU"] / last[f"{a} decode tok/s/GPU"] if last[f"{a} decode tok/s/GPU"] else math.inf
    return (", ".join(parts) + f"; at {last['context']} tokens {b} decodes {ratio:.2f}x {a}'s tokens per GPU "
            f"(KV batch {last[f'{b} decode batch']} vs {last[f'{a} decode batch']}), AF: {a} "
            f"{last[f'{a} AF']}, {b} {last[f'{b} AF']}")


def _plot(rows: list[dict], c: Config):
    fig = figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    for _, label in MODELS:
        rs = [r for r in rows if r["model"] == label]
        xs = [r["context"] / 1024 for r in rs]
        axes[0].plot(xs, [r["tok_s_per_gpu"] for r in rs], "o-", label=label)
        axes[1].plot(xs, [r["decode_tok_s_per_gpu"] for r in rs], "o-", label=label)
    axes[0].set_ylabel("tok/s per GPU (input + output) at the\nbest P:D's highest SLO rate")
    axes[1].set_ylabel("decode output tok/s per GPU\n(batch: KV and TPOT)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.legend()
    fig.suptitle(f"{c.pd.instances} instances of {c.hardware.ep_size} x {c.hardware.name} {c.hardware.dtype}")
    fig.tight_layout()
    return fig


def _body(c: Config, rows: list[dict], cmp: list[dict]) -> str:
    kvb = {r["model"]: r["kv_bytes_per_token"] for r in rows}
    hw, slo = c.hardware, c.slo
    rows_kv = ", ".join(f"{label} {getattr(c, key).kv_layout} ({kvb[label]:,} B/token)" for key, label in MODELS)
    return (f"{c.pd.instances} instances of {hw.ep_size} x {hw.name} ({hw.dtype} weights), output "
            f"{c.workload.output} tokens, SLO TTFT {slo.ttft:g} s + {slo.ttft_per_1k:g} s per 1K input tokens, TPOT "
            f"{slo.tpot * 1e3:g} ms, {slo.target:.0%} attainment. Cost: LinearStepCost.from_roofline (mfu "
            f"{hw.mfu:g}, mbu {hw.mbu:g}); KV rows: {rows_kv}. AF: {c.af.attention} attention, {c.af.ffn_count} x "
            f"{c.af.ffn} FFN, m = {c.af.microbatches}, against colocated instances of the same {hw.ep_size} x "
            f"{hw.name}.\n\n" + markdown_table(cmp) + "\n\n" + markdown_table(rows) + "\n\n" + SIMULATOR_NOTE)


def run(c: Config, out_dir: str) -> Result:
    """V3 vs V3.2 decisions at each context (see the module docstring)."""
    from pdjax.analysis import hardware
    hw = hardware(c.hardware.name)
    gbps = c.hardware.link_gbps_per_gpu
    link = c.hardware.ep_size * (gbps * 1e9 if gbps is not None else hw.link_bw("scale_out"))
    rows, sweep, af = [], [], []
    for key, label in MODELS:
        r, s, a = model_rows(c, key, label, link)
        rows, sweep, af = rows + r, sweep + s, af + a
    cmp = compare(rows)
    body = _body(c, rows, cmp)
    return Result("DeepSeek-V3 vs V3.2 across context lengths: P:D and AF decisions", _headline(rows, cmp),
                  metrics={"contexts": cmp, "rows": rows},
                  tables={"dsa_context_sweep": cmp, "dsa_models": rows, "dsa_pd_sweep": sweep, "dsa_af": af},
                  figures={"dsa_context_sweep": _plot(rows, c)}, body=body)
