"""The quick start: build a small model on the default backend, prefill and decode a batch
of prompts, and report throughput and the latent KV cache against the MHA counterfactual.

Each capability adds a section to the same report: a function ``(config, out_dir) ->
Section`` in ``SECTIONS``. ``scale`` multiplies the batch, the prompt length and the new
tokens, the PD-vs-colocated run's requests and prompts, and the executed pipeline's model
widths and batch (see those experiments, whose schemas check the ``[stall]`` and
``[executed]`` parts before anything runs).
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

import pdjax
from pdjax.analysis.report import quickstart_section
from pdjax.configs import PRESETS
from pdjax.experiments import afd_ratio, executed_bubbles, pd_vs_colocated, progress, results
from pdjax.experiments.results import Result
from pdjax.experiments.schema import Header, knob, parse, table
from pdjax.schedules.generators import GENERATORS

PRECISION = ("param_dtype", "compute_dtype", "cache_dtype")


@dataclasses.dataclass(frozen=True)
class Model:                                    # precision: ModelConfig's dtype fields
    preset: str = knob("tiny", choices=PRESETS)
    seed: int = 0
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    cache_dtype: str = "float32"

    def __post_init__(self):
        model_config(self)                      # dtype names checked before any compute


@dataclasses.dataclass(frozen=True)
class Workload:
    batch: int = knob(4, minimum=1)
    prompt_len: int = knob(32, minimum=1)
    max_new_tokens: int = knob(16, minimum=1)
    seed: int = 1


@dataclasses.dataclass(frozen=True)
class Analysis:     # DeepSeek's decode setting (docs/analysis.md): V3, fp8 over EP144, H800, KV length 4,989
    preset: str = knob("deepseek_v3", choices=PRESETS)
    hardware: str = "h800"
    context_len: int = knob(4989, minimum=1)
    weight_dtype_bytes: int = knob(1, minimum=1)
    compute_dtype: str = "fp8"
    ep_size: int = knob(144, minimum=1)

    def __post_init__(self):
        from pdjax.analysis import hardware
        try:
            hw = hardware(self.hardware)
        except ValueError as e:
            raise ValueError(f"hardware: {e}") from None
        try:
            hw.peak_flops(self.compute_dtype)
        except ValueError as e:
            raise ValueError(f"compute_dtype: {e}") from None
        from pdjax.analysis.moe_bounds import check_ep_size
        check_ep_size(pdjax.configs.preset(self.preset), self.ep_size)    # "ep_size: ..." before any run


@dataclasses.dataclass(frozen=True)
class Stall:        # a short pd_vs_colocated run (long prompts land during decode); long_requests = 0 skips it
    short_requests: int = knob(4, minimum=1)
    short_new_tokens: int = knob(100, minimum=2)
    long_requests: int = knob(2, minimum=0)
    long_prompt: int = knob(512, minimum=1)
    long_first_arrival_s: float = knob(0.3, minimum=0)
    long_interval_s: float = knob(0.4, minimum=0)
    chunk_tokens: int = knob(128, minimum=0)


@dataclasses.dataclass(frozen=True)
class Executed:     # a short executed_bubbles run (training steps vs simulated); schedules = [] skips it
    schedules: list[str] = knob(["zb1p", "dualpipe"], choices=GENERATORS)
    ranks: int = knob(2, minimum=1)
    microbatches: int = knob(4, minimum=1)
    layers: int = knob(2, minimum=1)
    rows: int = knob(2, minimum=1)
    seq_len: int = knob(16, minimum=2)
    repeats: int = knob(3, minimum=1)
    op_repeats: int = knob(2, minimum=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Header):
    model: Model = table(Model)
    workload: Workload = table(Workload)
    analysis: Analysis = table(Analysis)
    stall: Stall = table(Stall)
    executed: Executed = table(Executed)

    def __post_init__(self):
        super().__post_init__()
        for key, kind, sub in (("stall", "pd_vs_colocated", self.stall_config),
                               ("executed", "executed_bubbles", self.executed_config)):
            try:
                sub()
            except ValueError as e:
                raise ValueError(f"{key}: as a {kind} run, {e}") from None

    def scaled_workload(self) -> Workload:
        w, s = self.workload, self.scale
        return dataclasses.replace(w, batch=w.batch * s, prompt_len=w.prompt_len * s,
                                   max_new_tokens=w.max_new_tokens * s)

    def stall_config(self):
        """The ``[stall]`` part as a pd_vs_colocated config (None: skipped); its own model
        precision (the default)."""
        st = self.stall
        if not st.long_requests:
            return None
        workload = {k: v for k, v in dataclasses.asdict(st).items() if k != "chunk_tokens"}
        return parse(pd_vs_colocated.Config, {
            "kind": "pd_vs_colocated", "scale": self.scale, "workload": workload,
            "model": {"preset": self.model.preset, "seed": self.model.seed},
            "engine": {"chunk_tokens": st.chunk_tokens, "max_context": st.long_prompt + 64}})

    def executed_config(self):
        """The ``[executed]`` part as an executed_bubbles config (None: skipped)."""
        e = self.executed
        if not e.schedules:
            return None
        return parse(executed_bubbles.Config, {
            "kind": "executed_bubbles", "scale": self.scale,
            "run": {k: getattr(e, k) for k in ("schedules", "ranks", "microbatches", "repeats", "op_repeats")},
            "model": {"preset": self.model.preset, "layers": e.layers, "seed": self.model.seed},
            "batch": {"rows": e.rows, "seq_len": e.seq_len}})


@dataclasses.dataclass
class Section:
    """One part of the report: its markdown, its reproducible metrics, its measured times and
    its figures (name -> matplotlib Figure)."""

    markdown: str
    metrics: dict = dataclasses.field(default_factory=dict)
    wall_clock: dict = dataclasses.field(default_factory=dict)
    figures: dict = dataclasses.field(default_factory=dict)


def _table(t: dict) -> str:
    return "\n".join(f"| {k} | {v} |" for k, v in t.items())


def model_config(model: Model):
    """The preset with the config's precision (ValueError naming the bad key)."""
    base = pdjax.configs.preset(model.preset)
    for key in PRECISION:
        try:
            base = base.replace(**{key: getattr(model, key)})
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    return base


