"""Edges of the model's input contract: params of fewer layers than the config, non-finite
floats anywhere in a config (every float field, found by walking the config, so a new one
is covered without being listed), a config.json whose ``rope_scaling`` and
``rope_parameters`` contradict each other, and safetensors files whose only defect is an
overlap, or only a gap, between their tensors' bytes."""

import dataclasses
import json
import math
import struct

import jax
import numpy as np
import pytest
from safetensors import safe_open

import pdjax
from pdjax.model_config import ModelConfig, RopeScaling, from_hf_dict, load_hf_config
from pdjax.model_config_checks import FLOAT_FIELDS, check_finite, float_fields
from pdjax.model import hf_files

NON_FINITE = [math.nan, math.inf, -math.inf]
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


# ---- params of fewer layers than the config ---------------------------------------------------

@pytest.fixture(scope="module")
def cache(tiny_cfg, tiny_params):
    _, cache = pdjax.prefill(tiny_params, tiny_cfg, np.zeros((1, 4), np.int32), max_len=8)
    return cache


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "stacked"])
@pytest.mark.parametrize("layers", [1, 2])
def test_params_of_fewer_layers_are_refused(tiny_cfg, cache, compile_counter, layers, stacked):
    """Params of 1 or 2 layers held against a 3-layer config: refused by every entry point,
    naming both counts, before any compute (they ran on the layers they had before)."""
    fewer = tiny_cfg.replace(num_hidden_layers=layers)
    params = pdjax.init_params(fewer, jax.random.key(0))
    if stacked:
        params = pdjax.stack_layers(params, fewer)
    tokens = np.zeros((1, 4), np.int32)
    match = (rf"params\['layer_runs'\] hold {layers} layers in all" if stacked
             else rf"params\['layers'\] holds {layers} entries") + r", cfg gives 3 \(cfg.num_hidden_layers\)"
    for call in (lambda: pdjax.forward(params, tiny_cfg, tokens), lambda: pdjax.prefill(params, tiny_cfg, tokens),
                 lambda: pdjax.decode_step(params, tiny_cfg, np.zeros(1, np.int32), cache),
                 lambda: pdjax.generate(params, tiny_cfg, [[1, 2]], max_new_tokens=2)):
        with compile_counter() as compiles, pytest.raises(ValueError, match=match):
            call()
        assert compiles.count == 0


# ---- non-finite rope scaling --------------------------------------------------------------------

ROPE_FLOATS = [f.name for f in dataclasses.fields(RopeScaling) if f.type == "float"]


