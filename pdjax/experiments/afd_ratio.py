"""Experiment: where AF disaggregation wins and loses, over the M:N ratio, plus a measured run.

1. Simulated (a cost model per accelerator kind, :func:`cost_models`): DeepSeek-V3
   decode at a fixed context, M attention accelerators of one kind (bandwidth-rich: they
   read the KV cache) and N FFN accelerators of another (FLOP-rich: they run the experts),
   m ping-pong micro-batches (:class:`pdjax.sim.afd_step.AFDStepModel`), against colocated instances
   of ``baseline_ep`` accelerators holding every weight. Each attention accelerator holds as
   many requests as its KV room allows (no expert weights: more room than a colocated one);
   the speedup per accelerator is the speedup model (B_AFD/B_base)(T_base/T_AFD) M/(M+N)
   (:func:`pdjax.analysis.afd_speedup`), which here is exactly the ratio of the output tokens
   per second per accelerator. With N fixed, few attention accelerators leave the FFN side
   idle (the M/(M+N) discount wins) and many make it the bottleneck.
2. Measured (:func:`pdjax.experiments.afd_measure.measure_afd`): an AFDEngine on the 8
   simulated CPU devices, stage times and step time against the models fed those stages.

``scale`` multiplies the measured run's decode slots and new tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from pdjax.analysis import afd_min_microbatches, afd_speedup, hardware, param_counts
from pdjax.analysis.afd_bounds import attention_share
from pdjax.configs import PRESETS
from pdjax.experiments import progress
from pdjax.experiments.results import Result, markdown_table
from pdjax.experiments.schema import Header, knob, table
from pdjax.sim.afd_step import AFDStepModel
from pdjax.sim.cost import LinearStepCost

MAX_MICROBATCHES = 4           # the AFDEngine's ping-pong micro-batches


@dataclasses.dataclass(frozen=True)
class Model:
    preset: str = knob("deepseek_v3", choices=PRESETS)


@dataclasses.dataclass(frozen=True)
class Hardware:
    attention: str = "h200"      # bandwidth-rich (reads the KV cache)
    ffn: str = "h800"            # FLOP-rich (runs the experts)
    baseline: str = "h800"       # colocated instances of baseline_ep accelerators holding every weight
    dtype: str = knob("fp8", choices=("bf16", "fp8"))
    baseline_ep: int = knob(32, minimum=1)
    cost: str = knob("roofline", choices=("roofline", "linear"))
    exchange_gbps: float = knob(50.0, above=0)
    mfu: float = knob(1.0, above=0)
    mbu: float = knob(1.0, above=0)
    max_batch: int = knob(0, minimum=0)

    def __post_init__(self):
        for key in ("attention", "ffn", "baseline"):
            try:
                hardware(getattr(self, key))
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        for key in ("mfu", "mbu"):
            if getattr(self, key) > 1:
                raise ValueError(f"{key}: out of range, got {getattr(self, key)!r} (a fraction of peak, at most 1)")


@dataclasses.dataclass(frozen=True)
class Sweep:
    attention: list[int] = knob([16, 24, 32, 48, 64, 80, 96, 128], minimum=1, nonempty=True)   # M
    ffn: int = knob(16, minimum=1)                                                          # N
    contexts: list[int] = knob([4096, 16384], minimum=1, nonempty=True)
    microbatches: int = knob(2, minimum=1)


@dataclasses.dataclass(frozen=True)
class Measured:
    preset: str = knob("tiny", choices=PRESETS)
    attention: int = knob(4, minimum=1)
    ffn: int = knob(4, minimum=1)
    microbatches: list[int] = knob([1, 2, 3], minimum=1, nonempty=True)
    slots: int = knob(24, minimum=1)
    prompt_len: int = knob(16, minimum=1)
    new_tokens: int = knob(40, minimum=1)
    baseline: bool = True
    seed: int = 0

    def __post_init__(self):
        if max(self.microbatches) > MAX_MICROBATCHES:
            raise ValueError(f"microbatches: out of range, got {self.microbatches!r} (each in 1..{MAX_MICROBATCHES})")
        if self.new_tokens < self.slots + 3:
            raise ValueError(f"new_tokens: out of range, got {self.new_tokens!r} (at least measured.slots + 3)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Header):
    model: Model = table(Model)
    hardware: Hardware = table(Hardware)
    sweep: Sweep = table(Sweep)
    measured: Measured = table(Measured)

    def __post_init__(self):
        super().__post_init__()
        import pdjax
        ms = self.measured
        experts = pdjax.configs.preset(ms.preset).n_routed_experts
        if experts % ms.ffn:
            raise ValueError(f"measured.ffn: the {ms.preset} model's {experts} routed experts do not divide over "
                             f"{ms.ffn} FFN devices")
        for m in ms.microbatches:      # each of m micro-batches on each attention rank, its rows over the FFN ranks
            unit = m * math.lcm(ms.attention, ms.ffn)
            if ms.slots * self.scale % unit:
                raise ValueError(f"measured.slots: x scale ({ms.slots * self.scale}) must be a multiple of "
                                 f"m x lcm(attention, ffn) = {unit} for m = {m}")

    def devices_needed(self) -> int:
        return self.measured.attention + self.measured.ffn


class SplitCost:
    """The attention side of ``attn`` (a per-accelerator cost model) and the FFN side of
    ``ffn``: what :class:`pdjax.sim.afd_step.AFDStepModel` asks of one AF unit of two accelerator kinds."""

    def __init__(self, attn, ffn):
        self.attn, self.ffn = attn, ffn

    def decode_attention_time(self, kv_lens) -> float:
        """The attention accelerator's side of a decode step."""
        return self.attn.decode_attention_time(kv_lens)

    def decode_ffn_time(self, num_tokens: int) -> float:
        """The FFN side of a decode step of ``num_tokens`` on one FFN accelerator."""
        return self.ffn.decode_ffn_time(num_tokens)

    def afd_exchange_bytes(self, num_ffn: int) -> float:
        """One-way bytes per token per layer (the attention side's activations)."""
        return self.attn.afd_exchange_bytes(num_ffn)