def _timed_generation(params, mcfg, prompts, N: int) -> tuple:
    """Prefill and greedy-decode ``N`` tokens: once to compile, once timed. Returns (new
    tokens, cache, compile s, prefill s, decode s)."""
    def prefill():
        logits, cache = pdjax.prefill(params, mcfg, prompts, max_len=prompts.shape[1] + N)
        return logits.block_until_ready(), cache

    def decode(logits, cache):
        tok = np.asarray(logits[:, -1].argmax(-1), np.int32)
        out = [tok]
        for _ in range(N - 1):
            step, cache = pdjax.decode_step(params, mcfg, tok, cache)
            tok = np.asarray(step.argmax(-1), np.int32)
            out.append(tok)
        return np.stack(out, 1), cache

    t0 = time.perf_counter()
    decode(*prefill())                      # compile both
    t1 = time.perf_counter()
    logits, cache = prefill()
    t2 = time.perf_counter()
    new_tokens, cache = decode(logits, cache)
    t3 = time.perf_counter()
    return new_tokens, cache, t1 - t0, t2 - t1, t3 - t2


def model_section(c: Config, out_dir: str) -> Section:
    import jax

    from pdjax import analysis
    mcfg, w = model_config(c.model), c.scaled_workload()
    B, T, N = w.batch, w.prompt_len, w.max_new_tokens
    params = pdjax.init_params(mcfg, jax.random.key(c.model.seed))
    prompts = np.random.RandomState(w.seed).randint(0, mcfg.vocab_size, (B, T)).astype(np.int32)
    new_tokens, cache, compile_s, t_prefill, t_decode = _timed_generation(params, mcfg, prompts, N)
    agree = bool(np.array_equal(pdjax.generate(params, mcfg, prompts, max_new_tokens=N)[:, T:], new_tokens))
    L, H, itemsize = mcfg.num_hidden_layers, mcfg.num_attention_heads, cache.dtype.itemsize
    mla_bytes = cache.nbytes_per_token()          # measured from the real cache buffers
    mha_bytes = analysis.kv_bytes_per_token(mcfg, itemsize, "mha")
    data = {"backend": jax.default_backend(), "devices": jax.device_count(), "model": c.model.preset, "layers": L,
            "batch": B, "prompt_len": T, "new_tokens": N, "generate_agrees": agree,
            "kv_bytes_per_token_mla": mla_bytes, "kv_bytes_per_token_mha": mha_bytes,
            "kv_ratio_mha_over_mla": round(mha_bytes / mla_bytes, 2),
            "first_tokens_row0": [int(t) for t in new_tokens[0, :8]],
            "precision": {k: getattr(mcfg, k) for k in ("param_dtype", "compute_dtype", "kv_cache_dtype")}}
    timed = {"compile_s": round(compile_s, 2), "prefill_tok_s": round(B * T / t_prefill, 1),
             "decode_tok_s": round(B * (N - 1) / t_decode, 1),
             "decode_step_ms": round(1e3 * t_decode / max(N - 1, 1), 2)}
    md = ["## Model: prefill and decode",
          f"{c.model.preset} model ({L} layers, {mcfg.n_routed_experts} experts top-{mcfg.num_experts_per_tok}) on "
          f"{data['backend']} x{data['devices']}; batch {B}, prompt {T}, {N} new tokens (greedy).", "",
          "| quantity | value |", "|---|---|",
          _table({
              "prefill throughput": f"{timed['prefill_tok_s']:,} tok/s",
              "decode throughput": f"{timed['decode_tok_s']:,} tok/s ({timed['decode_step_ms']} ms/step)",
              "compile (first call)": f"{timed['compile_s']} s",
              "decode loop == pdjax.generate": "yes" if agree else "NO",
              "latent KV bytes/token (all layers)":
                  f"{mla_bytes:,} B = {L} layers x ({mcfg.kv_lora_rank} + {mcfg.qk_rope_head_dim}) x {itemsize} B",
              "MHA counterfactual bytes/token":
                  f"{mha_bytes:,} B = {L} x {H} heads x ({mcfg.qk_nope_head_dim} + {mcfg.v_head_dim}) x {itemsize} B",
              "MHA / MLA": f"{data['kv_ratio_mha_over_mla']}x",
              "precision (params / compute / KV cache)":
                  f"{mcfg.param_dtype} / {mcfg.compute_dtype} / {mcfg.kv_cache_dtype}"}), "",
          "First tokens of row 0: prompt " + " ".join(map(str, prompts[0, :8])) + " ... -> "
          + " ".join(map(str, new_tokens[0, :8]))]
    return Section("\n".join(md), data, timed)


