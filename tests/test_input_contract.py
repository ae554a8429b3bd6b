"""The input contract, as a property: for every field of the public config and every
argument of the main entry points, a bad value (of the wrong type, NaN or infinite, out of
range, of the wrong shape, or a params tree, cache or schedule of something else) is refused
with a ValueError or TypeError that names the field, before any compute: no XLA program was
compiled on the way to the error.

Each entry point has its good arguments and, per argument, a strategy of values it must
refuse; hypothesis picks an argument and a bad value (derandomized: CI sees the same
examples). The cases the issue found are among the explicit examples."""

import dataclasses
import math
import pathlib

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import pdjax
import pdjax.pipeline as pp
from pdjax import analysis, sim
from pdjax.model_config_checks import BOOL_FIELDS, FLOAT_FIELDS, INT_FIELDS, STR_FIELDS, float_fields
from pdjax.schedules.generators import GENERATORS

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# ---- bad values by kind ------------------------------------------------------------------------
NOT_NUMBERS = st.sampled_from(["3", "nan", None, [1], {"a": 1}, b"1", object()])
BOOLS = st.booleans()
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
NON_INTEGRAL = st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x))


def bad_count(minimum=1):
    """Not an integer >= minimum: bools, floats (8.0 too), strings, None, below the minimum."""
    return st.one_of(NOT_NUMBERS, BOOLS, st.floats(), st.integers(max_value=minimum - 1))


def bad_real(positive=False):
    """Not a finite real (>= 0, or > 0): strings, None, bools, NaN/inf, negatives."""
    low = st.floats(max_value=0.0 if positive else -1e-9, allow_nan=False, allow_infinity=False)
    return st.one_of(NOT_NUMBERS, BOOLS, NON_FINITE, low)


def refused(counter, call, field: str, *names):
    """``call()`` raises ValueError or TypeError naming ``field`` (or one of ``names``),
    with no compilation on the way (``counter``: the compile_counter fixture)."""
    with counter() as compiles:
        with pytest.raises((ValueError, TypeError)) as err:
            call()
    text = str(err.value)
    assert any(n in text for n in (field, *names)), f"{field}: the error does not name it: {text!r}"
    assert compiles.count == 0, f"{field}: {compiles.count} program(s) compiled before the error"


# ---- the model's config ------------------------------------------------------------------------
FIELD_VALUES = {
    **{f: bad_count(minimum=0) for f in INT_FIELDS},
    **{f: bad_real() for f in FLOAT_FIELDS},
    **{f: st.one_of(st.sampled_from(["false", "true", 0, 1, None, 1.0]), st.text()) for f in BOOL_FIELDS},
    **{f: st.one_of(st.integers(), st.none(), st.text().filter(lambda s: s not in (
        "softmax", "sigmoid", "greedy", "group_limited_greedy", "noaux_tc", "deepseek_v2", "deepseek_v3")))
       for f in STR_FIELDS},
    "q_lora_rank": st.one_of(NOT_NUMBERS.filter(lambda v: v is not None), BOOLS, st.floats(),
                             st.integers(max_value=0)),
    "param_dtype": st.sampled_from(["int8", "float64", "nope", 3, None]),
    "compute_dtype": st.sampled_from(["int32", "float64", "", 1.5]),
    "rope_scaling": st.sampled_from([{"type": "yarn", "factor": math.nan}, {"type": "yarn", "factor": None},
                                     {"type": "yarn", "factr": 40}, {"type": "yarn", "factor": "40"},
                                     {"type": "yarn", "mscale_all_dim": math.inf}, {"type": "yarn", "mscale": math.nan},
                                     {"type": "yarn", "beta_fast": -math.inf}, {"type": "yarn", "beta_slow": math.nan},
                                     {"type": "linear", "factor": 2},
                                     [1, 2], "yarn"]),
}


