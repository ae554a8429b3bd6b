"""The one calibration path (pdjax.analysis.costmodel_calibrate.calibrate_cost) that
pdjax.timing, PDEngine.calibrate_prefill and the sim-vs-engine experiment all go through:
scripted callbacks (no model, no clock), so every number is known."""

import numpy as np
import pytest

from pdjax.analysis.costmodel_calibrate import FitSpec, calibrate_cost, time_shapes
from pdjax.analysis.costmodel_fit import fit_decode_cost, fit_prefill_cost


def scripted(cost, factors, warm=100.0):
    """measure(shape): the first call of each shape (the warm-up) costs ``warm`` x, then
    cost(shape) x each of ``factors`` in turn; ``calls`` logs the shapes asked for."""
    seen: dict = {}
    calls: list = []

    def measure(shape):
        calls.append(shape)
        n = seen[shape] = seen.get(shape, -1) + 1
        return cost(*shape) * (warm if n == 0 else factors[(n - 1) % len(factors)])
    return measure, calls


def prefill_true(q, c):
    return 1e-6 * q * q + 2e-7 * q * c + 1e-4 * q + 3e-3


def decode_true(B, L):
    return 0.01 + 1e-3 * B + 1e-6 * B * L


FACTORS = (1.0, 1.5, 1.1, 1.3, 2.0)          # median 1.3, min 1.0


def test_calibrate_cost_prefill_median_and_held_out_error():
    shapes, held = [(16, 0), (64, 0), (128, 0), (64, 64), (32, 128)], [(32, 32), (128, 64)]
    measure, calls = scripted(prefill_true, FACTORS)
    res = calibrate_cost(measure, shapes, 5, fit=FitSpec("prefill", intercept=True), holdout=held, warmup=1,
                         seed=3, backend="scripted")
    # each sample is the median of its 5 repeats; the warm-up round is dropped
    want = [(q, c, 1.3 * prefill_true(q, c)) for q, c in shapes]
    assert [s[:2] for s in res.samples] == shapes and np.allclose([s[2] for s in res.samples], [w[2] for w in want])
    assert all(len(v) == 5 and max(v) < 10 * prefill_true(*k) for k, v in res.repeats.items())
    assert set(res.repeats) == set(shapes) | set(held)
    # the fit is fit_prefill_cost of exactly those samples; held-out errors against it
    ref = fit_prefill_cost(want, intercept=True)
    assert (res.fit.a, res.fit.b, res.fit.g, res.fit.d) == pytest.approx((ref.a, ref.b, ref.g, ref.d), rel=1e-9)
    err = [abs(ref(q, c) - 1.3 * prefill_true(q, c)) / (1.3 * prefill_true(q, c)) for q, c in held]
    assert res.holdout_errors == pytest.approx(err, abs=1e-9)
    assert res.median_error == pytest.approx(np.median(err), abs=1e-9) and res.max_error == pytest.approx(max(err))
    assert res.median_error < 1e-6                # the true cost is in the model: recovered
    # interleaved rounds: 1 warm-up + 5, every round visits each shape once
    n = len(shapes + held)
    assert len(calls) == 6 * n and all(sorted(calls[r * n:(r + 1) * n]) == sorted(shapes + held) for r in range(6))
    by_min = res.refit(statistic="min", intercept=False)
    assert by_min.statistic == "min" and by_min.fit.d == 0
    assert [s[2] for s in by_min.samples] == pytest.approx([prefill_true(q, c) for q, c in shapes])
    assert "held-out relative error" in res.table() and res.rows()[-1]["split"] == "held-out"


