"""Checkpoint checks of :mod:`pdjax.model.hf_checks` and :mod:`pdjax.model.hf_files` that the
checkpoint tests leave unpinned: a tensor outside the decoder layers with a long name, the
layer range a wrong layer count names, the header-length limit at its boundary and every
packed dtype. Found by mutation testing (docs/mutation.md)."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import pdjax
from pdjax.model import hf_files

HF = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The v2 fixture as pdjax.save_hf writes it (one model.safetensors)."""
    cfg, params = pdjax.load_hf(os.path.join(HF, "deepseek_v2_tiny"))
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    pdjax.save_hf(str(path), params, cfg)
    return path


def _with_tensors(src, dst, **extra):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors.update({k.replace("__", "."): v for k, v in extra.items()})
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_a_long_name_outside_the_layers_is_an_unexpected_tensor(saved, tmp_path):
    """A tensor whose name has more than three parts but is not ``model.layers.<i>...`` is
    reported as unexpected, by name (not taken for a layer, not a crash on its name)."""
    ckpt = _with_tensors(saved, tmp_path / "c", model__extra__thing__weight=np.ones((2,), np.float32))
    with pytest.raises(ValueError, match=r"unexpected tensor model\.extra\.thing\.weight .*\(1 unexpected in all\)"):
        pdjax.load_hf(str(ckpt))


def test_a_layer_count_error_names_the_layers_held(saved, tmp_path):
    """A checkpoint holding more decoder layers than config.json allows names the range it
    holds, ``model.layers.0..<last>``."""
    ckpt = tmp_path / "c"
    shutil.copytree(saved, ckpt)
    d = json.load(open(ckpt / "config.json"))
    (ckpt / "config.json").write_text(json.dumps({**d, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"holds 3 layers \(model\.layers\.0\.\.2\), config\.json at most 2"):
        pdjax.load_hf(str(ckpt))


@pytest.mark.parametrize("length, match", [
    (100_000_000, "truncated safetensors file .* header claims 100000000 bytes"),
    (100_000_001, "header length 100000001 bytes, over the format's limit of 100000000"),
])
def test_the_header_length_limit_is_the_formats(tmp_path, length, match):
    """A header of up to 100,000,000 bytes (safetensors' MAX_HEADER_SIZE) is within the limit
    (here: past the end of the file); one byte more is over it."""
    f = tmp_path / "h.safetensors"
    f.write_bytes(length.to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=match):
        hf_files.SafetensorsFile(str(f))


@pytest.mark.parametrize("dtype", ["F4", "F6_E2M3", "F6_E3M2"])
def test_every_packed_dtype_is_named_as_packed(tmp_path, dtype):
    """The sub-byte float dtypes of the format are refused as packed, not as unknown."""
    header = json.dumps({"a": {"dtype": dtype, "shape": [2], "data_offsets": [0, 1]}}).encode()
    f = tmp_path / "p.safetensors"
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    with pytest.raises(ValueError, match=f"dtype {dtype} \\(packed below a byte per element\\)"):
        hf_files.SafetensorsFile(str(f))


def test_a_header_that_ends_the_file_is_not_truncated(tmp_path):
    """A file whose header reaches exactly its end (no tensor data: here no tensors) opens,
    with no tensors."""
    f = tmp_path / "e.safetensors"
    f.write_bytes((2).to_bytes(8, "little") + b"{}")
    assert list(hf_files.SafetensorsFile(str(f)).keys()) == []


def test_block_fp8_scales_each_block_of_a_non_square_weight(tmp_path):
    """A block-FP8 weight spanning several 128x128 blocks, with a partial last block in each
    dimension and more rows than columns, is read with each block times its own scale."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    w = rng.uniform(-2, 2, (300, 130)).astype(ml_dtypes.float8_e4m3fn)
    scale = np.array([[1.0, 2.0], [4.0, 8.0], [16.0, 32.0]], np.float32)
    save_file({"w": w, "w_scale_inv": scale}, tmp_path / "model.safetensors")
    readers, where = hf_files.open_checkpoint(str(tmp_path))
    got = hf_files._getter(readers, where)("w")
    want = w.astype(np.float32).copy()
    for i in range(3):
        for j in range(2):
            want[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= scale[i, j]
    np.testing.assert_array_equal(got, want)
