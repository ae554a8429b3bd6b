"""The quick start: build a small model on the default backend, prefill and decode a batch
of prompts, and report throughput and the latent KV cache against the MHA counterfactual.

Each capability adds a section to the same report: a function ``(config, out_dir) ->
Section`` in ``SECTIONS``. ``scale`` multiplies the batch, the prompt length and the new
tokens, the PD-vs-colocated run's requests and prompts, and the executed pipeline's model
widths and batch (see those experiments).
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

import pdjax
from pdjax import analysis
from pdjax.experiments import progress, results, schema
from pdjax.experiments.results import Result
from pdjax.experiments.runner import with_defaults

DEFAULTS = {
    # precision: param, compute and KV-cache dtypes (ModelConfig's fields; "bfloat16" etc.)
    "model": {"preset": "tiny", "seed": 0, "param_dtype": "float32", "compute_dtype": "float32",
              "cache_dtype": "float32"},
    "workload": {"batch": 4, "prompt_len": 32, "max_new_tokens": 16, "seed": 1},
    # DeepSeek's production decode setting (as in docs/analysis.md): V3, fp8 weights over EP144,
    # H800, mean KV length 4,989.
    "analysis": {"preset": "deepseek_v3", "hardware": "h800", "context_len": 4989,
                 "weight_dtype_bytes": 1, "compute_dtype": "fp8", "ep_size": 144},
    # a short pd_vs_colocated run (long prompts landing during decode); long_requests = 0 skips it
    "stall": {"short_requests": 4, "short_new_tokens": 100, "long_requests": 2, "long_prompt": 512,
              "long_first_arrival_s": 0.3, "long_interval_s": 0.4, "chunk_tokens": 128},
    # a short executed_bubbles run (schedules run as training steps vs simulated); schedules = [] skips it
    "executed": {"schedules": ["zb1p", "dualpipe"], "ranks": 2, "microbatches": 4, "layers": 2, "rows": 2,
                 "seq_len": 16, "repeats": 3, "op_repeats": 2},
}
CONFIG = schema.from_defaults("quickstart", DEFAULTS)


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


def _merged(cfg: dict) -> dict:
    """The config's tables over DEFAULTS, the workload multiplied by ``scale``."""
    out = with_defaults(cfg, DEFAULTS, "quickstart")
    w = out["workload"]
    for k in ("batch", "prompt_len", "max_new_tokens"):
        if w[k] <= 0:
            raise ValueError(f"workload.{k}: must be >= 1, got {w[k]!r}")
        w[k] *= cfg.get("scale", 1)
    _model_cfg(out["model"])                     # dtype names checked before any compute
    return out


PRECISION = ("param_dtype", "compute_dtype", "cache_dtype")


def _model_cfg(model: dict):
    """The preset with the config's precision (ValueError naming the bad key)."""
    base = pdjax.configs.preset(model["preset"])
    for key in PRECISION:
        try:
            base = base.replace(**{key: model[key]})
        except ValueError as e:
            raise ValueError(f"model.{key}: {e}") from None
    return base


def check_config(cfg: dict) -> None:
    """Value checks the types cannot express (ValueError naming the key)."""
    _merged(cfg)


def model_section(cfg: dict, out_dir: str) -> Section:
    c = _merged(cfg)
    mcfg = _model_cfg(c["model"])
    w = c["workload"]
    B, T, N = w["batch"], w["prompt_len"], w["max_new_tokens"]
    params = pdjax.init_params(mcfg, jax.random.key(c["model"]["seed"]))
    prompts = np.random.RandomState(w["seed"]).randint(0, mcfg.vocab_size, (B, T)).astype(np.int32)
    max_len = T + N

    def prefill():
        logits, cache = pdjax.prefill(params, mcfg, prompts, max_len=max_len)
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
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, cache = prefill()
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    new_tokens, cache = decode(logits, cache)
    t_decode = time.perf_counter() - t0
    reference = pdjax.generate(params, mcfg, prompts, max_new_tokens=N)
    agree = bool(np.array_equal(reference[:, T:], new_tokens))

    L, H = mcfg.num_hidden_layers, mcfg.num_attention_heads
    itemsize = cache.dtype.itemsize
    mla_bytes = cache.nbytes_per_token()          # measured from the real cache buffers
    mha_bytes = analysis.kv_bytes_per_token(mcfg, itemsize, "mha")
    data = {
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "model": c["model"]["preset"],
        "layers": L,
        "batch": B,
        "prompt_len": T,
        "new_tokens": N,
        "generate_agrees": agree,
        "kv_bytes_per_token_mla": mla_bytes,
        "kv_bytes_per_token_mha": mha_bytes,
        "kv_ratio_mha_over_mla": round(mha_bytes / mla_bytes, 2),
        "first_tokens_row0": [int(t) for t in new_tokens[0, :8]],
        "precision": {k: getattr(mcfg, k) for k in ("param_dtype", "compute_dtype", "kv_cache_dtype")},
    }
    timed = {
        "compile_s": round(compile_s, 2),
        "prefill_tok_s": round(B * T / t_prefill, 1),
        "decode_tok_s": round(B * (N - 1) / t_decode, 1),
        "decode_step_ms": round(1e3 * t_decode / max(N - 1, 1), 2),
    }
    md = [
        "## Model: prefill and decode",
        f"{c['model']['preset']} model ({L} layers, {mcfg.n_routed_experts} experts top-"
        f"{mcfg.num_experts_per_tok}) on {data['backend']} x{data['devices']}; batch {B}, "
        f"prompt {T}, {N} new tokens (greedy).",
        "",
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
                f"{mcfg.param_dtype} / {mcfg.compute_dtype} / {mcfg.kv_cache_dtype}",
        }),
        "",
        "First tokens of row 0: prompt " + " ".join(map(str, prompts[0, :8])) + " ... -> "
        + " ".join(map(str, new_tokens[0, :8])),
    ]
    return Section("\n".join(md), data, timed)