def _batch(capacity, context: int, cap: int) -> int:
    """Requests of ``context`` tokens that fit in ``capacity`` KV tokens (at most ``cap`` > 0)."""
    b = int(capacity // context) if capacity else 0
    return min(b, cap) if cap > 0 else b


def cost_models(model_cfg, hw: Hardware, kv: Optional[dict] = None) -> tuple:
    """(attention, FFN, baseline) cost models of ``hw``'s accelerators (``hw.cost``:
    "roofline" = :class:`pdjax.analysis.costmodel.RooflineCostModel`, each op max(compute,
    memory), the experts a step touches; "linear" = :class:`LinearStepCost`, memory floor plus
    compute, every expert read each micro-batch) and the KV tokens an attention accelerator
    and a baseline instance hold (from :meth:`LinearStepCost.from_roofline`). ``kv``: the KV
    row, ``from_roofline``'s ``kv_layout`` and ``kv_dtype_bytes`` (default: the weights'
    dtype, uniform); the "roofline" cost reads the uniform row only."""
    from pdjax.analysis.costmodel import Efficiency, RooflineCostModel
    if kv and hw.cost != "linear":
        raise ValueError(f"cost: a chosen KV row ({kv}) needs the 'linear' cost, got {hw.cost!r}")
    rl = {"dtype": hw.dtype, "mfu": hw.mfu, "mbu": hw.mbu, **(kv or {})}
    lin_a = LinearStepCost.from_roofline(model_cfg, hw.attention, **rl)
    lin_b = LinearStepCost.from_roofline(model_cfg, hw.baseline, ep_size=hw.baseline_ep, **rl)
    caps = (lin_a.kv_capacity_attention, lin_b.kv_capacity)
    if hw.cost == "linear":
        return lin_a, LinearStepCost.from_roofline(model_cfg, hw.ffn, **rl), lin_b, caps
    eff = Efficiency(matmul=hw.mfu, attention=hw.mfu, hbm=hw.mbu)
    rf = {"dtype_bytes": lin_a.act_bytes, "efficiency": eff}
    return (RooflineCostModel(model_cfg, hw.attention, **rf), RooflineCostModel(model_cfg, hw.ffn, **rf),
            RooflineCostModel(model_cfg, hw.baseline, ep_size=hw.baseline_ep, **rf), caps)


def sim_rows(model_cfg, hw: Hardware, sweep: Sweep, kv: Optional[dict] = None) -> tuple[list[dict], list[str]]:
    """One row per (context, M) of the simulated sweep (see the module docstring), and notes
    on the ratios left out (weights that do not fit); ``kv`` as in :func:`cost_models`."""
    c_attn, c_ffn, c_base, (cap_a, cap_b) = cost_models(model_cfg, hw, kv)
    counts = param_counts(model_cfg)
    ffn_bytes = (counts.routed_experts + counts.shared_experts + counts.dense_mlp) * (1 if hw.dtype == "fp8" else 2)
    N, m, L, ep = sweep.ffn, sweep.microbatches, model_cfg.num_hidden_layers, hw.baseline_ep
    if ffn_bytes / N > hardware(hw.ffn).hbm_bytes:
        return [], [f"the FFN weights ({ffn_bytes / 1e9:.0f} GB) do not fit on {N} x {hw.ffn}"]
    rows, notes = [], []
    for ctx in sweep.contexts:
        b_a, b_b = _batch(cap_a, ctx, hw.max_batch), _batch(cap_b, ctx, hw.max_batch)
        if not b_a or not b_b:
            notes.append(f"context {ctx}: no request fits (attention {b_a}, colocated {b_b})")
            continue
        t_base = c_base.decode_step_time([ctx] * b_b)
        for M in sweep.attention:
            sm = AFDStepModel(SplitCost(c_attn, c_ffn), N, m, exchange_bw=hw.exchange_gbps * 1e9, num_layers=L)
            t_afd = sm.step_time([[ctx] * b_a] * M)
            t_a, t_f, t_c = sm.last
            gains = (b_a / (b_b / ep), t_base / t_afd, attention_share(M, N))
            rows.append({"context": ctx, "M": M, "N": N, "label": f"{M}A{N}F", "m": m, "batch_per_attention": b_a,
                         "batch_per_baseline_gpu": b_b / ep, "step_afd_ms": 1e3 * t_afd,
                         "step_base_ms": 1e3 * t_base, "t_attn_us": 1e6 * t_a, "t_ffn_us": 1e6 * t_f,
                         "t_comm_us": 1e6 * t_c,
                         "pingpong_min_m": afd_min_microbatches(t_c, t_f) if t_c <= t_f else math.inf,
                         "tok_s_per_gpu_afd": M * b_a / t_afd / (M + N), "tok_s_per_gpu_base": b_b / t_base / ep,
                         "batch_gain": gains[0], "step_time_gain": gains[1], "attention_share": gains[2],
                         "speedup": afd_speedup(*gains)})
    return rows, notes


def _measure(ms: Measured, scale: int) -> dict:
    """The measured run (:func:`pdjax.experiments.afd_measure.measure_afd`) of ``ms``."""
    import jax

    import pdjax
    from pdjax.experiments.afd_measure import measure_afd
    mcfg = pdjax.configs.preset(ms.preset)
    params = pdjax.init_params(mcfg, jax.random.key(ms.seed))
    return measure_afd(params, mcfg, attention=ms.attention, ffn=ms.ffn, microbatches=ms.microbatches,
                       slots=ms.slots * scale, prompt_len=ms.prompt_len, new_tokens=ms.new_tokens * scale,
                       baseline=ms.baseline, seed=ms.seed, progress=progress.track)


def run(c: Config, out_dir: str) -> Result:
    """The simulated M:N sweep and the measured small-scale run (see the module docstring)."""
    import jax

    import pdjax
    ms, hw = c.measured, c.hardware
    sim, notes = sim_rows(pdjax.configs.preset(c.model.preset), hw, c.sweep)
    measured = _measure(ms, c.scale)
    mrows = measured["rows"]
    body = (f"Simulated: {c.model.preset} {hw.dtype}, attention on {hw.attention}, FFN on {hw.ffn}, baseline "
            f"colocated on {hw.baseline_ep} x {hw.baseline}; {hw.cost} cost model (mfu {hw.mfu:g}, mbu {hw.mbu:g})."
            "\n\n" + markdown_table(sim) + ("\n\n" + "; ".join(notes) if notes else "")
            + f"\n\nMeasured on {jax.device_count()} {jax.devices()[0].platform} devices ({ms.preset} model, "
            f"baseline colocated step {measured['baseline_step_ms'] or math.nan:.2f} ms):\n\n" + markdown_table(mrows)
            + "\n\nOn XLA:CPU the attention and FFN programs run one at a time in issue order: the issue-order "
              "model is the one to hold a CPU measurement against; the overlap model (AFDStepModel) assumes the "
              "two sides run at the same time, as on GPUs.")
    models = ("issue_order", "overlap")
    return Result("AF disaggregation: M:N ratio and a measured run", _headline(sim, mrows),
                  metrics={"rows": sim, "notes": notes},
                  wall_clock={"measured": mrows, "baseline_step_ms": measured["baseline_step_ms"],
                              "step_error_pct": {f"m={r['m']}": {k: r[f"err_{k}_pct"] for k in models}
                                                 for r in mrows}},
                  tables={"afd_ratio": sim, "afd_measured": mrows}, measured_tables=("afd_measured",),
                  figures={"afd_ratio": _plot(sim, mrows, c)}, body=body)


def best_ratio(rows: list[dict]) -> dict:
    """The AF decision among :func:`sim_rows`' rows of one context: the M:N with the largest
    speedup per accelerator over the colocated baseline (AFD wins where it exceeds 1)."""
    return max(rows, key=lambda r: r["speedup"])


def _headline(sim: list[dict], mrows: list[dict]) -> str:
    parts = []
    for ctx in sorted({r["context"] for r in sim}):
        rs = [r for r in sim if r["context"] == ctx]
        best = best_ratio(rs)
        wins = [r["label"] for r in rs if r["speedup"] > 1]
        parts.append(f"at {ctx} tokens AFD wins at {', '.join(wins) or 'no ratio'} (best {best['label']}: "
                     f"{100 * (best['speedup'] - 1):+.1f} %)")
    err = ", ".join(f"m={r['m']} {r['err_issue_order_pct']:+.0f} %" for r in mrows)
    return "; ".join(parts) + f"; measured step vs the issue-order model: {err}"


def _plot(sim: list[dict], mrows: list[dict], c: Config):
    from pdjax.schedules.figure import Figure
    fig = Figure(figsize=(11, 4))
    ax, bx = fig.subplots(1, 2)
    for ctx in sorted({r["context"] for r in sim}):
        rs = [r for r in sim if r["context"] == ctx]
        ax.plot([r["M"] / r["N"] for r in rs], [100 * (r["speedup"] - 1) for r in rs], "o-", label=f"{ctx} tokens")
    ax.scatter([4, 3], [11.3, -5.3], marker="*", s=120, color="k", zorder=3, label="source, 16K (64A16F, 48A16F)")
    ax.axhline(0, color="grey", lw=1)
    ax.set_xlabel("M attention : N FFN accelerators")
    ax.set_ylabel("AFD gain per accelerator (%)\nabove 0: AFD wins")
    ax.set_title(f"{c.model.preset}: {c.hardware.attention} attention, {c.hardware.ffn} FFN, "
                 f"m = {c.sweep.microbatches}")
    ax.legend(fontsize=8)
    xs = range(len(mrows))
    for k, (key, label) in enumerate((("step_measured_ms", "measured"), ("step_issue_order_ms", "issue-order model"),
                                      ("step_overlap_ms", "overlap model (AFDStepModel)"))):
        bx.bar([x + 0.27 * (k - 1) for x in xs], [r[key] for r in mrows], width=0.27, label=label)
    bx.set_xticks(list(xs), [f"{r['M']}:{r['N']} m={r['m']}" for r in mrows])
    bx.set_ylabel("decode step (ms)")
    bx.set_title("measured (CPU devices) vs models fed its stages")
    bx.legend(fontsize=8)
    fig.tight_layout()
    return fig
