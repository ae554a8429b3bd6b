"""The serving simulator held against the engines it models.

One Poisson trace (arrival, prompt length, output length) is served by a real engine
(:class:`pdjax.disagg.ColocatedEngine` or :class:`pdjax.disagg.PDEngine`, ``generate`` with
``arrival_times``) and replayed through :mod:`pdjax.sim` with the same deployment (decode
slots, prefill chunking, prefill workers, link bandwidth) and the engine's own measured costs:

* prefill: ``engine.calibrate_prefill`` on the padding buckets the trace's prompts run in
  (cost(q, c) = a q^2 + b q c + g q + d), evaluated at the bucket a chunk is padded to;
* decode: closed batches of B requests of L-token prompts served by the same engine
  (:func:`calibrate_decode_loop`); each decode-loop iteration after the last prefill is an
  observation (B, K cached tokens, joined, left, seconds), fitted to t(B, K) = d0 + d1 B +
  d2 K + dj joined + dl left. Timing the engine's loop, not ``DecodePool.step`` alone, keeps
  the scheduler's per-step work in the cost.

All three go through the one calibration path,
:func:`pdjax.analysis.costmodel_calibrate.calibrate_cost`; each supplies what times a sample.

The simulated colocated instance alternates steps (a step is one request's prefill chunk or
a decode step, turns taken when both wait: the engine's FIFO pool lock); the PD deployment
prefills one request per call. Every cost is measured when the function runs: nothing here
holds a time. :func:`compare` returns measured vs predicted TTFT and inter-token latency
(ITL) percentiles per engine (``benchmarks/sim_vs_engine.py`` prints them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from pdjax import sim
from pdjax.analysis.costmodel_fit import DecodeCostFit

PROMPT_LENS = (24, 48, 96, 160, 320)     # a mix over five padding buckets (32 .. 512)
OUTPUT_LENS = (8, 48)                    # uniform, inclusive
METRICS = ("ttft", "itl")
PCTS = (50, 90)


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    """The engines' shared deployment on the CPU devices: ``slots`` decode slots,
    ``max_context`` tokens per request, ``block_size`` of the paged cache, prefill chunks of
    ``chunk_tokens`` (None: whole prompts), ``devices`` per pool (the colocated engine uses
    one pool of that many; PD a prefill pool and a decode pool of that many each)."""

    slots: int = 8
    max_context: int = 512
    block_size: int = 16
    chunk_tokens: int | None = None
    devices: int = 4


def make_trace(num_requests: int, rate: float, seed: int = 0, prompt_lens: Sequence[int] = PROMPT_LENS,
               output_lens: tuple[int, int] = OUTPUT_LENS) -> list:
    """A Poisson trace of ``num_requests`` at ``rate`` req/s: prompt lengths drawn uniformly
    from ``prompt_lens`` (a finite set, so every shape the engine compiles can be warmed up),
    output lengths uniform in ``output_lens`` (inclusive). Returns :class:`pdjax.sim.SimRequest`
    rows sorted by arrival, the first at t = 0."""
    reqs = sim.sample_requests(sim.WorkloadSpec(num_requests=num_requests, rate=rate, seed=seed,
                                         input={"kind": "list", "values": tuple(prompt_lens)},
                                         output={"kind": "uniform", "low": output_lens[0],
                                                 "high": output_lens[1]}))
    t0 = reqs[0].arrival
    return [sim.SimRequest(r.rid, r.arrival - t0, r.input_len, r.output_len) for r in reqs]


def prompts_for(lengths: Sequence[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Random token prompts of the given lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, int(n)).tolist() for n in lengths]


def build_engine(kind: str, params, cfg, setup: EngineSetup = EngineSetup(), devices=None):
    """A ``"colocated"`` or ``"pd"`` engine of ``setup`` on ``devices`` (default jax.devices())."""
    import jax

    from pdjax.disagg import ColocatedEngine, PDEngine
    devs = list(devices if devices is not None else jax.devices())
    n = setup.devices
    kw = dict(block_size=setup.block_size, max_decode_slots=setup.slots, max_context=setup.max_context,
              prefill_chunk_tokens=setup.chunk_tokens)
    if kind == "colocated":
        return ColocatedEngine(params, cfg, devices=devs[:n], mesh={"expert": n}, **kw)
    if kind == "pd":
        if len(devs) < 2 * n:
            raise ValueError(f"a PD engine of {n} + {n} devices needs {2 * n} devices, got {len(devs)}")
        return PDEngine(params, cfg, prefill_devices=devs[:n], decode_devices=devs[n:2 * n],
                        prefill_mesh={"expert": n}, decode_mesh={"expert": n}, **kw)
    raise ValueError(f"engine kind must be 'colocated' or 'pd', got {kind!r}")


def warm_up(engine, prompt_lens: Sequence[int], seed: int = 0) -> None:
    """Compile every shape the trace will use: for each prompt length, one request per decode
    rank at once (the KV write into a rank's blocks compiles per prompt length and device),
    and the decode step for every KV-length bucket it gathers (``DecodePool.warm_up``)."""
    engine.decode.warm_up(sampling=(False,))                 # the trace is greedy
    ranks = min(engine.decode.ranks, engine.decode.slots)
    for n in sorted(set(prompt_lens)):
        engine.generate(prompts_for([n] * ranks, engine.cfg.vocab_size, seed + n), max_new_tokens=3)


# ---- decode calibration -------------------------------------------------------------------

def decode_samples(requests: Sequence[dict]) -> list[tuple[int, int, int, int, float]]:
    """(B, K, joined, left, seconds) of every decode-loop iteration after the last prefill of
    an engine run, from its per-request metrics (``engine.stats["requests"]``:
    ``prompt_tokens``, ``token_times``).

    A decode step stamps the same time on the token of every request in it; an iteration
    runs from one step's end to the next's. B = requests in the step, K = their cached
    tokens before it (prompt + tokens fed so far), joined = requests new in it (the loop
    admitted them in the iteration), left = requests of the step before that are not in it
    (the loop freed their blocks). Iterations that began before the last first token are
    skipped (a prefill was running)."""
    steps: dict[float, dict] = {}
    last_first = -math.inf
    for r in requests:
        t = r["token_times"]
        if not t:
            continue
        last_first = max(last_first, t[0])
        for j, tj in enumerate(t[1:], start=1):     # token j: its step read prompt + j - 1 tokens
            steps.setdefault(tj, {})[r["index"]] = r["prompt_tokens"] + j - 1
    ends = sorted(steps)
    out = []
    for a, b in zip(ends, ends[1:]):
        if a <= last_first:
            continue
        before, now = steps[a], steps[b]
        out.append((len(now), sum(now.values()), len(now.keys() - before.keys()), len(before.keys() - now.keys()),
                    b - a))
    return out


@dataclasses.dataclass(frozen=True)
class DecodeCalibration:
    """The engine's decode loop measured: ``fit`` (t = d0 + d1 B + d2 K + dj joined +
    dl left), the ``samples`` it was fitted to (per (B, joined, left) of a batch: mean K,
    median seconds), every ``iteration`` (B, K, joined, left, seconds) and the calibration
    ``result`` (its ``table()``, errors)."""

    fit: DecodeCostFit
    samples: tuple
    iterations: tuple
    result: object = None

    @property
    def jitter(self) -> list[float]:
        """Measured over fitted seconds of each plain iteration (nobody joined or left): the
        spread of the platform's decode steps, for ``pdjax.sim.simulate_serving(decode_jitter=...)``."""
        return [sec / float(self.fit(b, k)) for b, k, jn, lv, sec in self.iterations if not jn and not lv]


