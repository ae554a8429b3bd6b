"""Dual-batch overlap: identical results to the single-device model; the timeline model
against hand-derived schedules."""

import numpy as np
import pytest

import pdjax
from pdjax.parallel import dbo_gain, make_mesh, overlap_timeline

TOL = 1e-5


@pytest.mark.parametrize("axes", [{"data": 2, "expert": 4}, {"data": 1, "expert": 8}],
                         ids=["data2xexpert4", "data1xexpert8"])
def test_dbo_equals_single_device(tiny_cfg, tiny_params, case, axes):
    toks, full, pre, step = case
    mesh = make_mesh(axes)
    out = pdjax.forward(tiny_params, tiny_cfg, toks, mesh=mesh, overlap="dbo")
    np.testing.assert_allclose(out, full, atol=TOL, rtol=0)
    logits, cache = pdjax.prefill(tiny_params, tiny_cfg, toks[:, :5], max_len=8, mesh=mesh, overlap="dbo")
    np.testing.assert_allclose(logits, pre, atol=TOL, rtol=0)
    got, cache = pdjax.decode_step(tiny_params, tiny_cfg, toks[:, 5], cache, mesh=mesh, overlap="dbo")
    np.testing.assert_allclose(got, step, atol=TOL, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [6] * 16


def test_dbo_needs_two_divisible_halves(tiny_cfg, tiny_params):
    mesh = make_mesh({"data": 1, "expert": 8})
    with pytest.raises(ValueError, match="two halves"):
        pdjax.forward(tiny_params, tiny_cfg, np.zeros((8, 3), np.int32), mesh=mesh, overlap="dbo")
    with pytest.raises(ValueError, match="overlap"):
        pdjax.forward(tiny_params, tiny_cfg, np.zeros((8, 3), np.int32), mesh=mesh, overlap="tbo")


def test_timeline_serial_is_the_sum():
    t = overlap_timeline(2.0, 3.0, 0.5, 0.7, num_layers=5, dbo=False)
    assert t["makespan"] == pytest.approx(5 * (2.0 + 3.0 + 0.5 + 0.7))
    assert t["compute_busy"] == pytest.approx(5 * 5.0) and t["comm_busy"] == pytest.approx(5 * 1.2)


def test_timeline_dbo_hand_derived():
    # halves: A=1, D=.5, E=1, C=.5. compute: A0[0,1] A1[1,2] E0[2,3] E1[3,4];
    # comm: D0[1,1.5] D1[2,2.5] C0[3,3.5] C1[4,4.5]  -> 4.5 (serial 6)
    t = overlap_timeline(2.0, 2.0, 1.0, 1.0, num_layers=1, dbo=True)
    assert t["makespan"] == pytest.approx(4.5)


def test_dbo_gain_limits():
    assert dbo_gain(1.0, 0.0) == pytest.approx(1.0)        # nothing to hide
    assert dbo_gain(0.0, 1.0) == pytest.approx(1.0)        # nothing to hide behind
    gains = [dbo_gain(1.0, c) for c in (0.1, 0.5, 1.0, 2.0)]
    assert all(1.0 < g < 2.0 for g in gains)
    # the gain peaks near compute:communication = 1:1, where each stream can hide the other
    assert max(gains) == gains[2]


def test_timeline_bad_input():
    with pytest.raises(ValueError, match="t_dispatch"):
        overlap_timeline(1.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="num_layers"):
        overlap_timeline(1.0, 1.0, 1.0, num_layers=0)
