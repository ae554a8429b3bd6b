"""The pipeline executor: every schedule of the IR run as a real training step, held against
jax.value_and_grad of the unsplit model, the simulator's memory model and XLA's FLOP counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdjax.pipeline as pp
from pdjax.model.loss import next_token_loss_sum
from pdjax.schedules.ops import Op
from pdjax.schedules.layout import Pipeline

EXEC_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev")  # the hand-written generators; the searched ones use the same op kinds and layouts


def _max_rel_err(tree, ref):
    errs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)), tree, ref)
    return max(jax.tree.leaves(errs))


@pytest.mark.parametrize("name", EXEC_SCHEDULES)
def test_every_schedule_equals_value_and_grad(name, executor, exec_params, exec_tokens, exec_reference):
    ref_loss, ref_grads = exec_reference
    loss, grads = executor(name).step(exec_params, exec_tokens)
    assert jax.tree.structure(grads) == jax.tree.structure(exec_params)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert _max_rel_err(grads, ref_grads) <= 1e-5


def test_pp_by_ep_equals_value_and_grad(exec_cfg, exec_params, exec_tokens, exec_reference):
    """4 ranks x EP2 on 8 devices, zero-bubble (I and W split): the MoE layers of each stage
    run expert-parallel over its rank's two devices (all_to_all dispatch and combine)."""
    ex = pp.Executor(pp.build("zb1p", num_ranks=4, num_microbatches=4), exec_cfg, devices=jax.devices()[:8])
    assert ex.devices_per_rank == 2 and all(r.moe_impl is not None for r in ex.ranks)
    loss, grads = ex.step(exec_params, exec_tokens)
    assert abs(float(loss) - float(exec_reference[0])) <= 1e-5 * abs(float(exec_reference[0]))
    assert _max_rel_err(grads, exec_reference[1]) <= 1e-5
    # the routed experts of the MoE stages (layers 2 and 3) really are split over two devices
    staged = ex.place(exec_params)
    for s in (2, 3):
        w = staged[s]["layers"][0]["moe"]["w_gate"]
        assert [sh.data.shape[0] for sh in w.addressable_shards] == [exec_cfg.n_routed_experts // 2] * 2


def _flops(compiled) -> float:
    ca = compiled.cost_analysis()
    return float((ca[0] if isinstance(ca, (list, tuple)) else ca)["flops"])


def _unsplit_stage(cfg, chunk, scale):
    """Forward + backward of one stage in one program, written from the model's layers (not
    the executor's stage code): the reference F + I + W is measured against."""
    from pdjax.model import transformer as tfm

    def body(p, h, tok):
        B, T, _ = h.shape
        q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        for lp in p["layers"]:
            h, _ = tfm.layer(lp, cfg, h, q_pos)
        if not chunk.last:
            return h
        return next_token_loss_sum(tfm.head(p, cfg, h), tok) * scale

    def whole(sp, x, tok, gy):
        p = {k: v for k, v in sp.items() if k != "embed"}
        y, vjp = jax.vjp(lambda p, h: body(p, h, tok), p, tfm.embed(sp, x) if chunk.first else x)
        return y, vjp(gy)
    return jax.jit(whole)


def test_input_and_weight_backward_do_not_recompute_the_forward(executor, exec_params, exec_tokens):
    """XLA's FLOP counts: I + W == B (within 10 %), F + I + W == forward + backward of the
    unsplit stage (within 10 %), and each of I and W is a real part of the backward."""
    ex, ex1 = executor("zb1p"), executor("1f1b")
    info = ex.compile(exec_params, exec_tokens.shape)
    info_b = ex1.compile(exec_params, exec_tokens.shape)
    staged = ex.place(exec_params)
    B, T = exec_tokens.shape
    for s, i in enumerate(info):
        f, b, inp, w = (_flops(c) for c in (i.F, info_b[s].B, i.I, i.W))
        ref = _unsplit_stage(ex.cfg, i.chunk, 1.0 / (B * (T - 1)))
        whole = _flops(ref.lower(staged[s], i.x, i.tok, i.gy).compile())
        assert abs((inp + w) / b - 1) <= 0.10, (s, inp, w, b)
        assert abs((f + inp + w) / whole - 1) <= 0.10, (s, f, inp, w, whole)
        assert 0.2 * b < inp < b and 0.1 * b < w < b, (s, inp, w, b)


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipe", "dualpipev"])
def test_measured_peak_memory_equals_simulator(name, executor, exec_params, exec_tokens):
    ex = executor(name)
    ex.step(exec_params, exec_tokens)
    mem = ex.stage_memory
    predicted = pp.simulate(ex.schedule, memory=mem).peak_memory
    np.testing.assert_array_equal(ex.last_memory, predicted)
    np.testing.assert_array_equal(ex.last_timeline.peak_memory, predicted)
    units = pp.simulate(ex.schedule).peak_activations
    if name == "1f1b":      # one stage per rank, nothing kept between an I and a W
        np.testing.assert_array_equal(ex.last_memory, units * mem["F"])
    if name == "zb1p":      # a W keeps its micro-batch alive: every rank holds min(P, m) units
        assert list(units) == [2, 2]
        assert np.all(mem["I"] > 0) and np.all(mem["I_free"] > 0)


def test_measured_timeline_is_causal(executor, exec_params, exec_tokens):
    """Ops on a rank run one after another, and every op starts after its producers end."""
    ex = executor("dualpipe")
    ex.step(exec_params, exec_tokens)
    t = ex.last_timeline
    assert isinstance(t, pp.Timeline) and t.makespan > 0
    end_of = {}
    for r, ops in enumerate(ex.schedule.ops):
        assert np.all(t.starts[r][1:] >= t.ends[r][:-1])
        assert np.all(t.ends[r] > t.starts[r])
        for op, e in zip(ops, t.ends[r]):
            for part in op.parts:
                end_of[(part.kind, part.stage, part.microbatch)] = e
    lay = ex.schedule.layout
    for r, ops in enumerate(ex.schedule.ops):
        for op, st in zip(ops, t.starts[r]):
            for part in op.parts:
                if part.kind == "F" and lay.prev_stage[part.stage] >= 0:
                    assert st >= end_of[("F", lay.prev_stage[part.stage], part.microbatch)]
                if part.kind in "BI" and lay.next_stage[part.stage] >= 0:
                    nxt = lay.next_stage[part.stage]
                    done = end_of.get(("B", nxt, part.microbatch), end_of.get(("I", nxt, part.microbatch)))
                    assert st >= done
    assert 0.0 <= t.bubble_ratio < 1.0


# ---- bad input: clear errors before any compute ------------------------------------------------

def test_batch_not_divisible_into_microbatches(executor, exec_params, exec_tokens):
    with pytest.raises(ValueError, match="micro-batches"):
        executor("1f1b").step(exec_params, exec_tokens[:7])


def test_more_ranks_than_devices(exec_cfg):
    with pytest.raises(ValueError, match="9 ranks but only 8 devices"):
        pp.Executor(pp.build("1f1b", 9, 9), exec_cfg, devices=jax.devices())


def test_sub_mesh_must_divide_the_experts(exec_cfg):
    with pytest.raises(ValueError, match="do not divide the 8 routed experts"):
        pp.Executor(pp.build("1f1b", 2, 2), exec_cfg, devices=jax.devices()[:6])


def test_schedule_that_fails_validation(exec_cfg):
    s = pp.build("1f1b", 2, 2)
    broken = pp.Schedule("broken", s.layout, (s.ops[0], tuple(op for op in s.ops[1] if op != Op("B", 1, 1))))
    with pytest.raises(ValueError, match="rank 1"):
        pp.Executor(broken, exec_cfg, devices=jax.devices()[:2])


def test_bad_tokens_and_params(executor, exec_params, exec_tokens, exec_cfg):
    ex = executor("1f1b")
    with pytest.raises(ValueError, match="outside"):
        ex.step(exec_params, exec_tokens + exec_cfg.vocab_size)
    with pytest.raises(ValueError, match="layers"):
        ex.step({**exec_params, "layers": exec_params["layers"][:3]}, exec_tokens)
    with pytest.raises(ValueError, match="loss"):
        pp.Executor(ex.schedule, exec_cfg, devices=jax.devices()[:2], loss="mse")


def test_a_failing_rank_fails_the_step_without_hanging(executor, exec_params, exec_tokens, monkeypatch):
    """Rank 1's forward raises: the step raises (naming the error), rank 0 stops waiting for
    gradients that will never come, and the executor still runs the next step."""
    ex = executor("1f1b")
    info = ex.compile(exec_params, exec_tokens.shape)

    def broken(*args):
        raise FloatingPointError("injected failure on rank 1")
    monkeypatch.setattr(info[1], "F", broken)
    with pytest.raises(RuntimeError, match="injected failure on rank 1"):
        ex.step(exec_params, exec_tokens)
    monkeypatch.undo()
    loss, _ = ex.step(exec_params, exec_tokens)
    assert np.isfinite(float(loss))


def test_micro_batch_ids_must_cover_the_batch(exec_cfg):
    s = pp.build("1f1b", 2, 2)
    shifted = pp.Layout(2, s.layout.stage_rank, (Pipeline((0, 1), 2, 2),))
    ops = tuple(tuple(type(op)(op.kind, op.stage, op.microbatch + 2) for op in r) for r in s.ops)
    with pytest.raises(ValueError, match="micro-batch ids 0..1"):
        pp.Executor(pp.Schedule("shifted", shifted, ops), exec_cfg, devices=jax.devices()[:2])


def test_too_few_devices_says_how_to_simulate_more(tiny_cfg):
    with pytest.raises(ValueError, match=r"only 1 devices were given .*xla_force_host_platform_device_count=16"):
        pp.Executor(pp.build("1f1b", 16, 16), tiny_cfg, devices=jax.devices()[:1])


def test_a_stage_without_a_layer_is_said_out_loud(tiny_cfg):
    """tiny has 3 layers: 1F1B on 4 ranks leaves a stage with none, a warning says so (not
    when layers_per_stage chose the split); the executor's repr shows the split."""
    with pytest.warns(UserWarning, match=r"3-layer model splits over 4 pipeline stages as \[1, 1, 1, 0\]"):
        ex = pp.Executor(pp.build("1f1b", 4, 4), tiny_cfg, devices=jax.devices()[:4])
    assert "layers per stage [1, 1, 1, 0]" in repr(ex)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = pp.Executor(pp.build("1f1b", 4, 4), tiny_cfg, devices=jax.devices()[:4], layers_per_stage=[0, 1, 1, 1])
    assert chosen.layer_split() == [0, 1, 1, 1]