def calibrate_decode_loop(engine, prompt_lens: Sequence[int], batches: Sequence[int] = (1, 2, 4, 8),
                     new_tokens: int = 32, repeats: int = 1, seed: int = 0) -> DecodeCalibration:
    """Fit the engine's decode-loop iteration t = d0 + d1 B + d2 K + dj joined + dl left
    (:func:`pdjax.analysis.costmodel_calibrate.calibrate_cost` with the handoff terms) from
    closed batches of B requests of each prompt length (all arriving at once, ``new_tokens``
    each), served by the engine itself. A batch's iterations (:func:`decode_samples`) of one
    (B, joined, left) observe one sample (their mean K); its seconds are their median."""
    import jax

    from pdjax.analysis.costmodel_calibrate import FitSpec, calibrate_cost
    iterations: list = []

    def measure(shape):                   # one closed batch: its iterations, by sample
        L, B = shape
        engine.generate(prompts_for([L] * B, engine.cfg.vocab_size, seed + 31 * L + B), max_new_tokens=new_tokens)
        groups: dict[tuple, list] = {}
        for b, k, jn, lv, sec in decode_samples(engine.stats["requests"]):
            groups.setdefault((b, jn, lv), []).append((k, sec))
            iterations.append((b, k, jn, lv, sec))
        return {(b, float(np.mean([k for k, _ in ks])), jn, lv): [sec for _, sec in ks]
                for (b, jn, lv), ks in groups.items()}
    shapes = [(L, min(B, engine.decode.slots)) for L in prompt_lens for B in batches]
    res = calibrate_cost(measure, shapes, repeats, fit=FitSpec("decode", handoff=True), seed=seed,
                         backend=jax.default_backend())
    return DecodeCalibration(res.fit, res.samples, tuple(iterations), res)


