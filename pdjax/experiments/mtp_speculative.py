"""Experiment: MTP speculative decoding, measured against the cost model's MTP term.

Measured (:func:`measure`): a byte-level model with one MTP depth, trained until its drafts
are mostly right (:mod:`pdjax.experiments.mtp_train`; cached params when the cache holds these
settings), decodes held-out prompts greedily with ``pdjax.generate``, plain and
``speculative="mtp"``, at each batch size: the accept rate, tokens per step, decode steps,
tokens/s and the end-to-end speed-up (the median over interleaved repeats of plain seconds
over MTP seconds). Each repeat also times both with one new token (the prefill alone, at the
same cache size), so the decode loops are timed apart: a plain step, a verify step, and the
loops' speed-up.

Simulated (:func:`simulate`): the cost model's MTP term fed the measured accept rate ``a``. A
plain decode step of B requests emits B tokens; a speculative step verifies two tokens per
request (the last token and the draft) and emits B (1 + a). With the decode-step cost
t(B, K) = d0 + d1 B + d2 K (B token rows, K cached tokens read;
:class:`~pdjax.analysis.costmodel_fit.DecodeCostFit`):

    plain step   t1 = t(B, B L)
    verify step  tv = t(2B, 2B L) + (t(2B, 2B L) - d0) / layers
    speed-up     (1 + a) t1 / tv

The verify step is a two-token step (each of 2B rows reading its request's L cached tokens)
plus the draft depth, one decoder layer more over the same rows (priced as 1/layers of the
step's per-row cost, as :mod:`pdjax.analysis.deploy` adds the MTP module to a decode step). L
is the cache the steps attend: pdjax's reference attention reads the whole buffer, prompt +
new tokens.

The fit is calibrated on this machine through the one calibration path
(:func:`pdjax.analysis.costmodel_calibrate.calibrate_cost`), at each batch B and 2B, at two
cache sizes (:func:`calibration_shapes`). ``simulate.calibration``: ``"loop"`` (default) times
the decode step as the device loop runs it (the plain greedy loop's seconds per step: the
seconds of ``generate`` with ``decode.new_tokens`` new tokens less those with one, over
new_tokens - 1; the min of ``inner`` alternating calls each, random prompts); ``"call"`` fits single
``pdjax.decode_step`` calls (:func:`pdjax.timing.calibrate_decode`), which each pay the host's
per-call work (about 1 ms on 2 CPU cores) that neither generate loop pays (they run on the
device), so its d0 swamps the per-row costs there. An engine's decode loop
(``sim_vs_engine.calibrate_decode_loop``) adds scheduler work ``generate`` does not do.

``scale`` multiplies the repeats (decode and calibration). Accept rates, tokens per step and
steps are reproducible (``metrics``); every time and speed-up is measured (``wall_clock``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from pdjax.experiments import mtp_train, progress
from pdjax.experiments.results import Result, markdown_table
from pdjax.experiments.schema import Header, knob, table

CALIBRATIONS = ("loop", "call")
SPEEDUP_COLUMNS = ("batch", "accept", "tok/step", "tok/s plain", "tok/s MTP", "speed-up", "loop speed-up",
                   "simulated", "measured / simulated")
STEP_COLUMNS = ("batch", "steps", "steps at 1 + accept", "step ms", "verify ms", "model step ms",
                "model verify ms", "mismatch", "near ties", "blank")


@dataclasses.dataclass(frozen=True)
class Train(mtp_train.Training):
    """:class:`~pdjax.experiments.mtp_train.Training`, and where the params are cached
    (``cache``: an ``.npz`` path, "" for none; ``retrain``: train even if it matches)."""

    cache: str = "runs/mtp_decode/params.npz"
    retrain: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.cache and not self.cache.endswith(".npz"):
            raise ValueError(f"cache: must be an .npz path (or \"\" for none), got {self.cache!r}")


@dataclasses.dataclass(frozen=True)
class Decode:
    batches: list[int] = knob([1, 8, 32], minimum=1, nonempty=True)
    prompt: int = knob(64, minimum=2)            # held-out bytes per prompt
    new_tokens: int = knob(64, minimum=2)
    repeats: int = knob(15, minimum=1)

    def __post_init__(self):
        if len(set(self.batches)) != len(self.batches):
            raise ValueError(f"batches: must be distinct, got {self.batches}")


@dataclasses.dataclass(frozen=True)
class Simulate:
    calibration: str = knob("loop", choices=CALIBRATIONS)
    inner: int = knob(3, minimum=1)              # "loop": alternating calls per sample (their min)
    repeats: int = knob(5, minimum=1)
    statistic: str = knob("median", choices=("median", "min"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Header):
    train: Train = table(Train)
    decode: Decode = table(Decode)
    simulate: Simulate = table(Simulate)

    def __post_init__(self):
        super().__post_init__()
        t, d = self.train, self.decode
        limit = mtp_train.model_config(t.width, t.layers).max_position_embeddings
        if d.prompt + d.new_tokens + 2 > limit:
            raise ValueError(f"decode.prompt: prompt ({d.prompt}) + new_tokens ({d.new_tokens}) + 2 exceeds the "
                             f"model's max_position_embeddings ({limit})")
        held = int(t.corpus_mb * 2**20 * t.holdout)
        if held <= d.prompt:
            raise ValueError(f"decode.prompt: {d.prompt} bytes must be fewer than the held-out bytes ({held})")

    def scaled(self) -> "Config":
        """The config with ``scale`` applied to the repeats."""
        s = self.scale
        return dataclasses.replace(self, scale=1, decode=dataclasses.replace(self.decode, repeats=self.decode.repeats * s),
                                   simulate=dataclasses.replace(self.simulate, repeats=self.simulate.repeats * s))


# ---- measured --------------------------------------------------------------------------

def timed(fn) -> tuple[object, float]:
    """(result, seconds) of ``fn()``; the results are numpy, so the call has finished."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def measure(params, cfg, prompts: np.ndarray, new: int, repeats: int) -> dict:
    """One row for the batch of ``prompts`` [B, T]: each repeat times plain and MTP greedy
    ``pdjax.generate`` of ``new`` tokens and of one token (the prefill, at the same cache
    size), back to back, after an untimed call of each (compiles). Speed-ups: the median of
    per-repeat ratios; ``loop speed-up``, ``step ms``, ``verify ms``: the decode loops alone
    (medians of the differences; None where noise makes one non-positive)."""
    import pdjax
    B, T = prompts.shape
    plain = lambda n: lambda: pdjax.generate(params, cfg, prompts, max_new_tokens=n, max_len=T + new)  # noqa: E731
    spec = lambda n: lambda: pdjax.generate(params, cfg, prompts, max_new_tokens=n, max_len=T + new + 2,  # noqa: E731
                                            speculative="mtp", return_stats=True)
    calls = (plain(new), spec(new), plain(1), spec(1))
    ref, (out, stats), _, _ = (f() for f in calls)
    times = np.array([[timed(f)[1] for f in calls] for _ in progress.track(range(repeats), f"batch {B}: repeats")])
    loop_plain, loop_spec = np.median(times[:, 0] - times[:, 2]), np.median(times[:, 1] - times[:, 3])
    positive = loop_plain > 0 and loop_spec > 0
    gen = ref[:, T:]
    return {"batch": B, "accept": stats["accept_rate"], "tok/step": stats["tokens_per_step"],
            "tok/s plain": B * new / float(np.median(times[:, 0])), "tok/s MTP": B * new / float(np.median(times[:, 1])),
            "speed-up": float(np.median(times[:, 0] / times[:, 1])),
            "loop speed-up": float(loop_plain / loop_spec) if positive else None,
            "steps": stats["steps"], "drafts": stats["drafts"],
            "step ms": 1e3 * float(loop_plain) / (new - 1) if positive else None,
            "verify ms": 1e3 * float(loop_spec) / stats["steps"] if positive else None,
            "mismatch": int(np.sum(np.any(ref != out, axis=1))), "near ties": stats["near_ties"],
            "blank": float(np.mean((gen == ord(" ")) | (gen == ord("\n"))))}