def test_rope_scaling_floats_are_all_listed():
    assert set(ROPE_FLOATS) == {"factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
@pytest.mark.parametrize("field", ROPE_FLOATS)
def test_non_finite_rope_scaling_is_refused(field, value):
    """NaN or inf in any float of rope_scaling (mscale, mscale_all_dim, beta_fast, beta_slow,
    factor) is refused naming it: as a RopeScaling, as a dict, and in a config.json under
    rope_scaling or rope_parameters (a NaN mscale gave all-NaN logits)."""
    name = rf"rope_scaling\.{field} must be finite"
    with pytest.raises(ValueError, match=name):
        RopeScaling(**{field: value})
    with pytest.raises(ValueError, match=name):
        pdjax.configs.tiny(rope_scaling={**YARN, field: value})
    hf = {k: v for k, v in pdjax.configs.deepseek_v3().to_hf_dict().items() if k not in ("rope_scaling", "rope_theta")}
    with pytest.raises(ValueError, match=name):
        from_hf_dict({**hf, "rope_scaling": {**YARN, field: value}})
    with pytest.raises(ValueError, match=name):
        from_hf_dict({**hf, "rope_parameters": {**YARN, "rope_theta": 10000.0, field: value}})


# ---- every float of a config, walked --------------------------------------------------------------

FULL = pdjax.configs.deepseek_v3()        # every optional part present (rope_scaling too)
FLOAT_TYPES = ("float", "Optional[float]", "float | None")


def _annotated_floats(obj, where):
    """Paths of the fields annotated float (or Optional[float]) of the dataclass ``obj`` and of
    the dataclasses its fields hold: found from the annotations, not by the walk under test."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type in FLOAT_TYPES:
            out.append(f"{where}.{f.name}")
        elif dataclasses.is_dataclass(value):
            out += _annotated_floats(value, f"{where}.{f.name}")
    return out


ANNOTATED = _annotated_floats(FULL, "ModelConfig")
WALKED = [path for path, _ in float_fields(FULL, "ModelConfig")]
FLOAT_PATHS = sorted(set(ANNOTATED) | set(WALKED))      # a field the walk skipped is still tested


def test_the_walk_reaches_every_float_field():
    """The walk finds every field annotated as a float, at any depth, and the annotations
    give at least the floats the type checks list (so the enumeration is not empty)."""
    assert set(ANNOTATED) <= set(WALKED)
    assert {f"ModelConfig.{f}" for f in FLOAT_FIELDS} | {f"ModelConfig.rope_scaling.{f}" for f in ROPE_FLOATS} \
        <= set(ANNOTATED)


def _with(obj, parts, value):
    """``obj`` (a dataclass) with the field at ``parts`` set to ``value``, rebuilt on the way
    up (each level validates itself)."""
    inner = value if len(parts) == 1 else _with(getattr(obj, parts[0]), parts[1:], value)
    return dataclasses.replace(obj, **{parts[0]: inner})


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
@pytest.mark.parametrize("path", FLOAT_PATHS)
def test_every_float_field_refuses_non_finite(path, value, compile_counter):
    field = path.removeprefix("ModelConfig.")
    with compile_counter() as compiles, pytest.raises(ValueError, match=rf"{field.replace('.', '[.]')} must be finite"):
        _with(FULL, field.split("."), value)
    assert compiles.count == 0


def test_the_walk_enters_dicts_lists_and_nested_dataclasses():
    @dataclasses.dataclass
    class Inner:
        x: float = 1.0

    @dataclasses.dataclass
    class Outer:
        inner: Inner
        table: dict
        items: tuple
        n: int = 3
        flag: bool = True

    good = Outer(Inner(), {"a": 1.0, "b": {"c": 2}}, (1.0, 2))
    check_finite(good, "Outer")
    for bad, path in ((Outer(Inner(math.nan), {}, ()), r"Outer\.inner\.x"),
                      (Outer(Inner(), {"b": {"c": math.inf}}, ()), r"Outer\.table\.b\.c"),
                      (Outer(Inner(), {}, (1.0, -math.inf)), r"Outer\.items\[1\]")):
        with pytest.raises(ValueError, match=path + " must be finite"):
            check_finite(bad, "Outer")


# ---- rope_scaling and rope_parameters in one config.json ----------------------------------------

def _both(**changes):
    """deepseek_v3's config.json holding rope_scaling + rope_theta and rope_parameters, the
    latter with ``changes``."""
    d = pdjax.configs.deepseek_v3().to_hf_dict()
    d["rope_parameters"] = {**{k: v for k, v in d["rope_scaling"].items() if k != "type"},
                            "rope_theta": d["rope_theta"], **changes}
    return d


@pytest.mark.parametrize("changes", [{}, {"beta_fast": 32, "beta_slow": 1, "factor": 40}, {"type": "yarn"}],
                         ids=["same", "ints for floats", "type for rope_type"])
def test_agreeing_rope_forms_are_accepted(changes):
    assert from_hf_dict(_both(**changes)) == pdjax.configs.deepseek_v3()


def test_rope_theta_given_once_and_no_scaling_in_either_form_agree():
    d = _both()
    d.pop("rope_theta")
    assert from_hf_dict(d) == pdjax.configs.deepseek_v3()
    unscaled = pdjax.configs.tiny(rope_scaling=None)
    plain = {**unscaled.to_hf_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert plain["rope_scaling"] is None and from_hf_dict(plain) == unscaled
    plain["rope_scaling"] = {"type": "default"}
    assert from_hf_dict(plain) == unscaled


@pytest.mark.parametrize("changes, detail", [
    ({"mscale": 0.707}, "mscale: 1.0 vs 0.707"), ({"mscale_all_dim": 0.0}, "mscale_all_dim"),
    ({"factor": 8.0}, "factor: 40.0 vs 8.0"), ({"beta_fast": 16}, "beta_fast"), ({"beta_slow": 2}, "beta_slow"),
    ({"original_max_position_embeddings": 2048}, "original_max_position_embeddings: 4096 vs 2048"),
    ({"rope_type": "default"}, "rope_type: 'yarn' vs 'default'"),
])
def test_contradicting_rope_forms_are_refused(changes, detail, tmp_path):
    """rope_scaling and rope_parameters that disagree: refused naming both keys and the value
    that differs (pdjax took rope_parameters' silently), from a dict and from a config.json."""
    match = rf"rope_scaling and rope_parameters that disagree .*{detail}"
    with pytest.raises(ValueError, match=match):
        from_hf_dict(_both(**changes))
    (tmp_path / "config.json").write_text(json.dumps(_both(**changes)))
    with pytest.raises(ValueError, match=match):
        load_hf_config(str(tmp_path))


def test_contradicting_rope_theta_is_refused():
    with pytest.raises(ValueError, match=r"rope_theta=10000.0 and rope_parameters.rope_theta=50000.0"):
        from_hf_dict(_both(rope_theta=50000.0))
    d = _both()
    d["rope_scaling"] = None                     # no legacy scaling given: rope_parameters' holds
    assert from_hf_dict(d) == pdjax.configs.deepseek_v3()


# ---- safetensors: only an overlap, only a gap --------------------------------------------------------

def _safetensors(path, entries, data_len):
    """A safetensors file of F32 ``entries`` ({name: (elements, begin)}) over ``data_len``
    bytes of data; each entry valid on its own (its bytes its shape's, within the data)."""
    header = {name: {"dtype": "F32", "shape": [n], "data_offsets": [begin, begin + 4 * n]}
              for name, (n, begin) in entries.items()}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(range(data_len)))
    ranges = sorted(tuple(h["data_offsets"]) for h in header.values())
    return ranges


def _covered(ranges):
    """(overlap, gap) of sorted byte ranges starting at 0."""
    overlap = any(b < prev_end for (_, prev_end), (b, _) in zip(ranges, ranges[1:]))
    gap = ranges[0][0] > 0 or any(b > prev_end for (_, prev_end), (b, _) in zip(ranges, ranges[1:]))
    return overlap, gap


def test_a_file_whose_only_defect_is_an_overlap(tmp_path):
    f = tmp_path / "overlap.safetensors"
    ranges = _safetensors(f, {"a": (4, 0), "b": (2, 8)}, data_len=16)      # b inside a's last 8 bytes
    assert _covered(ranges) == (True, False) and max(e for _, e in ranges) == 16
    with pytest.raises(ValueError, match=r"tensor b in .*: data_offsets \[8, 16\] overlap tensor a's, which ends at 16"):
        hf_files.SafetensorsFile(str(f))
    with pytest.raises(Exception):                                        # the format's reader agrees
        safe_open(str(f), "np")


def test_a_file_whose_only_defect_is_a_gap(tmp_path):
    f = tmp_path / "gap.safetensors"
    ranges = _safetensors(f, {"a": (4, 0), "b": (2, 24)}, data_len=32)     # bytes 16..24 unused
    assert _covered(ranges) == (False, True) and max(e for _, e in ranges) == 32
    with pytest.raises(ValueError, match=r"tensor b in .*: data_offsets \[24, 32\] leave bytes 16..24"):
        hf_files.SafetensorsFile(str(f))
    with pytest.raises(Exception):
        safe_open(str(f), "np")


def test_a_file_without_overlap_or_gap_reads(tmp_path):
    f = tmp_path / "good.safetensors"
    _safetensors(f, {"a": (4, 0), "b": (2, 16)}, data_len=24)
    st = hf_files.SafetensorsFile(str(f))
    assert st.get("b").shape == (2,) and sorted(st.keys()) == ["a", "b"]