def pipeline_section(cfg: dict, out_dir: str) -> Section:
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


def analysis_section(cfg: dict, out_dir: str) -> Section:
    """Roofline and KV accounting of a published config on a hardware preset."""
    a = _merged(cfg)["analysis"]
    mcfg = pdjax.configs.preset(a["preset"])
    md = analysis.quickstart_section(mcfg, a["hardware"], context_len=a["context_len"],
                                     weight_dtype_bytes=a["weight_dtype_bytes"], ep_size=a["ep_size"],
                                     compute_dtype=a["compute_dtype"])
    data = {"kv_bytes_per_token_mla": analysis.kv_bytes_per_token(mcfg, 2, "mla"),
            "kv_bytes_per_token_mha": analysis.kv_bytes_per_token(mcfg, 2, "mha"),
            "machine_balance_bf16": analysis.machine_balance(a["hardware"], "bf16")}
    return Section("## Analysis\n" + md, data)


def pd_section(cfg: dict, out_dir: str) -> Section:
    """The quick start's prompts through a real PD-disaggregated engine: prefill on devices
    0-3 (EP4), decode on 4-7 (DP2 x EP2, paged cache), latent KV handed off layer by layer."""
    import jax
    from pdjax.disagg import PDEngine

    c = _merged(cfg)
    if jax.device_count() < 8:
        return Section("## PD disaggregation\nskipped: needs 8 devices (`pdjax run` provides them)")
    mcfg = _model_cfg(c["model"])
    params = pdjax.init_params(mcfg, jax.random.key(c["model"]["seed"]))
    w = c["workload"]
    rng = np.random.RandomState(w["seed"])
    prompts = [rng.randint(0, mcfg.vocab_size, n).tolist() for n in (3, w["prompt_len"], 2 * w["prompt_len"], 9)]
    N = w["max_new_tokens"]
    eng = PDEngine(params, mcfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:8],
                   prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2}, max_decode_slots=4,
                   max_context=2 * w["prompt_len"] + N)
    t0 = time.perf_counter()
    eng.generate(prompts, max_new_tokens=N)                  # first call compiles
    compile_s = time.perf_counter() - t0
    out = eng.generate(prompts, max_new_tokens=N)
    want = pdjax.generate(params, mcfg, prompts, max_new_tokens=N)
    same = [p + o for p, o in zip(prompts, out)] == want
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
    md += _stall(c, cfg.get("scale", 1), out_dir, data, timed)
    return Section("\n".join(md), data, timed)


def _stall(c: dict, scale: int, out_dir: str, data: dict, timed: dict) -> list[str]:
    """The pd_vs_colocated experiment, shortened: its headline and plot in the report."""
    from pdjax.experiments.pd_vs_colocated import run_pd_vs_colocated
    st = c["stall"]
    if not st["long_requests"]:
        return ["Long prefills landing during decode: `pdjax run experiments/pd_vs_colocated.toml`."]
    sub = os.path.join(out_dir, "pd_vs_colocated")
    workload = {k: v for k, v in st.items() if k != "chunk_tokens"}
    model = {k: c["model"][k] for k in ("preset", "seed")}      # its own experiment: default precision
    res = run_pd_vs_colocated({"model": model, "workload": workload, "scale": scale,
                               "engine": {"chunk_tokens": st["chunk_tokens"],
                                          "max_context": st["long_prompt"] + 64}}, sub)
    results.write(res, sub)
    data["stall"] = res.metrics
    timed["stall"] = res.wall_clock
    return ["### Long prefills landing during decode", "", res.headline + ".", "",
            "![ITL over time](pd_vs_colocated/itl_over_time.png)", "",
            "Full run: `pdjax run experiments/pd_vs_colocated.toml`; this part: "
            "[pd_vs_colocated/report.md](pd_vs_colocated/report.md)."]


