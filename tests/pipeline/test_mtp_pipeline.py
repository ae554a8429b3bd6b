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
from pdjax.analysis.pipeline_costs import pipeline_costs
from pdjax.pipeline.measurement import measure_executor

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


# ---- the cost model and the simulator with MTP (pdjax.analysis.pipeline_costs) ----------------

def _nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def measured(setup):
    """name -> (executor with MTP, executor without, both after one measured step), on the
    MTP config: the same model and batch, the MTP term on or off."""
    cfg, params, tokens, _ = setup
    out = {}

    def get(name):
        if name not in out:
            s = pp.build(name, num_ranks=2, num_microbatches=4)
            pair = [pp.Executor(s, cfg, devices=jax.devices()[:2], mtp_weight=w) for w in (WEIGHT, 0.0)]
            for ex in pair:
                ex.step(params, tokens)
            out[name] = pair
        return out[name]
    return get


@pytest.mark.filterwarnings("ignore:the 2-layer model splits over 4 pipeline stages")
@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipev"])
def test_measured_memory_with_mtp_equals_the_simulation(setup, measured, name):
    """With the MTP term the executor's measured peak bytes still equal the simulator's byte
    model, rank by rank; the measured per-stage bytes grow only on the stage holding the head,
    where the config-derived cost model puts the MTP term; and the params the executor places
    on each stage are the cost model's param bytes, with and without MTP."""
    cfg, params, tokens, _ = setup
    on, off = measured(name)
    np.testing.assert_array_equal(on.last_memory, pp.simulate(on.schedule, memory=on.stage_memory).peak_memory)
    np.testing.assert_array_equal(on.last_timeline.peak_memory, on.last_memory)
    heads = pipeline_costs(cfg, on.schedule, (tokens.shape[0] // 4, tokens.shape[1])).head_stages
    for s in range(on.schedule.num_stages):
        if s in heads:          # an I/W split (zb1p) keeps more for the W too
            assert on.stage_memory["F"][s] > off.stage_memory["F"][s], s
            assert on.stage_memory["I"][s] >= off.stage_memory["I"][s], s
        else:
            assert all(on.stage_memory[k][s] == off.stage_memory[k][s] for k in ("F", "I", "I_free")), s
    others = [r for r in range(2) if r not in {on.schedule.layout.stage_rank[h] for h in heads}]
    np.testing.assert_array_equal(on.last_memory[others], off.last_memory[others])
    b = tokens.shape[0] // on.schedule.num_microbatches
    for ex in (on, off):
        costs = pipeline_costs(cfg, ex.schedule, (b, tokens.shape[1]), mtp_weight=ex.mtp_weight)
        assert [_nbytes(sp) for sp in ex.place(params)] == list(costs.param_bytes)


def test_the_executed_row_with_mtp_holds_measured_equal_simulated_memory(setup, measured):
    """pdjax.pipeline.measurement's row (the executed_bubbles experiment's) with the MTP term:
    measured peak bytes == the simulation's (fed the executor's byte model)."""
    _, params, tokens, _ = setup
    on, _ = measured("zb1p")
    row = measure_executor(on, params, tokens, repeats=1, op_repeats=1)
    assert row.measured_peak_bytes == row.simulated_peak_bytes and min(row.measured_peak_bytes) > 0


def test_xla_flops_of_the_head_stage_grow_by_the_derived_mtp_term():
    """XLA's FLOP counts of the executor's compiled F and B programs: with the MTP term only the
    head stage's grow, by the cost model's MTP term (XLA also counts norms, softmax and
    activations: within +10 %), and every stage's are the model's within 10 %. A dense model,
    so that XLA:CPU's capacity-padded expert path does not count idle expert slots."""
    cfg = pdjax.configs.tiny(num_hidden_layers=2, num_nextn_predict_layers=2, n_routed_experts=0)
    params = pdjax.init_params(cfg, jax.random.key(5))
    s = pp.build("1f1b", num_ranks=2, num_microbatches=4)
    xla, model = {}, {}
    for w in (0.0, WEIGHT):
        ex = pp.Executor(s, cfg, devices=jax.devices()[:2], mtp_weight=w, measure=False)
        info = ex.compile(params, (8, 16))
        xla[w] = np.array([(_flops(i.F), _flops(i.B)) for i in info])
        costs = pipeline_costs(cfg, s, (2, 16), mtp_weight=w)
        model[w] = np.stack([costs.F, costs.B], axis=1)
        ratio = xla[w] / model[w]
        assert np.all((1.0 <= ratio) & (ratio <= 1.10)), ratio
    term = np.array([costs.mtp.F, costs.mtp.B])
    np.testing.assert_array_equal(xla[WEIGHT][0], xla[0.0][0])          # the first stage: no change
    grow = (xla[WEIGHT][1] - xla[0.0][1]) / term                          # the head stage: the MTP term
    assert np.all((1.0 <= grow) & (grow <= 1.10)), grow
    np.testing.assert_array_equal(model[WEIGHT][1] - model[0.0][1], term)


def _flops(compiled) -> float:
    ca = compiled.cost_analysis()
    return float((ca[0] if isinstance(ca, (list, tuple)) else ca)["flops"])