def pipeline_section(c: Config, out_dir: str) -> Section:
    """DeepSeek's reference DualPipe example (8 ranks, 20 micro-batches) against 1F1B and ZB1P:
    simulated bubbles next to the closed forms, and a Gantt chart of DualPipe."""
    from pdjax import schedules as pipeline

    P, m = 8, 20
    costs = dict(F=1.0, B=2.0, W=1.0, FB=2.5)
    rows = pipeline.compare(["1f1b", "zb1p", "dualpipe"], P, m, **costs)
    timeline = pipeline.simulate(pipeline.build("dualpipe", num_ranks=P, num_microbatches=m), **costs)
    md = ["## Pipeline schedules", f"P = {P} stages, m = {m} micro-batches, F=1, B=2 (I=1, W=1), F&B=2.5, "
          "no comm latency. Simulated (ASAP list scheduling of the generated op order) vs formula:", "",
          "```", pipeline.format_report(rows), "```", "", "DualPipe Gantt chart: dualpipe_8x20 (Figures)."]
    data = {r.schedule: {"sim_bubble": r.sim_bubble, "formula_bubble": r.formula_bubble,
                         "bubble_ratio": r.bubble_ratio} for r in rows}
    return Section("\n".join(md), data, figures={"dualpipe_8x20": pipeline.plot(timeline)})


def analysis_section(c: Config, out_dir: str) -> Section:
    """Roofline and KV accounting of a published config on a hardware preset."""
    from pdjax import analysis
    a = c.analysis
    mcfg = pdjax.configs.preset(a.preset)
    md = quickstart_section(mcfg, a.hardware, context_len=a.context_len, weight_dtype_bytes=a.weight_dtype_bytes,
                            ep_size=a.ep_size, compute_dtype=a.compute_dtype)
    data = {"kv_bytes_per_token_mla": analysis.kv_bytes_per_token(mcfg, 2, "mla"),
            "kv_bytes_per_token_mha": analysis.kv_bytes_per_token(mcfg, 2, "mha"),
            "machine_balance_bf16": analysis.machine_balance(a.hardware, "bf16")}
    return Section("## Analysis\n" + md, data)


