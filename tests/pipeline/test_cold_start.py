"""The executor's cold start (issue #26): each distinct stage program compiled once (copies
on other devices relocated), distinct programs compiled concurrently, nothing left to
compile after ``compile()``, the persistent compilation cache on by default for users
(their setting and the opt-out respected), and the progress line of a long compile."""

import contextlib
import io
import json
import os
import subprocess
import sys
import time

import jax
import pytest

import pdjax
import pdjax.pipeline as pp
from pdjax import compilation

EXEC_RANKS, EXEC_MICROBATCHES, EXEC_ROWS, EXEC_T = 2, 4, 2, 8   # as tests/pipeline/conftest.py

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run in a fresh process with the persistent cache off (a program loaded from disk cannot be
# relocated: XLA:CPU serializes a deserialized executable incompletely): compile DualPipe (every
# chunk on both ranks) for a dense and a MoE model, count jax's compiles, and check the step.
_CHILD = r"""
import json, threading
import jax, numpy as np
import pdjax, pdjax.pipeline as pp
from pdjax.pipeline import compiled

compiles, active, peak = [], [0], [0]
lock = threading.Lock()
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **_: compiles.append(secs) if name == "/jax/core/compile/backend_compile_duration" else None)
one = compiled._compile_one
def counting(*a, **k):
    with lock:
        active[0] += 1; peak[0] = max(peak[0], active[0])
    try:
        return one(*a, **k)
    finally:
        with lock:
            active[0] -= 1
compiled._compile_one = counting

def distinct(info):
    keys = set()
    for i in info:
        keys |= {("F", i.prog.key), ("zeros", i.chunk.index)}
        keys |= {(k, i.prog.key) for k in "BIW" if getattr(i, k) is not None}
        keys |= {("FB", i.prog.key, info[b].prog.key, k) for b, k in i.pairs}
    return len(keys)

out = {}
for name, dense in (("dense", 4), ("moe", 2)):
    compiled.clear_caches()
    cfg = pdjax.configs.tiny(num_hidden_layers=4, first_k_dense_replace=dense)
    params = pdjax.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (%(B)d, %(T)d), dtype=np.int32)
    ex = pp.Executor(pp.build("dualpipe", %(R)d, %(M)d), cfg, devices=jax.devices()[:%(R)d])
    staged = ex.place(params)      # (compile(params) would also warm the step's jnp helpers)
    before, n0 = dict(compiled.STATS), len(compiles)
    info = ex.compile(staged, tokens.shape)
    stats = {k: compiled.STATS[k] - before[k] for k in before}
    n = len(compiles) - n0
    loss, grads = ex.step(params, tokens)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(pdjax.loss), static_argnums=1)(params, cfg, tokens)
    err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
              zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
    programs = sum(1 for i in info for k in "FBIW" if getattr(i, k) is not None) + len(info) + sum(
        len(i.pairs) for i in info)
    out[name] = dict(compiles=n, distinct=distinct(info), programs=programs, stats=stats,
                     loss_err=abs(float(loss) - float(ref_loss)), grad_err=err)
out["peak_concurrent_compiles"] = peak[0]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def dualpipe_counts():
    """What the child measured (a fresh process, 2 compile threads, persistent cache off)."""
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false", PDJAX_NO_COMPILATION_CACHE="1",
               PDJAX_COMPILE_THREADS="2", PDJAX_COMPILE_PROGRESS="0")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    code = _CHILD % dict(B=EXEC_MICROBATCHES * EXEC_ROWS, T=EXEC_T, R=EXEC_RANKS, M=EXEC_MICROBATCHES)
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_each_distinct_program_compiled_once(dualpipe_counts):
    """DualPipe runs every chunk on both ranks: every copy is relocated, so jax compiles
    exactly the distinct programs, for the dense model and for the MoE one (its routing's
    top-k is sort-free, pdjax.model.topk: XLA:CPU's TopK cannot be serialized, and with
    jax.lax.top_k the MoE copies were compiled once per device). The relocated programs give
    the step of value_and_grad."""
    dense, moe = dualpipe_counts["dense"], dualpipe_counts["moe"]
    for d in (dense, moe):       # (jax may find one program's code compiled already: <=)
        assert d["compiles"] <= d["stats"]["compiled"] == d["distinct"] < d["programs"], d
        assert d["stats"]["relocated"] == d["programs"] - d["distinct"] and not d["stats"]["relocate_failed"], d
    for d in (dense, moe):
        assert d["loss_err"] < 1e-5 and d["grad_err"] < 1e-5, d


def test_distinct_programs_compile_concurrently(dualpipe_counts):
    """With 2 compile threads, two compiles run at once."""
    assert dualpipe_counts["peak_concurrent_compiles"] >= 2


@contextlib.contextmanager
def _count_compiles():
    events = []

    def on(name, secs, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(secs)
    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(on)


def test_nothing_compiles_after_compile(exec_cfg, exec_params, exec_tokens):
    """After ``compile(params, shape)`` a step compiles nothing: not its stage programs, nor
    the accumulators' zeros, the loss's sum or the gathering of the gradients."""
    cfg = exec_cfg.replace(vocab_size=exec_cfg.vocab_size + 8)   # programs no other test compiled
    params = pdjax.init_params(cfg, jax.random.key(1))
    ex = pp.Executor(pp.build("zb1p", EXEC_RANKS, EXEC_MICROBATCHES), cfg, devices=jax.devices()[:EXEC_RANKS])
    ex.compile(params, exec_tokens.shape)
    with _count_compiles() as events:
        jax.block_until_ready(ex.step(params, exec_tokens))
    assert events == []


def test_default_cache_respects_the_user(monkeypatch, tmp_path):
    """The default cache directory is set only where the user set none and did not opt out;
    disable_default_cache undoes it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(compilation, "_set_by_us", None)
    user = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere/mine")
        assert compilation.enable_default_cache() is None
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        jax.config.update("jax_compilation_cache_dir", "/somewhere/mine")
        assert compilation.enable_default_cache() is None
        assert jax.config.jax_compilation_cache_dir == "/somewhere/mine"
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv(compilation.OPT_OUT, "1")
        assert compilation.enable_default_cache() is None
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.delenv(compilation.OPT_OUT)
        want = str(tmp_path / "pdjax" / "jax")
        assert compilation.enable_default_cache() == want == jax.config.jax_compilation_cache_dir
        compilation.disable_default_cache()
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", user)


@pytest.mark.parametrize("env, want", [({}, "default"), ({"PDJAX_NO_COMPILATION_CACHE": "1"}, None),
                                       ({"JAX_COMPILATION_CACHE_DIR": "/somewhere/mine"}, "/somewhere/mine")])
def test_import_pdjax_sets_the_default_cache(tmp_path, env, want):
    """``import pdjax`` (before jax) points jax at ~/.cache/pdjax/jax, unless the user's
    environment sets a directory or opts out."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("JAX_COMPILATION_CACHE_DIR", "PDJAX_NO_COMPILATION_CACHE")}
    clean.update(env, XDG_CACHE_HOME=str(tmp_path))
    code = "import pdjax, jax; print(jax.config.jax_compilation_cache_dir)"
    res = subprocess.run([sys.executable, "-c", code], env=clean, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    want = str(tmp_path / "pdjax" / "jax") if want == "default" else want
    assert res.stdout.strip() == str(want)


def test_progress_line(monkeypatch):
    """A compile longer than progress_after_s says so on the stream, with its duration; a
    quick one prints nothing; None turns it off."""
    monkeypatch.setattr(compilation, "progress_after_s", 0.05)
    out = io.StringIO()
    with compilation.announce("zb1p (2 ranks)", stream=out) as note:
        time.sleep(0.3)
        note["done"] = "3 compiled"
    assert out.getvalue().startswith("pdjax: compiling zb1p (2 ranks)... ") and "(3 compiled)" in out.getvalue()
    quick = io.StringIO()
    with compilation.announce("quick", stream=quick):
        pass
    monkeypatch.setattr(compilation, "progress_after_s", None)
    off = io.StringIO()
    with compilation.announce("off", stream=off):
        time.sleep(0.1)
    assert quick.getvalue() == off.getvalue() == ""
