"""pdjax.pipeline.train: optax training over every schedule equals plain single-device
training, resuming from an orbax checkpoint reproduces the uninterrupted run bit for bit, and
bad input fails before any compute."""

import jax
import numpy as np
import optax
import pytest

import pdjax
import pdjax.pipeline as pp

# the shapes of tests/pipeline/conftest.py's executor fixtures, so the compiled stage programs
# are shared with the executor tests: 2 ranks x 4 micro-batches, batches [8, 8]
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev")  # the hand-written generators; the searched ones use the same op kinds and layouts
RANKS, MICROBATCHES, B, T, STEPS = 2, 4, 8, 8, 20
OPTIMIZER = optax.adamw(1e-3)     # one object: its jitted update compiles once


def _devices():
    return jax.devices()[:RANKS]


def _progressions(vocab: int, seed: int) -> np.ndarray:
    """A learnable task: every row counts up by one from a random start (mod vocab), so
    each next token is the previous one plus one. [STEPS, B, T] int32."""
    start = np.random.default_rng(seed).integers(0, vocab, (STEPS, B, 1))
    return ((start + np.arange(T)) % vocab).astype(np.int32)


def _keyed_data(vocab: int):
    """A callable data source that depends on both the position and the step's key: rows
    count up by ``1 + position % 3`` from starts drawn with the key."""
    def data(position, key):
        start = jax.random.randint(key, (B, 1), 0, vocab)
        return (start + (1 + position % 3) * np.arange(T)) % vocab
    return data


@pytest.fixture(scope="module")
def reference_curve(exec_cfg, exec_params):
    """The losses of plain single-device training: value_and_grad of the unsplit model and
    the same optax update, from the params train() builds by default (init_params, key 0)."""
    data = _progressions(exec_cfg.vocab_size, 0)
    value_and_grad = jax.jit(jax.value_and_grad(pdjax.loss), static_argnums=1)
    update = jax.jit(OPTIMIZER.update)
    params, opt_state, losses = exec_params, OPTIMIZER.init(exec_params), []
    for tokens in data:
        loss, grads = value_and_grad(params, exec_cfg, tokens)
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return data, np.array(losses)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_trains_like_single_device(name, exec_cfg, reference_curve):
    """20 adamw steps: the loss curve equals the single-device one within 1e-5 absolute
    (the losses fall from about 6.1 to 4.8), and training lowers the loss on the learnable task."""
    data, ref = reference_curve
    state = pp.train(pp.build(name, RANKS, MICROBATCHES), exec_cfg, data, optimizer=OPTIMIZER,
                     steps=STEPS, devices=_devices())
    assert isinstance(state, pp.TrainState)
    assert (state.step, state.data_position, len(state.losses)) == (STEPS, STEPS, STEPS)
    assert all(isinstance(x, float) for x in state.losses)
    np.testing.assert_allclose(state.losses, ref, rtol=0, atol=1e-5)
    assert state.losses[-1] < state.losses[0] - 0.5, state.losses


def _assert_same_state(got, want):
    assert (got.step, got.data_position) == (want.step, want.data_position)
    assert got.losses == want.losses
    np.testing.assert_array_equal(jax.random.key_data(got.rng), jax.random.key_data(want.rng))
    for tree in ("params", "opt_state"):
        a, b = getattr(got, tree), getattr(want, tree)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        jax.tree.map(np.testing.assert_array_equal, a, b)


def test_resume_from_checkpoint_equals_uninterrupted_run(exec_cfg, exec_params, tmp_path):
    """10 steps checkpointed every 5, then a fresh call to 20, equal bit for bit to 20 steps
    straight: params, optimizer state, every loss, data position, rng. A call asking for no
    more steps than the checkpoint holds returns it without computing."""
    ex = pp.Executor(pp.build("1f1b", RANKS, MICROBATCHES), exec_cfg, _devices(), measure=False)
    data = _keyed_data(exec_cfg.vocab_size)

    def run(steps, **kw):
        return pp.train(ex.schedule, exec_cfg, data, optimizer=OPTIMIZER, steps=steps,
                        params=exec_params, seed=3, executor=ex, **kw)

    straight = run(STEPS)
    assert not any(a.is_deleted() for a in jax.tree.leaves(exec_params))   # copied, not donated
    first = run(10, checkpoint_dir=tmp_path, checkpoint_every=5)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [5, 10]
    assert first.losses == straight.losses[:10]
    resumed = run(STEPS, checkpoint_dir=tmp_path)
    _assert_same_state(resumed, straight)
    assert len(set(straight.losses)) == STEPS   # the batches really differ step to step

    def no_data(position, key):
        raise AssertionError("a finished run must not ask for data")
    for steps in (STEPS, 10):
        again = pp.train(ex.schedule, exec_cfg, no_data, optimizer=OPTIMIZER, steps=steps,
                         params=exec_params, executor=ex, checkpoint_dir=tmp_path)
        _assert_same_state(again, straight)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [5, 10, 20]