def pd_section(c: Config, out_dir: str) -> Section:
    """The quick start's prompts through a real PD-disaggregated engine: prefill on devices
    0-3 (EP4), decode on 4-7 (DP2 x EP2, paged cache), latent KV handed off layer by layer."""
    import jax

    from pdjax.disagg import PDEngine
    if jax.device_count() < 8:
        return Section("## PD disaggregation\nskipped: needs 8 devices (`pdjax run` provides them)")
    mcfg, w = model_config(c.model), c.scaled_workload()
    params = pdjax.init_params(mcfg, jax.random.key(c.model.seed))
    rng = np.random.RandomState(w.seed)
    prompts = [rng.randint(0, mcfg.vocab_size, n).tolist() for n in (3, w.prompt_len, 2 * w.prompt_len, 9)]
    N = w.max_new_tokens
    eng = PDEngine(params, mcfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:8],
                   prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2}, max_decode_slots=4,
                   max_context=2 * w.prompt_len + N)
    t0 = time.perf_counter()
    eng.generate(prompts, max_new_tokens=N)                  # first call compiles
    compile_s = time.perf_counter() - t0
    out = eng.generate(prompts, max_new_tokens=N)
    same = out == pdjax.generate(params, mcfg, prompts, max_new_tokens=N)
    st = eng.stats
    formula = sum(len(p) for p in prompts) * mcfg.kv_latent_dim * mcfg.num_hidden_layers * 4
    ttft = [r["ttft"] for r in st["requests"]]
    tpot = [r["tpot"] for r in st["requests"] if r["tpot"] is not None]
    data = {"identical_to_generate": same, "kv_bytes_sent": st["kv_bytes_sent"], "kv_bytes_formula": formula}
    timed = {"ttft_ms_mean": 1e3 * float(np.mean(ttft)), "tpot_ms_mean": 1e3 * float(np.mean(tpot)),
             "compile_s": compile_s}
    md = ["## PD disaggregation", f"{len(prompts)} prompts ({', '.join(str(len(p)) for p in prompts)} tokens), "
          f"{N} new tokens each, through PDEngine (prefill EP4 on devices 0-3, decode DP2xEP2 on 4-7).", "",
          "| quantity | value |", "|---|---|",
          _table({"tokens identical to pdjax.generate": "yes" if same else "NO",
                  "KV bytes handed off": f"{st['kv_bytes_sent']:,} B (prompt tokens x (C+R) x layers x 4 B "
                                         f"= {formula:,} B)",
                  "mean TTFT / TPOT (compiled)": f"{timed['ttft_ms_mean']:.1f} ms / {timed['tpot_ms_mean']:.1f} ms",
                  "first call (compiles)": f"{compile_s:.1f} s"}),
          ""]
    md += _stall(c, out_dir, data, timed)
    return Section("\n".join(md), data, timed)


def _stall(c: Config, out_dir: str, data: dict, timed: dict) -> list[str]:
    """The pd_vs_colocated experiment, shortened: its headline and plot in the report."""
    sub_cfg = c.stall_config()
    if sub_cfg is None:
        return ["Long prefills landing during decode: `pdjax run pd_vs_colocated`."]
    sub = os.path.join(out_dir, "pd_vs_colocated")
    res = pd_vs_colocated.run(sub_cfg, sub)
    results.write(res, sub)
    data["stall"] = res.metrics
    timed["stall"] = res.wall_clock
    return ["### Long prefills landing during decode", "", res.headline + ".", "",
            "![ITL over time](pd_vs_colocated/itl_over_time.png)", "",
            "Full run: `pdjax run pd_vs_colocated`; this part: "
            "[pd_vs_colocated/report.md](pd_vs_colocated/report.md)."]