# ---- simulated -------------------------------------------------------------------------

def simulate(fit, accept: float, batch: int, kv_len: int, layers: int) -> dict:
    """The cost model's speed-up of MTP decoding at ``batch`` requests of ``kv_len`` cached
    tokens, draft accept rate ``accept``, for a model of ``layers`` decoder layers, with the
    decode-step cost ``fit`` (t(B, K), a :class:`~pdjax.analysis.costmodel_fit.DecodeCostFit`):
    {"step_s", "verify_s", "speedup"} (see the module docstring)."""
    K = batch * kv_len
    step = float(fit(batch, K))
    two = float(fit(2 * batch, 2 * K))
    verify = two + (two - fit.d0) / layers
    return {"step_s": step, "verify_s": verify, "speedup": (1 + accept) * step / verify}


def calibration_lens(d: Decode) -> tuple[int, int]:
    """The two cache sizes the fit is calibrated at: the measured runs' (prompt + new tokens)
    and a smaller one (prompt / 2 + new tokens), so that B and K vary independently (the
    "loop" calibration's prompts are these less the new tokens: at the larger size, the
    measured runs' own programs)."""
    return d.prompt // 2 + d.new_tokens, d.prompt + d.new_tokens


def calibration_shapes(batches, d: Decode) -> list[tuple[int, int]]:
    """(B, L) of the calibration: each batch B and 2B at the larger cache, the smallest and
    largest of them at the smaller cache too."""
    lo, hi = calibration_lens(d)
    Bs = sorted({b for B in batches for b in (B, 2 * B)})
    return [(B, hi) for B in Bs] + [(Bs[0], lo), (Bs[-1], lo)]


