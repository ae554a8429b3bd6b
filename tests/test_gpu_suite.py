"""benchmarks/gpu_suite.py, without a GPU: every program it measures lowers for CUDA
(jax.export, tiny shapes, the same builders the suite runs at DeepSeek-V3 shapes), and on
CPU it says it measured nothing and exits 0."""

import importlib.util
import os

import jax
import pytest

import pdjax
from pdjax.model import transformer

PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "gpu_suite.py")


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda(fn, *args):
    """The StableHLO text of ``fn`` lowered for CUDA."""
    exported = jax.export.export(fn, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*args)
    return exported.mlir_module()


def test_measured_programs_lower_for_cuda(suite, tiny_cfg):
    cfg, key = suite.bf16(tiny_cfg), jax.random.key(0)
    run, make, ideal = suite.mla_decode(cfg, batch=2, context=16, layers=2)
    text = _cuda(run, *jax.eval_shape(make, key))
    assert "bf16" in text and ideal > 2 * 2 * 16 * cfg.kv_latent_dim * 2       # at least the cache, in bf16
    for whole in (False, True):
        run, make, flops = suite.grouped_gemm(cfg, experts=4, rows_per_expert=8, whole_path=whole)
        text = _cuda(run, *jax.eval_shape(make, key))
        assert text.count('composite "chlo.ragged_dot"') == 3
        assert flops == 6 * 4 * 8 * cfg.hidden_size * cfg.moe_intermediate_size
    for dispatch in ("ragged", "padded"):
        run, make, _ = suite.ep_layer(cfg, 16, dispatch, platform="cuda")
        text = _cuda(run, *jax.eval_shape(make, key))
        assert ("ragged_all_to_all" in text) == (dispatch == "ragged")
    # the model section calls pdjax.prefill / decode_step with moe_impl="ragged": their jitted cores
    params = jax.eval_shape(lambda: pdjax.init_params(cfg, key))
    tokens = jax.ShapeDtypeStruct((2, 8), "int32")
    text = _cuda(transformer._prefill_fresh, params, cfg, tokens, jax.ShapeDtypeStruct((2,), "int32"), 12,
                 False, "ragged")
    cache = jax.eval_shape(lambda: pdjax.init_cache(cfg, 2, 12))
    assert 'composite "chlo.ragged_dot"' in text
    text = _cuda(transformer._decode_step, params, cfg, jax.ShapeDtypeStruct((2,), "int32"), cache, "ragged")
    assert 'composite "chlo.ragged_dot"' in text


def test_preset_from_device_kind(suite):
    assert suite.preset_for("NVIDIA H200") == "h200"
    assert suite.preset_for("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert suite.preset_for("NVIDIA H100 PCIe") is None
    assert suite.preset_for("Tesla T4") is None
    for name in dict(suite.DEVICE_PRESETS).values():
        pdjax.analysis.hardware(name)


def test_on_cpu_it_measures_nothing_and_exits_0(suite, capsys, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)    # main() sets it: undone after
    assert jax.devices()[0].platform == "cpu"
    assert suite.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "no GPU here" in out and "nothing measured" in out
    with pytest.raises(SystemExit):
        suite.main(["--only", "mla,flash"])
    assert sum(suite.BUDGET_S.values()) <= 7 * 60          # under 8 minutes with the processes' start-up