def executed_pipeline_section(cfg: dict, out_dir: str) -> Section:
    """The executed_bubbles experiment, shortened: schedules run as training steps of a
    2-layer model of the quick start's preset, measured vs simulated with isolated op times."""
    from pdjax.experiments import executed_result
    from pdjax.pipeline.executed import markdown_table

    c = _merged(cfg)
    e = c["executed"]
    full = "Full run: `pdjax run experiments/executed_bubbles.toml`."
    if not e["schedules"]:
        return Section("## Executed pipeline\nskipped ([executed] schedules = []). " + full)
    if jax.device_count() < e["ranks"]:
        return Section(f"## Executed pipeline\nskipped: needs {e['ranks']} devices (`pdjax run` provides them)")
    sub = os.path.join(out_dir, "executed_pipeline")
    res = executed_result.run({
        "run": {k: e[k] for k in ("schedules", "ranks", "microbatches", "repeats", "op_repeats")},
        "model": {"preset": c["model"]["preset"], "layers": e["layers"], "seed": c["model"]["seed"]},
        "batch": {"rows": e["rows"], "seq_len": e["seq_len"]}, "scale": cfg.get("scale", 1)}, sub)
    results.write(res, sub)
    last = e["schedules"][-1]
    about = (f"{', '.join(e['schedules'])} run as real training steps of a {e['layers']}-layer "
             f"{c['model']['preset']} model on {e['ranks']} devices (one per rank), {e['microbatches']} micro-batches "
             f"of {e['rows']} x {e['seq_len']} tokens: the executor's measured timeline against `simulate()` fed "
             "with every op's time measured in isolation (the simulated devices share the host's cores, so the measured "
             "run is usually slower than the isolated op times predict).")
    md = ["## Executed pipeline", about, "", markdown_table(res["row_objects"]),
          f"{last}, measured (top) vs simulated (bottom): ![{last}](executed_pipeline/{last}.png)", "",
          f"{full} This part: [executed_pipeline/report.md](executed_pipeline/report.md)."]
    return Section("\n".join(md), res.metrics, {"headline": res.headline})


def afd_section(cfg: dict, out_dir: str) -> Section:
    """The AF-disaggregation M:N sweep, simulated (the afd_ratio experiment's defaults:
    DeepSeek-V3 fp8, attention on H200, FFN on H800, against colocated H800s): per context,
    the throughput per accelerator against the colocated baseline at each ratio."""
    from pdjax.experiments import afd_ratio
    d = afd_ratio.DEFAULTS
    rows, notes = afd_ratio.sim_rows(pdjax.configs.preset(d["model"]["preset"]), d["hardware"], d["sweep"])
    table = [{"context": r["context"], "M:N": r["label"], "batch gain": r["batch_gain"],
              "step-time gain": r["step_time_gain"], "speedup": r["speedup"]} for r in rows]
    wins = {ctx: [r["M:N"] for r in table if r["context"] == ctx and r["speedup"] > 1]
            for ctx in dict.fromkeys(r["context"] for r in table)}
    md = ["## AF disaggregation (simulated M:N sweep)",
          f"{d['model']['preset']} {d['hardware']['dtype']}, attention on {d['hardware']['attention']}, FFN on "
          f"{d['hardware']['ffn']} ({d['sweep']['ffn']} of them), m = {d['sweep']['microbatches']}, against "
          f"{d['hardware']['baseline_ep']} x {d['hardware']['baseline']} colocated; speedup = throughput per "
          "accelerator / the baseline's. AFD wins at: "
          + "; ".join(f"{ctx} tokens {', '.join(w) or 'no ratio'}" for ctx, w in wins.items()) + ".", "",
          results.markdown_table(table), *(["", "; ".join(notes)] if notes else []), "",
          "The full sweep with a measured AFDEngine run: `pdjax run experiments/afd_ratio.toml`."]
    return Section("\n".join(md), {"rows": table, "wins": {str(k): v for k, v in wins.items()}})


SECTIONS = [model_section, analysis_section, pipeline_section, executed_pipeline_section, pd_section, afd_section]


def run_quickstart(cfg: dict, out_dir: str) -> Result:
    """Every section of :data:`SECTIONS` into one Result; metrics and wall_clock are keyed by
    section (``model``, ``analysis``, ``pipeline``, ``executed_pipeline``, ``pd``, ``afd``)."""
    parts, metrics, wall_clock, figures = [], {}, {}, {}
    for section in progress.track(SECTIONS, "quickstart: sections"):
        s = section(cfg, out_dir)
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