def executed_pipeline_section(c: Config, out_dir: str) -> Section:
    """The executed_bubbles experiment, shortened: schedules run as training steps of a
    2-layer model of the quick start's preset, measured vs simulated with isolated op times.
    Each rank is a process of its own (``[run] cluster``, executed_bubbles' default) on
    the host's cores, so it needs no jax device per rank: it runs at any ``ranks``, and the
    report says how the ranks share the cores."""
    e, sub_cfg = c.executed, c.executed_config()
    full = "Full run: `pdjax run executed_bubbles`."
    if sub_cfg is None:
        return Section("## Executed pipeline\nskipped ([executed] schedules = []). " + full)
    sub = os.path.join(out_dir, "executed_pipeline")
    os.makedirs(sub, exist_ok=True)
    res = executed_bubbles.run(sub_cfg, sub)
    results.write(res, sub)
    last = e.schedules[-1]
    where = executed_bubbles.placement(sub_cfg.run, executed_bubbles.host_cores())
    about = (f"{', '.join(e.schedules)} run as real training steps of a {e.layers}-layer "
             f"{c.model.preset} model, {e.ranks} ranks ({where}), {e.microbatches} micro-batches "
             f"of {e.rows} x {e.seq_len} tokens: the executor's measured timeline against `simulate()` fed "
             "with every op's time measured in isolation (ranks sharing cores make the measured run slower "
             "than the isolated op times predict).")
    md = ["## Executed pipeline", about, "", executed_bubbles.report_table(res["row_objects"]),
          f"{last}, measured (top) vs simulated (bottom): ![{last}](executed_pipeline/{last}.png)", "",
          f"{full} This part: [executed_pipeline/report.md](executed_pipeline/report.md)."]
    return Section("\n".join(md), res.metrics, {"headline": res.headline})


def afd_section(c: Config, out_dir: str) -> Section:
    """The AF-disaggregation M:N sweep, simulated (the afd_ratio experiment's defaults:
    DeepSeek-V3 fp8, attention on H200, FFN on H800, against colocated H800s): per context,
    the throughput per accelerator against the colocated baseline at each ratio."""
    m, hw, sw = afd_ratio.Model(), afd_ratio.Hardware(), afd_ratio.Sweep()
    rows, notes = afd_ratio.sim_rows(pdjax.configs.preset(m.preset), hw, sw)
    table = [{"context": r["context"], "M:N": r["label"], "batch gain": r["batch_gain"],
              "step-time gain": r["step_time_gain"], "speedup": r["speedup"]} for r in rows]
    wins = {ctx: [r["M:N"] for r in table if r["context"] == ctx and r["speedup"] > 1]
            for ctx in dict.fromkeys(r["context"] for r in table)}
    md = ["## AF disaggregation (simulated M:N sweep)",
          f"{m.preset} {hw.dtype}, attention on {hw.attention}, FFN on {hw.ffn} ({sw.ffn} of them), "
          f"m = {sw.microbatches}, against {hw.baseline_ep} x {hw.baseline} colocated; speedup = throughput per "
          "accelerator / the baseline's. AFD wins at: "
          + "; ".join(f"{ctx} tokens {', '.join(w) or 'no ratio'}" for ctx, w in wins.items()) + ".", "",
          results.markdown_table(table), *(["", "; ".join(notes)] if notes else []), "",
          "The full sweep with a measured AFDEngine run: `pdjax run afd_ratio`."]
    return Section("\n".join(md), {"rows": table, "wins": {str(k): v for k, v in wins.items()}})


SECTIONS = [model_section, analysis_section, pipeline_section, executed_pipeline_section, pd_section, afd_section]


def run(c: Config, out_dir: str) -> Result:
    """Every section of :data:`SECTIONS` into one Result; metrics and wall_clock are keyed by
    section (``model``, ``analysis``, ``pipeline``, ``executed_pipeline``, ``pd``, ``afd``)."""
    parts, metrics, wall_clock, figures = [], {}, {}, {}
    for section in progress.track(SECTIONS, "quickstart: sections"):
        s = section(c, out_dir)
        key = section.__name__.removesuffix("_section")
        parts.append(s.markdown)
        metrics[key], figures = s.metrics, {**figures, **s.figures}
        if s.wall_clock:
            wall_clock[key] = s.wall_clock
    m = metrics["model"]
    headline = (f"{m['model']} model: decode loop == pdjax.generate: {'yes' if m['generate_agrees'] else 'NO'}; "
                f"latent KV {m['kv_bytes_per_token_mla']:,} B/token vs {m['kv_bytes_per_token_mha']:,} B for MHA "
                f"({m['kv_ratio_mha_over_mla']}x)")
    if metrics["pd"]:
        same = metrics["pd"]["identical_to_generate"]
        headline += f"; PD engine tokens identical to generate: {'yes' if same else 'NO'}"
    return Result("pdjax quick start", headline, metrics=metrics, wall_clock=wall_clock, figures=figures,
                  body="\n\n".join(parts))