# ---- prefill as served ----------------------------------------------------------------------

def loop_delay_steps(engine) -> float:
    """Decode steps of delay the simulated decode loop adds to a lone request's TTFT while
    others decode (``decode_loop``, see :class:`pdjax.sim.Colocated`): colocated, half the
    step in flight, the loop's own next step and the step the prefill's compute finishes
    under (2.5); PD, half the step in flight (0.5)."""
    return 2.5 if engine.colocated else 0.5


@dataclasses.dataclass(frozen=True)
class ServedPrefill:
    """The prefill measured as served while others decode: ``fit`` (cost(q, c)) to the
    ``samples`` (bucket, 0, seconds); ``prefill_factor``: the median of served / isolated
    cost over the buckets; ``decode_factor``: how much slower the background's decode
    iterations ran with a probe's prefill in flight than without (medians, see
    :func:`decode_contention`). Both >= 1: PD's ``contention`` on one host."""

    fit: object
    samples: tuple
    prefill_factor: float
    decode_factor: float


def calibrate_served_prefill(engine, prompt_lens: Sequence[int], decode_fit, background: int = 2,
                             probes: int = 6, seed: int = 0) -> ServedPrefill:
    """The prefill as the engine serves it while others decode: ``background`` requests
    decode while ``probes`` one-token requests of each prompt length arrive one at a time
    (spaced well apart, at random phases of the decode steps). A probe's prefill cost is its
    TTFT less the decode loop's delay as the simulator models it
    (:func:`loop_delay_steps` x the background's decode step; at least 1 us); the medians
    per padding bucket are fitted to cost(q, c) = a q^2 + b q c + g q + d
    (:func:`pdjax.analysis.costmodel_calibrate.calibrate_cost`), and compared with the
    engine's isolated ``prefill_cost``."""
    from pdjax.analysis.costmodel_calibrate import FitSpec, calibrate_cost
    from pdjax.disagg.prefill import bucket
    rng = np.random.default_rng(seed)
    bg_len = min(prompt_lens)
    step = float(decode_fit(background, background * bg_len))
    busy, idle = [], []

    def measure(L):                       # one served run: the probes of length L
        q = bucket(L, engine.prefill.size)
        gap = 3 * float(engine.prefill_cost(q, 0)) + 10 * step
        arrivals = [0.0] * background + [5 * step + i * gap + float(rng.uniform(0, step)) for i in range(probes)]
        tokens = min(int((arrivals[-1] + gap) / step) + 8, engine.max_context - bg_len)
        prompts = prompts_for([bg_len] * background + [L] * probes, engine.cfg.vocab_size, seed + L)
        engine.generate(prompts, max_new_tokens=[tokens] * background + [1] * probes, arrival_times=arrivals)
        dc = decode_contention(engine.stats, decode_fit)
        busy.append(dc["prefill"])
        idle.append(dc["no_prefill"])
        delay = loop_delay_steps(engine) * step
        return {(q, 0): [max(r["ttft"] - delay, 1e-6) for r in engine.stats["requests"][background:]]}
    lens = sorted(set(prompt_lens))
    res = calibrate_cost(measure, (lens * 4)[:max(4, len(lens))], 1, fit=FitSpec("prefill", intercept=True),
                         seed=seed)           # the fit needs four samples: repeat, never serve more
    samples = res.samples[:len(lens)]
    ratio = float(np.median([t / float(engine.prefill_cost(q, c)) for q, c, t in samples]))
    d = float(np.nanmedian(busy) / np.nanmedian(idle)) if not np.all(np.isnan(busy)) else 1.0
    return ServedPrefill(res.fit, samples, max(1.0, ratio), max(1.0, d))


# ---- the simulated twin -----------------------------------------------------------------------

def kv_bytes_per_token(engine) -> int:
    """Latent KV bytes per token over all layers, as the engine's handoff moves them."""
    import jax.numpy as jnp
    cfg = engine.cfg
    return cfg.kv_latent_dim * cfg.num_hidden_layers * jnp.dtype(engine.prefill.params["embed"].dtype).itemsize


