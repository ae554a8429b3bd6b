"""Shared executor fixtures: one small MoE model, one batch, and per-schedule executors built
once per session (their compiled programs are shared across tests through the executor's
process-wide cache)."""

import jax
import numpy as np
import pytest

import pdjax
import pdjax.pipeline as pp

# 2 ranks x 4 micro-batches fits every generator (dualpipe needs C >= 2N; dualpipev,
# interleaved-1f1b with 2 chunks per rank: 4 chunks of one layer each)
EXEC_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev")  # the hand-written generators; the searched ones use the same op kinds and layouts
EXEC_RANKS, EXEC_MICROBATCHES, EXEC_ROWS, EXEC_T = 2, 4, 2, 8


@pytest.fixture(scope="session")
def exec_cfg():
    """Four layers, the last two MoE (8 experts top-2 in 4 groups, a shared expert)."""
    return pdjax.configs.tiny(num_hidden_layers=4, first_k_dense_replace=2)


@pytest.fixture(scope="session")
def exec_params(exec_cfg):
    return pdjax.init_params(exec_cfg, jax.random.key(0))


@pytest.fixture(scope="session")
def exec_tokens(exec_cfg):
    rng = np.random.default_rng(0)
    return rng.integers(0, exec_cfg.vocab_size, (EXEC_MICROBATCHES * EXEC_ROWS, EXEC_T), dtype=np.int32)


@pytest.fixture(scope="session")
def exec_reference(exec_cfg, exec_params, exec_tokens):
    """(loss, grads) of jax.value_and_grad of the unsplit model on the whole batch."""
    f = jax.jit(jax.value_and_grad(pdjax.loss), static_argnums=1)
    return f(exec_params, exec_cfg, exec_tokens)


@pytest.fixture(scope="session")
def executor(exec_cfg):
    """executor(name) -> a measuring Executor of schedule ``name`` (2 ranks x 4 micro-batches)
    on the first two devices, built once per session."""
    cache = {}

    def get(name):
        if name not in cache:
            s = pp.build(name, EXEC_RANKS, EXEC_MICROBATCHES)
            cache[name] = pp.Executor(s, exec_cfg, devices=jax.devices()[:EXEC_RANKS])
        return cache[name]
    return get
