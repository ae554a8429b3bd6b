"""The simulator's step cost as a view of the op-level model (pdjax.sim.cost_fit): fitted once
per deployment to pdjax.analysis.predict, it gives back the model's step times, and moves
when the model's calibration moves (one source of truth)."""

import dataclasses

import pytest

import pdjax
from pdjax import analysis as A
from pdjax.analysis import calibration as C, deploy
from pdjax.sim.cost_fit import linear_cost_from_deployments


@pytest.fixture(scope="module")
def v3():
    return pdjax.configs.deepseek_v3()


def _pair(v3):
    return (A.Deployment(v3, "h800", "prefill", gpus=32, ep=32), A.Deployment(v3, "h800", "decode", gpus=32, ep=32))


@pytest.fixture(scope="module")
def fitted(v3):
    return linear_cost_from_deployments(*_pair(v3))


def test_the_fit_gives_back_the_model(v3, fitted):
    pre, dec = _pair(v3)
    for L, per_gpu in ((2048, 8192), (4096, 16384)):
        p = A.predict(dataclasses.replace(pre, input_len=L, batch_per_gpu=per_gpu))
        prompts = per_gpu * 32 // L
        assert fitted.prefill_step_time([(L, 0)] * prompts) == pytest.approx(p.step_time_s, rel=0.10)
    for n, kv in ((64, 2048), (256, 4096)):
        p = A.predict(dataclasses.replace(dec, batch_per_gpu=n, input_len=kv, output_len=1))
        assert fitted.decode_step_time([kv] * (n * 32)) == pytest.approx(p.step_time_s, rel=0.05)
    assert fitted.decode_attention_time_totals(32, 32 * 4096) + fitted.decode_ffn_time(32) == \
        pytest.approx(fitted.decode_step_time([4096] * 32))
    assert "largest fit error" in fitted.note


def test_the_simulator_cost_follows_the_calibration(v3, fitted, monkeypatch):
    """Faster FlashMLA ceilings: the fitted per-cached-token decode cost falls."""
    monkeypatch.setattr(C, "FLASHMLA_DECODE", {"memory_gbps": 6000.0, "compute_tflops": 1320.0})
    deploy.clear_caches()
    try:
        faster = linear_cost_from_deployments(*_pair(v3))
    finally:
        monkeypatch.undo()
        deploy.clear_caches()
    assert faster.d2 < fitted.d2


def test_roles_are_checked(v3):
    pre, dec = _pair(v3)
    with pytest.raises(ValueError, match="needs a prefill and a decode Deployment"):
        linear_cost_from_deployments(dec, pre)
