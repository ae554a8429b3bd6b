"""Corrupt checkpoints: every bad safetensors header, stored dtype or config.json that
disagrees with the tensors is a ValueError naming the problem, raised before any tensor is
read or any program traced or compiled; a good checkpoint loads as before.

The checkpoints are the tiny DeepSeek-V2 fixture loaded and written back by ``pdjax.save_hf``
(one ``model.safetensors``), then corrupted by editing the header bytes; each header case
is also rejected by the safetensors library itself (``safe_open``), so pdjax checks at least
what the format's reference reader does."""

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors.numpy import load_file, save_file

import pdjax
from pdjax.model import hf_files

HF = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
T = "model.layers.0.self_attn.kv_b_proj.weight"      # a weight in the middle of the file
NORM = "model.layers.0.input_layernorm.weight"
EXPERT = "model.layers.1.mlp.experts.0.gate_proj.weight"
_EVENTS: list[str] = []


def _listen(name, *args, **kwargs):
    _EVENTS.append(name)


@pytest.fixture(scope="module", autouse=True)
def _compile_events():
    """jax's tracing/lowering/compile events, recorded while this module runs."""
    jax.monitoring.register_event_duration_secs_listener(_listen)
    yield
    jax.monitoring.unregister_event_duration_listener(_listen)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(path, params) of the v2 fixture as pdjax.save_hf writes it."""
    cfg, params = pdjax.load_hf(os.path.join(HF, "deepseek_v2_tiny"))
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    pdjax.save_hf(str(path), params, cfg)
    return path, params


@pytest.fixture
def ckpt(saved, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(saved[0], dst)
    return dst


@pytest.fixture
def rejects(monkeypatch):
    """``rejects(path, match)``: load_hf raises ValueError matching ``match`` with no tensor
    read, no program traced or compiled."""
    reads = []
    real = hf_files.SafetensorsFile.get
    monkeypatch.setattr(hf_files.SafetensorsFile, "get", lambda self, n: reads.append(n) or real(self, n))

    def check(path, match, exc=ValueError):
        del _EVENTS[:]
        with pytest.raises(exc, match=match):
            pdjax.load_hf(str(path))
        assert not reads, f"tensors read before the error: {reads[:3]}"
        assert not _EVENTS, f"jax traced/compiled before the error: {_EVENTS[:3]}"
    return check


def _split(f):
    b = f.read_bytes()
    n = int.from_bytes(b[:8], "little")
    return json.loads(b[8:8 + n]), b[8 + n:]


def _write(f, header=None, data=b"", raw=None, length=None):
    text = json.dumps(header).encode() if raw is None else raw
    f.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)


def _edit_header(path, fn):
    f = path / "model.safetensors"
    header, data = _split(f)
    fn(header)
    _write(f, header, data)


def _offsets(begin, end):
    return lambda h: h[T].update(data_offsets=[begin(h[T]["data_offsets"]), end(h[T]["data_offsets"])])


def _set_entry(name, **kw):
    return lambda h: h[name].update(kw)


def _neighbour_overlap(h):
    b, e = h[T]["data_offsets"]
    h[T]["data_offsets"] = [b - 4, e - 4]


HEADER_CASES = {
    "negative offsets": (_offsets(lambda o: -(o[1] - o[0]), lambda o: 0),
                         r"data_offsets \[-\d+, 0\], expected \[begin, end\], integers with 0 <= begin <= end"),
    "offsets past the header": (_offsets(lambda o: -100, lambda o: o[1] - o[0] - 100), "0 <= begin <= end"),
    "begin after end": (_offsets(lambda o: o[1], lambda o: o[0]), "0 <= begin <= end"),
    "overlapping offsets": (_neighbour_overlap, f"tensor {T} .*overlap tensor"),
    "out-of-file offsets": (_offsets(lambda o: o[0] + 10**9, lambda o: o[1] + 10**9),
                            f"tensor {T}'s data_offsets .* end past its data section"),
    "bytes not matching shape": (_offsets(lambda o: o[0], lambda o: o[1] - 4),
                                 f"tensor {T} .* hold \\d+ bytes, shape \\[128, 32\\] of F32 takes 16384"),
    "a gap (tensor dropped)": (lambda h: h.pop(T), "leave bytes .* to no tensor"),
    "unknown dtype": (_set_entry(T, dtype="F31"), f"tensor {T} .*unknown safetensors dtype 'F31'"),
    "packed dtype": (_set_entry(T, dtype="F4"), f"tensor {T} .*dtype F4"),
    "negative shape": (_set_entry(T, shape=[-128, -32]), f"tensor {T} .*shape \\[-128, -32\\]"),
    "float shape": (_set_entry(T, shape=[128.0, 32.0]), f"tensor {T} .*shape \\[128.0, 32.0\\]"),
    "entry not an object": (lambda h: h.update({T: [1, 2]}), f"tensor {T} .*header entry \\[1, 2\\]"),
    "entry without data_offsets": (lambda h: h[T].pop("data_offsets"), f"tensor {T} .*data_offsets"),
    "metadata not strings": (lambda h: h.update(__metadata__={"format": 1}), "__metadata__"),
}


@pytest.mark.parametrize("case", HEADER_CASES)
def test_corrupt_header_entries(ckpt, rejects, case):
    edit, match = HEADER_CASES[case]
    _edit_header(ckpt, edit)
    rejects(ckpt, match)
    with pytest.raises(Exception):               # the format's reference reader agrees
        safetensors.safe_open(str(ckpt / "model.safetensors"), framework="numpy")


def _raw(text, length=None):
    def edit(f):
        _, data = _split(f)
        _write(f, data=data, raw=text, length=length)
    return edit


FILE_CASES = {
    "header a JSON list": (_raw(b"[1, 2]"), "a JSON list, expected a JSON object"),
    "header not JSON": (_raw(b'{"a": nope}'), "corrupt safetensors header in .*model.safetensors"),
    "header not UTF-8": (_raw(b'{"\xff": 1}'), "corrupt safetensors header in .*model.safetensors"),
    "header length past the file": (_raw(b"{}", length=10**6), "truncated safetensors file .* header claims 1000000"),
    "header length over the limit": (_raw(b"{}", length=2**63), "over the format's limit"),
    "bytes after the last tensor": (lambda f: f.write_bytes(f.read_bytes() + b"\0" * 8),
                                    "tensors end at byte \\d+ of a \\d+-byte data section"),
    "truncated data": (lambda f: f.write_bytes(f.read_bytes()[:-8]), "truncated safetensors file"),
}


@pytest.mark.parametrize("case", FILE_CASES)
def test_corrupt_files(ckpt, rejects, case):
    edit, match = FILE_CASES[case]
    edit(ckpt / "model.safetensors")
    rejects(ckpt, match)
    with pytest.raises(Exception):
        safetensors.safe_open(str(ckpt / "model.safetensors"), framework="numpy")


def test_a_key_given_twice(ckpt, rejects):
    """Stricter than the library (which keeps the last): a tensor named twice is an error."""
    f = ckpt / "model.safetensors"
    header, data = _split(f)
    text = json.dumps(header).encode()
    _write(f, data=data, raw=text[:-1] + f', "{T}": {json.dumps(header[T])}}}'.encode())
    rejects(ckpt, f"key '{T}' given twice")


# ---- stored dtypes ---------------------------------------------------------------------------

def _retype(path, name, fn):
    tensors = load_file(path / "model.safetensors")
    tensors.update(fn(tensors[name]) if callable(fn) else fn)
    save_file(tensors, path / "model.safetensors")


def test_int_and_bool_weights_are_refused_not_cast(ckpt, rejects):
    _edit_header(ckpt, _set_entry(T, dtype="I32"))       # same bytes, read as int32
    rejects(ckpt, f"tensor {T} in checkpoint .* stored as I32, expected a float")
    _edit_header(ckpt, _set_entry(T, dtype="F32"))
    _retype(ckpt, NORM, lambda w: {NORM: w > 0})
    rejects(ckpt, f"tensor {NORM} in checkpoint .* stored as BOOL, expected a float")


def test_block_fp8_needs_its_scale(ckpt, rejects):
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    fp8 = {EXPERT: tensors[EXPERT].astype(ml_dtypes.float8_e4m3fn)}
    scale = EXPERT + "_scale_inv"
    for extra, match in [
            (fp8, f"tensor {EXPERT} .* stored as F8_E4M3, expected a float .* with a {scale}"),
            ({**fp8, scale: np.ones((2, 2), np.float32)},
             f"tensor {scale} .* F32 of shape \\(2, 2\\), expected a float of shape \\(1, 1\\)"),
            ({**fp8, scale: np.ones((1, 1), np.int32)}, f"tensor {scale} .* I32 of shape \\(1, 1\\)"),
            ({NORM + "_scale_inv": np.ones((1,), np.float32)}, f"tensor {NORM} .* F32 with a {NORM}_scale_inv")]:
        save_file({**tensors, **extra}, f)
        rejects(ckpt, match)


def test_orphan_scale_is_unexpected(ckpt, rejects):
    name = "model.layers.0.mlp.nothing.weight_scale_inv"
    _retype(ckpt, NORM, {name: np.ones((1, 1), np.float32)})
    rejects(ckpt, f"unexpected tensor {name}")


# ---- config.json against the tensors ---------------------------------------------------------

def _config(path, **changes):
    d = json.load(open(path / "config.json"))
    d.update(changes)
    (path / "config.json").write_text(json.dumps(d))


CONFIG_CASES = {
    "fewer layers": ({"num_hidden_layers": 2}, "holds 3 layers .* config.json at most 2 "
                                               r"\(num_hidden_layers=2 \+ num_nextn_predict_layers=0\)"),
    "more layers": ({"num_hidden_layers": 4}, "holds 3 layers .* config.json num_hidden_layers=4"),
    "an extra decoder layer called MTP": ({"num_hidden_layers": 2, "num_nextn_predict_layers": 1},
                                          "layer 2 .* holds no eh_proj.weight"),
    "bad num_nextn_predict_layers": ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers must be >= 0, got -1"),
    "bool num_nextn_predict_layers": ({"num_nextn_predict_layers": True},
                                      "num_nextn_predict_layers must be an integer, got True"),
    "a declared MTP layer missing": ({"num_nextn_predict_layers": 1},
                                     "declares num_nextn_predict_layers=1, the checkpoint holds 0 such layers"),
    "other expert count": ({"n_routed_experts": 16},
                           "layer 1 .* holds 8 routed experts, config.json n_routed_experts=16"),
    "experts in a dense layer": ({"first_k_dense_replace": 2},
                                 "layer 1 .* holds 8 routed experts, but config.json makes it dense"),
    "a MoE layer without experts": ({"first_k_dense_replace": 0}, "layer 0 .* holds 0 routed experts"),
    "other hidden size": ({"hidden_size": 128},
                          r"tensor model.embed_tokens.weight has shape \(256, 64\), expected \(256, 128\)"),
    "other vocabulary": ({"vocab_size": 512}, r"model.embed_tokens.weight has shape \(256, 64\), expected \(512, 64\)"),
    "other latent width": ({"kv_lora_rank": 16},
                           r"kv_a_proj_with_mqa.weight has shape \(40, 64\), expected \(24, 64\)"),
    "other expert width": ({"moe_intermediate_size": 32}, EXPERT + r" has shape \(16, 64\), expected \(32, 64\)"),
    "a bad config value": ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_json_against_the_tensors(ckpt, rejects, case):
    changes, match = CONFIG_CASES[case]
    _config(ckpt, **changes)
    rejects(ckpt, match)


def test_declared_mtp_layer_is_left_out_on_request(ckpt, saved):
    """A layer after the decoder's, with its eh_proj, is refused unless config.json declares
    it (num_nextn_predict_layers); declared, load_hf(mtp=False) leaves it out and the decoder
    loads as without it (this one lacks the rest of an MTP layer: loaded, it is refused)."""
    def add_mtp(t):
        for name in [n for n in t if n.startswith("model.layers.2.")]:
            t[name.replace("layers.2.", "layers.3.")] = t[name]
        t["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    tensors = load_file(ckpt / "model.safetensors")
    add_mtp(tensors)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match="holds 4 layers"):
        pdjax.load_hf(str(ckpt))
    _config(ckpt, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match="missing tensor model.layers.3.enorm.weight"):
        pdjax.load_hf(str(ckpt))
    cfg, params = pdjax.load_hf(str(ckpt), mtp=False)
    assert cfg.num_nextn_predict_layers == 0
    jax.tree.map(np.testing.assert_array_equal, params, saved[1])


def test_index_must_match_the_shards(tmp_path, rejects):
    src = tmp_path / "v3"
    shutil.copytree(os.path.join(HF, "deepseek_v3_tiny"), src)
    index = src / "model.safetensors.index.json"
    d = json.load(open(index))
    d["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(d))
    rejects(src, "places tensor model.norm.weight in model-00001-of-00002.safetensors, which does not hold it")
    index.write_text(json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}))
    rejects(src, "malformed .*index.json: weight_map must map")


# ---- the good checkpoint -----------------------------------------------------------------------

def test_good_checkpoint_loads_as_written(saved):
    """Every tensor reads as the safetensors library reads it, the params as saved, and
    the load does trace and compile (so the checks above are not vacuous)."""
    path, params = saved
    reader = hf_files.SafetensorsFile(str(path / "model.safetensors"))
    want = load_file(path / "model.safetensors")
    assert set(reader.keys()) == set(want)
    for name, w in want.items():
        got = reader.get(name)
        assert got.dtype == w.dtype and got.shape == w.shape
        np.testing.assert_array_equal(got, w)
    del _EVENTS[:]
    _, loaded = pdjax.load_hf(str(path))
    assert _EVENTS
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_zero_size_tensor_reads(tmp_path):
    f = tmp_path / "z.safetensors"
    save_file({"a": np.zeros((0, 4), np.float32), "b": np.arange(3, dtype=np.int32)}, f)
    reader = hf_files.SafetensorsFile(str(f))
    assert reader.get("a").shape == (0, 4)
    np.testing.assert_array_equal(reader.get("b"), [0, 1, 2])
