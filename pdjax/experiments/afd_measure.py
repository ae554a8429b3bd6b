"""Measured AF-disaggregated decode against its predictions.

:func:`measure_afd` serves the same requests on an :class:`~pdjax.disagg.AFDEngine` for each
micro-batch count m, records the stages on a :class:`~pdjax.disagg.device_spans.DeviceSpans`, and
returns one row per m: the measured per-stage times (medians per MoE layer per micro-batch,
:func:`stage_medians`), the measured decode step time (median inter-token latency once
every prefill is done, in a run of the same engine without the timeline: its watcher
threads slow the host), and what the models predict from those stage times:

* the overlap model of the simulator (:mod:`pdjax.sim.afd_step`): the AF ping-pong program
  on streams attention, a2f, ffn, f2a, scheduled by the one overlap model
  (:func:`pdjax.analysis.streams.schedule`), L times its steady-state layer cycle
  (:func:`pdjax.sim.afd_step.afd_scheduled_cycle`; = L * max(m T_a, m T_f, m T_c, T_a + T_f + 2 T_c)
  while the links are not the bottleneck), the attention and FFN sides running at the same
  time, as on GPUs;
* the issue-order model :func:`issue_order_step`: the same program with the attention and
  FFN programs on one device resource, which runs them one at a time in the order the host
  issues them, with the exchange's copies running beside it. That is how XLA:CPU runs the
  engine (docs/disagg.md), so it is the model a CPU measurement can be held against;
* the ping-pong bound m >= 2 (1 + T_c / T_f) (:func:`pdjax.analysis.afd_min_microbatches`),
  the dual-batch-overlap condition T_attn(ub2) >= T_ffn(ub1) + T_comm
  (:func:`pdjax.analysis.afd_bounds.dbo_hides_ffn`) and, with a colocated baseline measured on the
  attention devices alone, the speedup model (B_AFD/B_base)(T_base/T_AFD) M/(M+N)
  (:func:`pdjax.analysis.afd_speedup`; B_AFD = B_base: the same slots), measured with the
  step of a run without the timeline and predicted with the issue-order model's.

Stage times are :func:`pdjax.disagg.afd_engine.op_times` with the attention and FFN programs on
one resource (on XLA:CPU an FFN program waits for the attention programs issued before it;
that wait is not its own time). Each is an upper bound: the simulated devices share the
host's cores. Neither model counts the step's host work (scheduling, the micro-batch split,
sampling, the token fetch): that is in the error.
"""

from __future__ import annotations

import math
import re

import numpy as np

from pdjax.analysis import afd_min_microbatches, afd_speedup
from pdjax.analysis.afd_bounds import attention_share, dbo_hides_ffn
from pdjax.analysis.overlap import AFStages, af_program
from pdjax.analysis.streams import schedule
from pdjax.disagg.afd_engine import op_times
from pdjax.sim.afd_step import afd_scheduled_cycle

STREAMS = ("attention", "a2f", "ffn", "f2a")
#: XLA:CPU runs the attention mesh's and the FFN mesh's programs one at a time: one resource.
CPU_RESOURCES = {"attention": "mesh", "ffn": "mesh"}
_NAME = re.compile(r"step (\d+) layer (\w+) mb (\d+)")


def stage_medians(spans, skip_steps: int = 0, resource: dict | None = None) -> dict:
    """{stream: {layer: median seconds}} of every op (:func:`pdjax.disagg.afd_engine.op_times`) of
    the steps from ``skip_steps`` on, over those steps and the micro-batches; the attention
    of the last segment (after the last MoE layer: final norm and head) is layer "head".
    ``resource`` as ``op_times`` (default :data:`CPU_RESOURCES`)."""
    times: dict = {}
    for s, took in op_times(spans, CPU_RESOURCES if resource is None else resource):
        step, layer, _ = _NAME.fullmatch(s["name"]).groups()
        if int(step) >= skip_steps:
            key = layer if layer == "head" else int(layer)
            times.setdefault(s["stream"], {}).setdefault(key, []).append(took)
    return {st: {k: float(np.median(v)) for k, v in sorted(by.items(), key=lambda kv: str(kv[0]))}
            for st, by in times.items()}