def _loop_timer(params, cfg, steps: int, inner: int, seed: int):
    """measure((B, L)) -> seconds per step of the plain greedy loop for B random prompts of
    L - ``steps`` tokens in a cache of L positions: (min seconds of ``steps`` new tokens -
    min seconds of one) / (``steps`` - 1), over ``inner`` alternating calls each (as many again,
    up to ten times, while load from other processes leaves the difference non-positive)."""
    import pdjax
    rng = np.random.default_rng(seed)
    prompts: dict = {}

    def measure(shape):
        B, L = shape
        p = prompts.setdefault(shape, rng.integers(0, cfg.vocab_size, (B, L - steps), dtype=np.int32))
        full, one = [], []
        for _ in range(10):
            for _ in range(inner):
                full.append(timed(lambda: pdjax.generate(params, cfg, p, max_new_tokens=steps, max_len=L))[1])
                one.append(timed(lambda: pdjax.generate(params, cfg, p, max_new_tokens=1, max_len=L))[1])
            if min(full) > min(one):
                break
        return (min(full) - min(one)) / (steps - 1)
    return measure


def calibrate(params, cfg, c: Config):
    """The decode-step fit of this machine (``simulate.calibration``; see the module
    docstring): a :class:`~pdjax.analysis.costmodel_calibrate.DecodeCalibrationResult`."""
    import jax

    from pdjax import timing
    from pdjax.analysis.costmodel_calibrate import FitSpec, calibrate_cost
    s = c.simulate
    shapes = calibration_shapes(c.decode.batches, c.decode)
    if s.calibration == "call":
        return timing.calibrate_decode(params, cfg, shapes, s.repeats, seed=c.train.seed, statistic=s.statistic)
    measure = _loop_timer(params, cfg, c.decode.new_tokens, s.inner, c.train.seed)
    return calibrate_cost(measure, shapes, s.repeats, fit=FitSpec("decode"), statistic=s.statistic, warmup=1,
                          seed=c.train.seed, backend=jax.default_backend())


# ---- the run ---------------------------------------------------------------------------

def _rows(measured: list[dict], fit, c: Config, layers: int) -> tuple[list, list]:
    """(the speed-up table, the step table): measured beside simulated, per batch."""
    d = c.decode
    kv_len = d.prompt + d.new_tokens
    speed, steps = [], []
    for m in measured:
        sim = simulate(fit, m["accept"], m["batch"], kv_len, layers)
        speed.append({**{k: m[k] for k in SPEEDUP_COLUMNS[:7]}, "simulated": sim["speedup"],
                      "measured / simulated": m["speed-up"] / sim["speedup"]})
        steps.append({"batch": m["batch"], "steps": m["steps"],
                      "steps at 1 + accept": (d.new_tokens - 1) / m["tok/step"],
                      "step ms": m["step ms"], "verify ms": m["verify ms"],
                      "model step ms": 1e3 * sim["step_s"], "model verify ms": 1e3 * sim["verify_s"],
                      **{k: m[k] for k in STEP_COLUMNS[7:]}})
    return speed, steps