@SETTINGS
@given(data=st.data())
@example(data=None)
def test_every_config_field_refuses_bad_values(compile_counter, data):
    if data is None:     # the cases, always run
        for field, value in (("rope_scaling", {"type": "yarn", "factor": None}), ("norm_topk_prob", "false"),
                             ("n_routed_experts", 8.0), ("n_shared_experts", 1.5), ("rms_norm_eps", math.nan),
                             ("rope_theta", math.inf), ("routed_scaling_factor", math.nan)):
            refused(compile_counter, lambda: pdjax.configs.tiny(**{field: value}), field)
        return
    field = data.draw(st.sampled_from(sorted(FIELD_VALUES)), label="field")
    value = data.draw(FIELD_VALUES[field], label="value")
    refused(compile_counter, lambda: pdjax.configs.tiny(**{field: value}), field)


def _replaced(obj, parts, value):
    inner = value if len(parts) == 1 else _replaced(getattr(obj, parts[0]), parts[1:], value)
    return dataclasses.replace(obj, **{parts[0]: inner})


def _annotated_floats(obj, where):
    """Paths of the fields annotated float in the dataclass ``obj``, at any depth (found without
    the walk under test)."""
    out = []
    for f in dataclasses.fields(obj):
        if f.type in ("float", "Optional[float]", "float | None"):
            out.append(f"{where}.{f.name}")
        elif dataclasses.is_dataclass(getattr(obj, f.name)):
            out += _annotated_floats(getattr(obj, f.name), f"{where}.{f.name}")
    return out


FULL_CFG = pdjax.configs.deepseek_v3()      # rope_scaling present: every float of a config reachable
FLOAT_PATHS = sorted({p for p, _ in float_fields(FULL_CFG, "ModelConfig")} | set(_annotated_floats(FULL_CFG, "ModelConfig")))


@SETTINGS
@given(path=st.sampled_from(FLOAT_PATHS), value=NON_FINITE)
def test_every_float_of_a_config_refuses_non_finite(compile_counter, path, value):
    """Every float reachable from a config (found by the walk the validation makes and from the
    fields' annotations, so a new field is drawn here without being listed), at any depth,
    refuses NaN and inf naming it."""
    field = path.removeprefix("ModelConfig.")
    refused(compile_counter, lambda: _replaced(FULL_CFG, field.split("."), value), field)


# ---- the model's entry points ------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_cfg, tiny_params):
    tokens = np.arange(8, dtype=np.int32).reshape(2, 4)
    _, cache = pdjax.prefill(tiny_params, tiny_cfg, tokens, max_len=8)
    other = pdjax.init_params(tiny_cfg.replace(vocab_size=300), jax.random.key(0))
    return tiny_cfg, tiny_params, tokens, cache, other


def _tokens(ndim, vocab):
    """Token arrays that are not ``ndim``-dimensional integer ids in [0, vocab)."""
    shape = (2, 4) if ndim == 2 else (2,)
    return st.one_of(
        st.just(np.zeros(shape, np.float32)), st.just(np.zeros((2, 4, 2) if ndim == 2 else (2, 4), np.int32)),
        st.just(np.full(shape, vocab, np.int32)), st.just(np.full(shape, -1, np.int32)),
        st.just(np.zeros((0, 4) if ndim == 2 else (0,), np.int32)), st.just("tokens"), st.just(np.array(["a"] * 2)))