def issue_order_step(stages: dict, microbatches: int) -> float:
    """Seconds of a decode step on a host that runs the attention and FFN programs one at a
    time in issue order (XLA:CPU) while the exchange's copies run beside them. ``stages``:
    {stream: {layer: seconds per micro-batch}} (:func:`stage_medians`). Per MoE layer the
    pool issues every micro-batch's attention and A2F, then every one's experts and F2A; a
    program starts when the one before it has finished and its input has arrived: the AF
    program (:func:`pdjax.analysis.overlap.af_program`) with both sides on one resource,
    scheduled by :func:`pdjax.analysis.streams.schedule`. Each direction's copies run one at
    a time."""
    att = stages["attention"]
    layers = [AFStages(att[k], stages["a2f"][k], stages["ffn"][k], stages["f2a"][k])
              for k in sorted(k for k in att if k != "head")]
    spans = schedule(af_program(layers, microbatches, head=att.get("head", 0.0), one_device=True))
    return max((s.end_s for s in spans), default=0.0)


def predict_from_stages(stages: dict, microbatches: int, slots: int | None = None, num_attention: int | None = None,
                        num_ffn: int | None = None, row_bytes: float | None = None) -> dict:
    """The models' step times and the analysis conditions from measured ``stages``
    (:func:`stage_medians`, per layer per micro-batch) of an engine with ``microbatches``
    micro-batches. ``slots``, ``num_attention``, ``num_ffn`` and ``row_bytes`` describe the
    engine; the measured stage times already hold their effect, so nothing here uses them."""
    m, moe = microbatches, [k for k in stages["attention"] if k != "head"]
    mean = {st: float(np.mean([stages[st][k] for k in moe])) for st in STREAMS}
    t_a, t_f, t_c = mean["attention"], mean["ffn"], (mean["a2f"] + mean["f2a"]) / 2
    cycle = afd_scheduled_cycle(t_a, t_f, mean["a2f"], m, t_back=mean["f2a"])
    head = stages["attention"].get("head", 0.0)
    overlap = len(moe) * cycle + m * head
    min_m = afd_min_microbatches(t_c, t_f) if t_c <= t_f else math.inf
    return {"t_attn_ms": 1e3 * t_a, "t_ffn_ms": 1e3 * t_f, "t_comm_ms": 1e3 * t_c,
            "t_a2f_ms": 1e3 * mean["a2f"], "t_f2a_ms": 1e3 * mean["f2a"], "t_head_ms": 1e3 * head,
            "pingpong_min_m": min_m, "pingpong_hides": m >= min_m,
            "dbo_hides_ffn": dbo_hides_ffn(t_a, t_f, mean["a2f"] + mean["f2a"]),
            "exchange_hidden": cycle <= m * max(t_a, t_f) * (1 + 1e-9),
            "step_issue_order_ms": 1e3 * issue_order_step(stages, m), "step_overlap_ms": 1e3 * overlap}


def issue_window_s(spans, skip_steps: int = 0) -> float:
    """Median over the steps from ``skip_steps`` on of the host's time from a step's first
    issued op to its last: when it is near the step time, the host's dispatch, not the
    devices, sets the pace (neither model counts it)."""
    first: dict = {}
    last: dict = {}
    for s in spans:
        step = int(_NAME.fullmatch(s["name"]).group(1))
        if step >= skip_steps:
            first[step] = min(first.get(step, math.inf), s["issued"])
            last[step] = max(last.get(step, -math.inf), s["issued"])
    return float(np.median([last[k] - first[k] for k in first])) if first else math.nan


def decode_step_s(stats: dict, skip: int) -> float:
    """Median inter-token latency of a run's requests, leaving each request's first ``skip``
    out (while prefills still take turns with the decode steps)."""
    itl = [x for r in stats["requests"] for x in r["itl"][skip:]]
    if not itl:
        raise ValueError(f"no inter-token latency left after skipping {skip} per request: "
                         "generate more new tokens than there are requests")
    return float(np.median(itl))