def test_calibrate_cost_decode_median_and_held_out_error():
    shapes, held = [(1, 64), (8, 64), (1, 512), (8, 512)], [(4, 256)]
    measure, _ = scripted(decode_true, FACTORS)
    res = calibrate_cost(measure, shapes, 5, fit=FitSpec("decode"), holdout=held, warmup=1)
    assert [s[:2] for s in res.samples] == [(B, B * L) for B, L in shapes]       # K = B L
    assert [s[2] for s in res.samples] == pytest.approx([1.3 * decode_true(B, L) for B, L in shapes])
    assert set(res.repeats) == set(shapes) | set(held)                           # keyed (B, L)
    ref = fit_decode_cost([(B, B * L, 1.3 * decode_true(B, L)) for B, L in shapes])
    assert (res.fit.d0, res.fit.d1, res.fit.d2) == pytest.approx((ref.d0, ref.d1, ref.d2), rel=1e-9)
    B, L = held[0]
    t = 1.3 * decode_true(B, L)
    assert res.holdout[0][:2] == (B, B * L) and res.holdout[0][2] == pytest.approx(t)
    assert res.holdout_errors == pytest.approx([abs(ref(B, B * L) - t) / t], abs=1e-9)
    assert res.rows()[-1]["L"] == L and res.rows()[-1]["K"] == B * L
    assert res.refit(statistic="min").samples[0][2] == pytest.approx(decode_true(*shapes[0]))


def test_calibrate_cost_handoff_samples_observed_by_a_run():
    """A callback that observes several samples per call (an engine's decode loop): its
    observations of one sample pool over the rounds; the fit has the handoff terms."""
    d0, d1, d2, dj, dl = 2e-3, 2e-5, 1e-8, 1.5e-3, 4e-4
    def measure(shape):
        B, L = shape
        out = {}
        for jn, lv in ((0, 0), (1, 0), (0, 1), (2, 1)):
            t = d0 + d1 * B + d2 * B * L + dj * jn + dl * lv
            out[(B, float(B * L), jn, lv)] = [t, 1.4 * t, t]      # median: t
        return out
    res = calibrate_cost(measure, [(1, 64), (4, 64), (4, 512)], 3, fit=FitSpec("decode", handoff=True))
    assert len(res.samples) == 12 and all(len(v) == 9 for v in res.repeats.values())
    assert (res.fit.d0, res.fit.d1, res.fit.d2, res.fit.dj, res.fit.dl) == pytest.approx((d0, d1, d2, dj, dl),
                                                                                         rel=1e-6)
    assert res.median_error < 1e-6 and "joined" in res.table()


def test_calibrate_cost_names_the_sample_that_failed():
    def measure(shape):
        if shape == (64, 0):
            raise OSError("device lost")
        return prefill_true(*shape)
    with pytest.raises(RuntimeError, match=r"\(64, 0\).*OSError: device lost"):
        calibrate_cost(measure, [(16, 0), (64, 0), (128, 0)], 2)
    for bad in (float("nan"), -1.0, 0.0, [1e-3, float("inf")]):
        with pytest.raises(ValueError, match=r"\(16, 0\).*finite seconds > 0"):
            calibrate_cost(lambda s, bad=bad: bad if s == (16, 0) else 1e-3, [(16, 0), (64, 0), (128, 0)], 1)


def test_calibrate_cost_plan_errors_and_repeated_shapes():
    measure, calls = scripted(prefill_true, (1.0,), warm=1.0)
    with pytest.raises(ValueError, match="overlap"):
        calibrate_cost(measure, [(16, 0), (32, 0), (64, 0)], 1, holdout=[(16, 0)])
    with pytest.raises(ValueError, match="statistic"):
        calibrate_cost(measure, [(16, 0), (32, 0), (64, 0)], 1, statistic="mean")
    with pytest.raises(ValueError, match="needs at least 4"):
        calibrate_cost(measure, [(16, 0), (32, 0), (64, 0)], 1, fit=FitSpec("prefill", intercept=True))
    with pytest.raises(ValueError, match="handoff"):
        FitSpec("prefill", handoff=True)
    calls.clear()
    # a shape listed twice (a fit that needs more samples than there are shapes) is timed once
    res = calibrate_cost(measure, [(16, 0), (32, 0), (16, 0), (32, 0)], 2, fit=FitSpec("prefill", intercept=True))
    assert len(calls) == 4 and [s[:2] for s in res.samples] == [(16, 0), (32, 0), (16, 0), (32, 0)]
    times, found = time_shapes(measure, [(16, 0), (32, 0)], 2, warmup=1)
    assert list(times) == [(16, 0), (32, 0)] and found == {(16, 0): [(16, 0)], (32, 0): [(32, 0)]}