def _plot(speed: list[dict]):
    from pdjax.schedules.figure import Figure
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    x = np.arange(len(speed))
    for i, (key, label) in enumerate((("speed-up", "measured (end to end)"), ("loop speed-up", "measured (loops)"),
                                      ("simulated", "simulated (cost model)"))):
        ax.bar(x + (i - 1) * 0.27, [r[key] or 0.0 for r in speed], 0.27, label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(x, [str(r["batch"]) for r in speed])
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("MTP speed-up over plain decoding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def run(c: Config, out_dir: str) -> Result:
    c = c.scaled()
    t, d = c.train, c.decode
    data, _ = mtp_train.corpus(t.corpus_mb)
    cfg = mtp_train.model_config(t.width, t.layers)
    params, summary, source = mtp_train.trained_params(cfg, t, data, t.cache, t.retrain, log=progress.note)
    agree = mtp_train.agreement(params, cfg, mtp_train.eval_windows(data, t))
    held = mtp_train.split(data, t.holdout)[1]
    prompts = mtp_train.windows(held, np.random.default_rng(t.seed + 2), max(d.batches), d.prompt)
    measured = [measure(params, cfg, prompts[:B], d.new_tokens, d.repeats)
                for B in progress.track(d.batches, "mtp_speculative: batches")]
    cal = calibrate(params, cfg, c)
    speed, steps = _rows(measured, cal.fit, c, cfg.num_hidden_layers)
    return _result(c, cfg, speed, steps, cal, summary, source, agree)


def _result(c: Config, cfg, speed, steps, cal, summary, source, agree) -> Result:
    first = speed[0]
    headline = (f"batch {first['batch']}: accept {first['accept']:.2f}, measured speed-up {first['speed-up']:.2f}x "
                f"vs simulated {first['simulated']:.2f}x (ratio {first['measured / simulated']:.2f}); " + ", ".join(
                    f"batch {r['batch']}: {r['speed-up']:.2f}x vs {r['simulated']:.2f}x" for r in speed[1:]))
    fit = cal.fit
    body = (f"Byte-level model: hidden {c.train.width}, {cfg.num_hidden_layers} layers, one MTP depth, "
            f"{mtp_train.param_count(cfg):,} params ({'cached' if source == 'cache' else 'trained in this run'}); "
            f"held-out CE {summary['heldout_main_ce']:.3f} (model), {summary['heldout_mtp_ce']:.3f} (depth 1) "
            f"nats/byte; teacher-forced agreement of the draft with the model: {agree['agree']:.3f}.\n\n"
            f"Decode-step cost on this machine ({c.simulate.calibration} calibration): {fit}.\n\n"
            + markdown_table(speed) + "\n\n" + markdown_table(steps) + "\n\n"
            "`speed-up`: plain over MTP seconds end to end (median of per-repeat ratios); `loop speed-up`: the "
            "decode loops alone; `simulated`: (1 + accept) t1 / tv of the fitted decode-step cost; `steps at 1 + "
            "accept`: the loop's steps if every row emitted 1 + accept tokens a step (the batch waits for its "
            "slowest row).")
    metrics = {"params_from": source, "heldout_main_ce": summary["heldout_main_ce"],
               "heldout_mtp_ce": summary["heldout_mtp_ce"], "agreement": agree, "layers": cfg.num_hidden_layers,
               "kv_len": c.decode.prompt + c.decode.new_tokens, "new_tokens": c.decode.new_tokens,
               "decode": [{k: r[k] for k in ("batch", "steps", "mismatch", "near ties", "blank")} | {
                   "accept": s["accept"], "tok/step": s["tok/step"]} for r, s in zip(steps, speed)]}
    wall_clock = {"fit": {k: getattr(fit, k) for k in ("d0", "d1", "d2", "r2", "n")},
                  "train_s": summary["train_s"], "calibration": cal.rows()}
    return Result("MTP speculative decoding: measured vs simulated speed-up", headline, metrics=metrics,
                  wall_clock=wall_clock, tables={"speedup": speed, "steps": steps, "calibration": cal.rows()},
                  measured_tables=("speedup", "steps", "calibration"), figures={"speedup": _plot(speed)}, body=body,
                  objects={"calibration": cal})