def _model_calls(model):
    cfg, params, tokens, cache, other = model
    nxt = np.zeros(2, np.int32)
    return {
        "init_params": (lambda cfg=cfg, key=jax.random.key(0), dtype=None: pdjax.init_params(cfg, key, dtype),
                        {"cfg": st.sampled_from([None, {"hidden_size": 64}, "tiny"]),
                         "dtype": st.sampled_from(["int32", "float64", "nope", 3])}, {}),
        "forward": (lambda params=params, cfg=cfg, tokens=tokens, capacity_factor=None, mesh=None:
                    pdjax.forward(params, cfg, tokens, capacity_factor=capacity_factor, mesh=mesh),
                    {"tokens": _tokens(2, cfg.vocab_size), "params": st.just(other),
                     "cfg": st.sampled_from([None, "tiny", {"vocab_size": 256}]),
                     "mesh": st.sampled_from(["mesh", 8, {"data": 2}])},
                    {"params": ("params[",), "cfg": ("ModelConfig",)}),
        "prefill": (lambda params=params, cfg=cfg, tokens=tokens, max_len=8, lengths=None:
                    pdjax.prefill(params, cfg, tokens, max_len=max_len, lengths=lengths),
                    {"tokens": _tokens(2, cfg.vocab_size), "max_len": st.one_of(bad_count().filter(lambda v: v is not None), st.integers(1, 3)),
                     "lengths": st.sampled_from([[0, 4], [5, 4], [1], [1.5, 2], "ab"]), "params": st.just(other)},
                    {"params": ("params[",)}),
        "decode_step": (lambda params=params, cfg=cfg, next_tokens=nxt, cache=cache:
                        pdjax.decode_step(params, cfg, next_tokens, cache),
                        {"next_tokens": _tokens(1, cfg.vocab_size), "cache": st.sampled_from([None, "cache", {}]),
                         "params": st.just(other)},
                        {"params": ("params[",)}),
        "generate": (lambda params=params, cfg=cfg, prompts=[[1, 2]], max_new_tokens=2:
                     pdjax.generate(params, cfg, prompts, max_new_tokens=max_new_tokens),
                     {"prompts": st.sampled_from([[[2.9, 7]], [["5", 7]], [[1, 2], [3, [4]]], [[]], [], "12",
                                                  [[True, 1]], [[1, 300]], [[-1]]]),
                      "max_new_tokens": bad_count(), "params": st.just(other)},
                     {"params": ("params[",), "prompts": ("prompt",)}),
    }