@pytest.fixture
def no_compute(monkeypatch):
    """Running a pipeline step fails the test (the executor's checks of params and tokens
    still run): the errors must come before compute."""
    def run(self, staged, tokens):
        raise AssertionError("computed before the error")
    monkeypatch.setattr(pp.Executor, "run", run)


def test_bad_input_fails_before_compute(exec_cfg, exec_params, no_compute):
    sched = pp.build("1f1b", RANKS, MICROBATCHES)
    data = _progressions(exec_cfg.vocab_size, 0)

    def train(data=data, **kw):
        kw = {"optimizer": OPTIMIZER, "steps": STEPS, "params": exec_params, "devices": _devices(), **kw}
        return pp.train(sched, exec_cfg, data, **kw)

    for steps in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="steps .* must be an integer >= 1"):
            train(steps=steps)
    with pytest.raises(ValueError, match="does not split into the schedule's 4 micro-batches"):
        train(data=data[:, :6])
    with pytest.raises(ValueError, match=r"must be an array \[N, B, T\]"):
        train(data=data[0])
    with pytest.raises(ValueError, match="holds 19 batches, fewer than the 20 steps"):
        train(data=data[:19])
    bad = data.copy()
    bad[7, 0, 0] = exec_cfg.vocab_size
    with pytest.raises(ValueError, match="outside"):
        train(data=bad)
    for opt in (lambda grads: grads, optax.adamw, "adamw"):
        with pytest.raises(ValueError, match="optimizer must be an optax GradientTransformation"):
            train(optimizer=opt)
    with pytest.raises(ValueError, match="checkpoint_every needs a checkpoint_dir"):
        train(checkpoint_every=5)
    other = pp.Executor(pp.build("gpipe", RANKS, MICROBATCHES), exec_cfg, _devices(), measure=False)
    with pytest.raises(ValueError, match="another schedule"):
        train(executor=other, devices=None)
    # the schedule comes first, in train as in Executor; the old order is named, not run
    for call in (lambda: pp.train(exec_cfg, sched, data, steps=STEPS, devices=_devices()),
                 lambda: pp.Executor(exec_cfg, sched, _devices())):
        with pytest.raises(TypeError, match=r"the schedule comes first.*got \(ModelConfig, Schedule\)"):
            call()
    with pytest.raises(TypeError, match="schedule must be a pdjax.schedules.Schedule.*got str"):
        pp.train("1f1b", exec_cfg, data, steps=STEPS)


def test_callable_data_is_checked_before_its_step(exec_cfg, exec_params, no_compute):
    sched = pp.build("1f1b", RANKS, MICROBATCHES)
    with pytest.raises(ValueError, match="does not split into the schedule's 4 micro-batches"):
        pp.train(sched, exec_cfg, lambda position, key: np.zeros((6, T), np.int32),
                 optimizer=OPTIMIZER, params=exec_params, devices=_devices())


def test_callable_data_keeps_one_batch_shape(exec_cfg, exec_params):
    """Each batch shape compiles its own programs: a callable that changes shape is an error
    (before the step with the new shape runs)."""
    def data(position, key):
        return np.zeros((B * (1 + position), T), np.int32)
    with pytest.raises(ValueError, match=r"data\(1, key\) returned a batch of shape \(16, 8\), "
                                         r"earlier batches had \(8, 8\)"):
        pp.train(pp.build("1f1b", RANKS, MICROBATCHES), exec_cfg, data, optimizer=OPTIMIZER,
                 steps=2, params=exec_params, devices=_devices())