def engine_cost(engine, decode_fit: DecodeCostFit, prefill=None) -> sim.FittedStepCost:
    """The engine's cost model for the simulator: a prefill cost (default the engine's
    calibrated ``prefill_cost``) at the padding bucket a chunk runs in, its fitted decode
    iteration, its KV bytes per token."""
    from pdjax.disagg.prefill import bucket
    size = engine.prefill.size
    return sim.FittedStepCost(prefill=prefill or engine.prefill_cost, decode=decode_fit,
                              kv_bytes=kv_bytes_per_token(engine), num_layers=engine.cfg.num_hidden_layers,
                              prefill_rows=lambda q: bucket(q, size))


def engine_deployment(engine, contention=None):
    """The simulated deployment of ``engine``: its decode slots (a request holds one from
    its reservation to its end), its chunking, one request per prefill call; colocated:
    alternating steps on one instance; PD: one prefill instance with a rank per prefill
    worker, one decode instance, the engine's measured link bandwidth, layer-wise, and
    ``contention`` (prefill, decode factors: the pools share the host) when given."""
    budget = engine.prefill_chunk_tokens or engine.max_context
    if engine.prefill_budget_s is not None:
        raise ValueError("time-budget chunking (prefill_budget_s) is not modelled here; use prefill_chunk_tokens")
    if engine.colocated:
        return sim.Colocated(1, token_budget=budget, max_batch=engine.decode.slots, step_policy="alternate",
                             prefill_max_requests=1, decode_loop=True)
    return sim.PDDisaggregated(1, 1, link_bw=engine.link_bandwidth_Bps, token_budget=budget,
                               dp_ranks=len(engine.prefills), max_batch=engine.decode.slots,
                               num_layers=engine.cfg.num_hidden_layers, prefill_max_requests=1, decode_loop=True,
                               contention=contention)


# ---- measured vs predicted ----------------------------------------------------------------------

def serve(engine, trace: Sequence, seed: int = 0) -> dict:
    """Serve ``trace`` on the engine at its arrival times; returns ``engine.stats``."""
    prompts = prompts_for([r.input_len for r in trace], engine.cfg.vocab_size, seed)
    engine.generate(prompts, max_new_tokens=[r.output_len for r in trace],
                    arrival_times=[r.arrival for r in trace])
    return engine.stats


def measured_latencies(stats: dict) -> dict:
    """{"ttft": [...], "itl": [...]} seconds from an engine run's per-request metrics."""
    reqs = [r for r in stats["requests"] if r["error"] is None]
    return {"ttft": [r["ttft"] for r in reqs], "itl": [x for r in reqs for x in r["itl"]]}


def percentile_rows(engine_name: str, measured: dict, predicted: dict) -> list[dict]:
    """Rows {engine, metric, pct, measured_s, <name>_s, <name>_err ...} for TTFT and ITL at
    P50 / P90; ``predicted``: {name: simulator summary}; error = predicted / measured - 1."""
    rows = []
    for metric in METRICS:
        m = sim.metrics.percentiles(measured[metric], pcts=PCTS)
        for p in PCTS:
            meas = m[f"p{p}"]
            row = {"engine": engine_name, "metric": metric, "pct": f"p{p}", "measured_s": meas}
            for name, summary in predicted.items():
                pred = summary[f"{metric}_p{p}"]
                row[f"{name}_s"] = pred
                row[f"{name}_err"] = pred / meas - 1 if meas > 0 else math.nan
            rows.append(row)
    return rows


def decode_contention(stats: dict, decode_fit: DecodeCostFit) -> dict:
    """How much slower than fitted the served decode iterations ran, with and without a
    prefill in flight: the median of measured / fitted seconds over the iterations in which
    no request joined or left, split by whether some request was between its arrival and
    its first token (queued for or in its prefill). Returns {"prefill": ratio, "no_prefill":
    ratio, "n_prefill": count, "n_no_prefill": count} (NaN when a class is empty). PD on one
    host: the two pools share the cores, so the first ratio exceeds the second."""
    reqs = [r for r in stats["requests"] if r["error"] is None and r["token_times"]]
    waits = sorted((r["token_times"][0] - r["ttft"], r["token_times"][0]) for r in reqs)
    steps: dict[float, dict] = {}
    for r in reqs:
        for j, t in enumerate(r["token_times"][1:], start=1):
            steps.setdefault(t, {})[r["index"]] = r["prompt_tokens"] + j - 1
    ends = sorted(steps)
    split: dict[bool, list] = {True: [], False: []}
    for a, b in zip(ends, ends[1:]):
        if steps[a].keys() != steps[b].keys():
            continue
        busy = any(lo < b and hi > a for lo, hi in waits)
        split[busy].append((b - a) / float(decode_fit(len(steps[b]), sum(steps[b].values()))))
    med = {k: float(np.median(v)) if v else math.nan for k, v in split.items()}
    return {"prefill": med[True], "no_prefill": med[False], "n_prefill": len(split[True]),
            "n_no_prefill": len(split[False])}