def _timed(make, prompts, new_tokens: int, timeline: bool):
    """Build an engine, serve ``prompts`` once to compile every shape, then again timed, and
    (``timeline``) a third time recording a DeviceSpans. Returns (engine, the untraced run's stats)."""
    from pdjax.disagg.device_spans import DeviceSpans
    eng = make()
    eng.generate(prompts, max_new_tokens=new_tokens)
    eng.generate(prompts, max_new_tokens=new_tokens)
    untraced = eng.stats
    if timeline:
        eng.timeline = DeviceSpans()
        eng.generate(prompts, max_new_tokens=new_tokens)
    return eng, untraced


def measure_afd(params, cfg, *, attention: int = 4, ffn: int = 4, microbatches=(1, 2, 3), slots: int = 24,
                prompt_len: int = 16, new_tokens: int = 40, baseline: bool = True, block_size: int = 16,
                seed: int = 0, devices=None, progress=None) -> dict:
    """Serve ``slots`` prompts of ``prompt_len`` tokens for ``new_tokens`` tokens on an
    AFDEngine with ``attention`` + ``ffn`` devices for each m in ``microbatches`` (three
    times: the first run compiles, the third records the timeline). Returns {"rows": one dict
    per m (measured stages and step, the models' predictions and their errors against the
    step, see the module docstring; ``step_measured_ms`` is the run without the timeline,
    ``step_traced_ms`` the stages' run, slower by its watcher threads' host time),
    "baseline_step_ms": the colocated step on the attention devices with the same slots
    (``baseline``; else None)}. ``progress``: an optional ``track(items, what)`` wrapper."""
    import jax

    from pdjax.disagg import AFDEngine, ColocatedEngine
    if new_tokens < slots + 3:
        raise ValueError(f"new_tokens={new_tokens} must be at least slots + 3 = {slots + 3}: each request's "
                         f"first {slots} tokens share steps with the prefills and are left out")
    devs = list(devices or jax.devices())
    if len(devs) < attention + ffn:
        raise ValueError(f"{attention}:{ffn} needs {attention + ffn} devices, got {len(devs)}")
    rng = np.random.RandomState(seed)
    prompts = [rng.randint(0, cfg.vocab_size, prompt_len).tolist() for _ in range(slots)]
    skip = slots + 1                      # prefills take turns with decode steps until all are in
    opts = dict(block_size=block_size, max_context=prompt_len + new_tokens + 8, max_decode_slots=slots)
    track = progress or (lambda items, what: items)
    base_ms = None
    if baseline:
        mesh = {"expert": attention} if cfg.n_routed_experts % attention == 0 else {"data": attention}
        _, stats = _timed(lambda: ColocatedEngine(params, cfg, devices=devs[:attention], mesh=mesh, **opts),
                          prompts, new_tokens, timeline=False)
        base_ms = 1e3 * decode_step_s(stats, skip)
    rows = []
    for m in track(list(microbatches), "afd: engines (compile + serve)"):
        eng, untraced = _timed(lambda: AFDEngine(params, cfg, attention_devices=devs[:attention],
                                                 ffn_devices=devs[attention:attention + ffn], num_microbatches=m,
                                                 **opts), prompts, new_tokens, timeline=True)
        afd = eng.stats["afd"]
        stages = stage_medians(afd["timeline"], skip_steps=skip)
        row = {"M": attention, "N": ffn, "m": m, "slots": slots, "steps": afd["steps"],
               "step_measured_ms": 1e3 * decode_step_s(untraced, skip),
               "step_traced_ms": 1e3 * decode_step_s(eng.stats, skip),
               "host_issue_ms": 1e3 * issue_window_s(afd["timeline"], skip),
               **predict_from_stages(stages, m)}
        for name in ("issue_order", "overlap"):
            row[f"err_{name}_pct"] = 100 * (row[f"step_{name}_ms"] / row["step_measured_ms"] - 1)
        if base_ms is not None:
            share = attention_share(attention, ffn)
            row["speedup_measured"] = afd_speedup(1.0, base_ms / row["step_measured_ms"], share)
            row["speedup_predicted"] = afd_speedup(1.0, base_ms / row["step_issue_order_ms"], share)
        rows.append(row)
    return {"rows": rows, "baseline_step_ms": base_ms}
