"""Training with DeepSeek-V3's MTP loss through the pipeline: the MTP module sits on the stage
that holds the output head, beside a copy of the embedding, and the step's loss and
gradients equal jax.value_and_grad(pdjax.loss(..., mtp_weight=)) of the unsplit model, in
chain schedules (the embedding on two ranks: its gradients summed), DualPipe (two copies of
each chunk) and DualPipeV (one rank holds both ends, as DeepSeek-V3 places them)."""

import jax
import numpy as np
import pytest

import pdjax
import pdjax.pipeline as pp

WEIGHT = 0.3


@pytest.fixture(scope="module")
def setup():
    cfg = pdjax.configs.tiny(num_hidden_layers=2, num_nextn_predict_layers=1)
    params = pdjax.init_params(cfg, jax.random.key(4))
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (4, 8), dtype=np.int32)
    ref = jax.jit(jax.value_and_grad(lambda p, t: pdjax.loss(p, cfg, t, mtp_weight=WEIGHT)))(params, tokens)
    return cfg, params, tokens, ref


@pytest.mark.filterwarnings("ignore:the 2-layer model splits over 4 pipeline stages")
@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipe", "dualpipev"])
def test_the_mtp_loss_and_its_gradients_are_the_unsplit_models(setup, name):
    cfg, params, tokens, (ref_loss, ref_grads) = setup
    ex = pp.Executor(pp.build(name, num_ranks=2, num_microbatches=4), cfg, devices=jax.devices()[:2],
                     mtp_weight=WEIGHT, measure=False)
    loss, grads = ex.step(params, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, ref_grads)
    assert float(np.abs(np.asarray(grads["mtp"][0]["eh_proj"])).max()) > 0
    last = ex.schedule.layout.pipelines[0].stages[-1]
    assert "mtp" in ex.place(params)[last]                          # on the stage with the head


def test_mtp_weight_is_checked_before_any_compute(setup):
    cfg, params, tokens, _ = setup
    schedule = pp.build("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ValueError, match="mtp_weight=0.3 needs the MTP modules"):
        pp.Executor(schedule, cfg.replace(num_nextn_predict_layers=0), devices=jax.devices()[:2], mtp_weight=0.3)
    with pytest.raises(ValueError, match="mtp_weight must be"):
        pp.Executor(schedule, cfg, devices=jax.devices()[:2], mtp_weight=-1)
    ex = pp.Executor(schedule, cfg, devices=jax.devices()[:2], mtp_weight=WEIGHT, measure=False)
    with pytest.raises(ValueError, match=r"at least 3 tokens \(num_nextn_predict_layers \+ 2 with mtp_weight\)"):
        ex.step(params, tokens[:, :2])
    with pytest.raises(ValueError, match="the executor's mtp_weight is 0.3, train was given 0.1"):
        pp.train(schedule, cfg, tokens[None], steps=1, executor=ex, mtp_weight=0.1)