@dataclasses.dataclass
class Comparison:
    """One engine's run: the ``rows`` (see :func:`percentile_rows`), per prediction (see
    :data:`PREDICTIONS`) its simulation and cost model, the calibrations (``decode``, the
    ``served`` prefill) and the engine's stats."""

    rows: list
    sims: dict
    costs: dict
    decode: DecodeCalibration
    served: ServedPrefill
    stats: dict


#: The simulator's predictions. "model": every measured effect: the prefill as served beside
#: decode steps, the decode steps' measured spread and, PD, decode steps beside a prefill
#: slowed by the measured factor (the pools share the host). "no_jitter": the same with
#: deterministic steps. "isolated": the engine's own calibrate_prefill and the decode fit.
PREDICTIONS = ("model", "no_jitter", "isolated")


def compare_engine(kind: str, params, cfg, trace: Sequence, *, setup: EngineSetup = EngineSetup(),
                   seed: int = 0, decode_batches: Sequence[int] = (1, 2, 4, 8), decode_tokens: int = 32,
                   prefill_repeats: int = 3, probes: int = 6, devices=None) -> Comparison:
    """Build a ``kind`` engine, warm it up on the trace's prompt lengths, measure its costs
    (prefill isolated and as served, decode loop), serve ``trace`` and simulate it
    (:data:`PREDICTIONS`); returns a :class:`Comparison`."""
    from pdjax.disagg.prefill import bucket
    engine = build_engine(kind, params, cfg, setup, devices)
    lens = sorted({r.input_len for r in trace})
    warm_up(engine, lens, seed)
    if setup.chunk_tokens is None:
        shapes = sorted({(bucket(n, engine.prefill.size), 0) for n in lens})
    else:                              # chunks of chunk_tokens (or the tail) over a cached prefix
        shapes = sorted({(bucket(q, engine.prefill.size), c) for n in lens for c in range(0, n, setup.chunk_tokens)
                         for q in [min(setup.chunk_tokens, n - c)]})
    shapes = (shapes * 4)[:max(4, len(shapes))]   # the fit needs four samples: repeat, never compile more
    engine.calibrate_prefill(shapes=shapes, repeats=prefill_repeats, intercept=True)
    dec = calibrate_decode_loop(engine, (lens[0], lens[-1]), decode_batches, decode_tokens, seed=seed)
    served = calibrate_served_prefill(engine, lens, dec.fit, probes=probes, seed=seed)
    stats = serve(engine, trace, seed)
    isolated, model = engine_cost(engine, dec.fit), engine_cost(engine, dec.fit, served.fit)
    # PD: the served prefill already ran beside decode steps; decode steps beside a prefill
    # take the measured factor (a factor on the prefill too, applied when a decode step is in
    # flight at its start, feeds back: decode steps are in flight most of the time)
    dep = engine_deployment(engine, None if engine.colocated else (1.0, served.decode_factor))
    runs = {"model": (dep, model, dec.jitter), "no_jitter": (dep, model, None),
            "isolated": (engine_deployment(engine), isolated, None)}
    sims = {name: sim.simulate_serving(d, cost, trace, decode_jitter=jit, jitter_seed=seed) for name, (d, cost, jit) in runs.items()}
    rows = percentile_rows(kind, measured_latencies(stats), {k: r.summary for k, r in sims.items()})
    return Comparison(rows, sims, {name: cost for name, (_, cost, _) in runs.items()}, dec, served, stats)


def compare(params, cfg, trace: Sequence, kinds: Sequence[str] = ("colocated", "pd"), **kwargs) -> list[Comparison]:
    """:func:`compare_engine` for each engine kind on the same trace."""
    return [compare_engine(k, params, cfg, trace, **kwargs) for k in kinds]