HF = str(pathlib.Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3_tiny")


def _load_hf_call():
    return (lambda path=HF, dtype=None, mesh=None: pdjax.load_hf(path, dtype, mesh=mesh),
            {"dtype": st.sampled_from(["int8", "float64", "nope", 3]), "mesh": st.sampled_from(["mesh", 8, {"a": 1}]),
             "path": st.sampled_from([3, None, b"x"])}, {})


MODEL_ENTRIES = ["init_params", "forward", "prefill", "decode_step", "generate", "load_hf"]


@pytest.mark.parametrize("entry", MODEL_ENTRIES)
@SETTINGS
@given(data=st.data())
def test_model_entry_points_refuse_bad_arguments(compile_counter, model, entry, data):
    call, bad, aliases = _load_hf_call() if entry == "load_hf" else _model_calls(model)[entry]
    arg = data.draw(st.sampled_from(sorted(bad)), label="argument")
    value = data.draw(bad[arg], label="value")
    refused(compile_counter, lambda: call(**{arg: value}), arg, *aliases.get(arg, ()))


# ---- schedules, the executor, analysis and the serving simulator --------------------------------
SCHEDULE = pp.build("1f1b", 2, 4)


def _other_calls(cfg):

    costs = {"F": bad_real(positive=True), "B": bad_real(), "W": bad_real(), "comm": bad_real()}   # zero-length backwards are valid
    return {
        "build": (lambda name="1f1b", num_ranks=2, num_microbatches=4: pp.build(name, num_ranks, num_microbatches),
                  {"name": st.one_of(st.text(max_size=8).filter(lambda t: t.strip().lower().replace("_", "-") not in GENERATORS),
                                     st.none(), st.integers()), "num_ranks": bad_count(),
                   "num_microbatches": bad_count()}, {"name": ("schedule", "generator")}),
        "simulate": (lambda schedule=SCHEDULE, **kw: pp.simulate(schedule, **kw),
                     {**costs, "schedule": st.sampled_from([None, "1f1b", [1, 2]])}, {}),
        "search": (lambda num_ranks=2, num_microbatches=4, memory_budget=None, time_limit_s=0.2, **kw:
                   pp.search(num_ranks, num_microbatches, memory_budget=memory_budget, time_limit_s=time_limit_s, **kw),
                   {**costs, "num_ranks": bad_count(), "num_microbatches": bad_count(),
                    "memory_budget": st.one_of(NOT_NUMBERS.filter(lambda v: v is not None), BOOLS, NON_FINITE,
                                               st.floats(max_value=0, allow_nan=False)),
                    "time_limit_s": bad_real(positive=True)}, {}),
        "from_csv": (lambda text="0F0,0B0\n": pp.Schedule.from_csv(text),
                     {"text": st.one_of(st.text(max_size=30).filter(lambda t: "F" not in t or "B" not in t),
                                        st.sampled_from(["0F0,0B0,0F999999999,0B999999999\n", "0F0,0B0,0B0\n",
                                                         "xF0\n", "0F-1,0B-1\n"]))}, {"text": ("csv", "CSV", "op")}),
        "Executor": (lambda schedule=SCHEDULE, cfg=cfg, devices=None, loss="next_token", timeout_s=60.0,
                     layers_per_stage=None: pp.Executor(schedule, cfg, devices, loss, timeout_s=timeout_s,
                                                        layers_per_stage=layers_per_stage),
                     {"cfg": st.sampled_from([None, "tiny"]), "loss": st.text(max_size=5),
                      "devices": st.sampled_from([[], [jax.devices()[0]] * 3, "cpu"]),
                      "layers_per_stage": st.sampled_from([[2], [1, 1, 1], 0, "2", [1.5, 1.5]])}, {}),
        "report": (lambda hw="h800", link="scale_out", context_len=4096, ep_size=1, bubble_target=0.1:
                   analysis.report(cfg, hw, link=link, context_len=context_len, ep_size=ep_size,
                                   bubble_target=bubble_target),
                   {"hw": st.sampled_from(["nope", None, 3]), "link": st.sampled_from(["nvlink", None, 1]),
                    "context_len": bad_count(), "ep_size": bad_count().filter(lambda v: v is not None),
                    "bubble_target": bad_real(positive=True)},
                   {"hw": ("hardware",)}),
        "pipeline_costs": (lambda cfg=cfg, schedule=SCHEDULE, microbatch=(2, 8), layers_per_stage=None, mtp_weight=0.0:
                           analysis.pipeline_costs(cfg, schedule, microbatch, layers_per_stage=layers_per_stage,
                                                   mtp_weight=mtp_weight),
                           {"cfg": st.sampled_from([None, "tiny", SCHEDULE]),
                            "schedule": st.sampled_from([None, "1f1b", [1, 2], cfg]),
                            "microbatch": st.sampled_from([None, 16, (0, 16), (2, 1), (2,), "2x16", (2.0, 16),
                                                           (True, 16), (2, 8, 1)]),
                            "layers_per_stage": st.sampled_from([[2], [1, 1, 1], 0, "2", [1.5, 1.5], [3, 1]]),
                            "mtp_weight": st.one_of(bad_real(), st.floats(min_value=1e-6, max_value=1.0))}, {}),
        "WorkloadSpec": (lambda num_requests=4, rate=1.0, think_time=0.0, system_prompts=0, cv=1.0, seed=0:
                         sim.WorkloadSpec(num_requests, rate, think_time=think_time, system_prompts=system_prompts,
                                          cv=cv, seed=seed),
                         {"num_requests": bad_count(), "rate": bad_real(positive=True), "think_time": bad_real(),
                          "system_prompts": bad_count(minimum=0), "cv": bad_real(), "seed": bad_count(minimum=0)},
                         {}),
    }


OTHER_ENTRIES = ["build", "simulate", "search", "from_csv", "Executor", "report", "pipeline_costs", "WorkloadSpec"]


@pytest.mark.parametrize("entry", OTHER_ENTRIES)
@SETTINGS
@given(data=st.data())
def test_schedule_analysis_and_simulator_entry_points_refuse_bad_arguments(compile_counter, tiny_cfg, entry, data):
    call, bad, aliases = _other_calls(tiny_cfg)[entry]
    arg = data.draw(st.sampled_from(sorted(bad)), label="argument")
    value = data.draw(bad[arg], label="value")
    refused(compile_counter, lambda: call(**{arg: value}), arg, *aliases.get(arg, ()))


# ---- the serving engines -------------------------------------------------------------------------
def _engine_kwargs(kind):
    devs = jax.devices()
    if kind == "PD":
        return {"prefill_devices": devs[:1], "decode_devices": devs[1:2]}
    if kind == "colocated":
        return {"devices": devs[:1]}
    return {"attention_devices": devs[:1], "ffn_devices": devs[1:2]}


ENGINE_OPTIONS = {"block_size": bad_count(), "max_decode_slots": bad_count(), "max_prefill_attempts": bad_count(),
                  "max_context": bad_count().filter(lambda v: v is not None),
                  "num_blocks": bad_count().filter(lambda v: v is not None),
                  "handoff_timeout_s": bad_real(positive=True).filter(lambda v: v is not None),
                  "link_bandwidth_Bps": bad_real(positive=True).filter(lambda v: v is not None)}


def _engine(kind, tiny_cfg, tiny_params, **options):
    from pdjax.disagg import AFDEngine, ColocatedEngine, PDEngine

    cls = {"PD": PDEngine, "colocated": ColocatedEngine, "AF": AFDEngine}[kind]
    return cls(tiny_params, tiny_cfg, **_engine_kwargs(kind), **options)


@pytest.mark.parametrize("kind", ["PD", "colocated", "AF"])
@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_engine_options_refuse_bad_values(compile_counter, tiny_cfg, tiny_params, kind, data):
    options = dict(ENGINE_OPTIONS)
    if kind == "AF":               # AF serves without a P/D handoff
        for k in ("handoff_timeout_s", "link_bandwidth_Bps", "max_prefill_attempts"):
            options.pop(k)
    arg = data.draw(st.sampled_from(sorted(options)), label="option")
    value = data.draw(options[arg], label="value")
    refused(compile_counter, lambda: _engine(kind, tiny_cfg, tiny_params, **{arg: value}), arg)


@pytest.fixture(scope="module")
def engines(tiny_cfg, tiny_params):
    return {k: _engine(k, tiny_cfg, tiny_params, max_context=64) for k in ("PD", "colocated", "AF")}


@pytest.mark.parametrize("kind", ["PD", "colocated", "AF"])
@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_engine_generate_refuses_bad_arguments(compile_counter, engines, kind, data):
    eng = engines[kind]
    bad = {"max_new_tokens": bad_count().filter(lambda v: not isinstance(v, list)),   # a list: one per request
           "prompts": st.sampled_from([[], "12", None, 5]),
           "stop_tokens": st.sampled_from(["x", [1.5], [-1], [10 ** 6], None]),
           "arrival_times": st.one_of(st.lists(st.one_of(NON_FINITE, st.floats(max_value=-1e-9), NOT_NUMBERS, BOOLS),
                                               min_size=1, max_size=1),
                                      st.sampled_from([[], [0.0, 1.0], "0", 0.5]))}   # one per prompt: 1 here
    if kind != "AF":
        bad["retention"] = st.sampled_from([3, None, ["chat"]])
    arg = data.draw(st.sampled_from(sorted(bad)), label="argument")
    value = data.draw(bad[arg], label="value")
    kwargs = {"prompts": [[1, 2, 3]], "max_new_tokens": 2, arg: value}
    refused(compile_counter, lambda: eng.generate(kwargs.pop("prompts"), **kwargs), arg, *(("prompt",) if arg == "prompts" else ()))
