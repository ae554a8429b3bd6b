"""Safetensors files: reading them memory-mapped and checked (any dtype ml_dtypes knows:
bf16, fp8; block-FP8 dequantisation), lazily (a param read whole or part by part, only
when asked), and writing them, single or sharded with an index."""

from __future__ import annotations

import json
import os

import numpy as np

FP8_BLOCK = 128


def _shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"malformed {index}: {e}") from None
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.exists(os.path.join(path, fn)):
                raise FileNotFoundError(f"{index} names shard {fn}, which is missing")
        return [os.path.join(path, fn) for fn in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def _st_dtypes():
    import ml_dtypes
    return {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
            "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
            "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
            "BOOL": np.bool_}


class SafetensorsFile:
    """A safetensors file read through np.memmap (any dtype ml_dtypes knows: bf16, fp8).

    The header is checked against the file size on open, so truncation is caught before
    any tensor is read.
    """

    def __init__(self, file: str):
        self.file = file
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"truncated safetensors file {file}: {size} bytes, no header")
            n = int.from_bytes(raw, "little")
            if 8 + n > size:
                raise ValueError(f"truncated safetensors file {file}: header claims {n} bytes, file has {size}")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"corrupt safetensors header in {file}: {e}") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        dtypes = _st_dtypes()
        for name, info in header.items():
            try:
                dtype = np.dtype(dtypes[info["dtype"]])
                begin, end = info["data_offsets"]
                count = int(np.prod(info["shape"], dtype=np.int64))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"corrupt safetensors header entry {name} in {file}: {e!r}") from None
            if end - begin != count * dtype.itemsize:
                raise ValueError(f"tensor {name} in {file}: {end - begin} bytes for shape "
                                 f"{info['shape']} of {info['dtype']}")
            if self.data_start + end > size:
                raise ValueError(f"truncated safetensors file {file}: tensor {name} ends at byte "
                                 f"{self.data_start + end}, file has {size}")
            info["np_dtype"] = dtype
        self.header = header

    def keys(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        begin, _ = info["data_offsets"]
        return np.memmap(self.file, dtype=info["np_dtype"], mode="r", offset=self.data_start + begin,
                         shape=tuple(info["shape"]))


def _dequant_fp8(w, scale_inv):
    """Block-FP8: each 128x128 block of w is multiplied by its scale_inv entry."""
    w = w.astype(np.float32)
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)
    return w * s[: w.shape[0], : w.shape[1]]


def open_checkpoint(path: str) -> tuple[dict, dict]:
    """(readers, where) of a checkpoint directory: ``{file: SafetensorsFile}`` and
    ``{tensor name: file}``. Raises ValueError for a tensor in two files."""
    readers = {f: SafetensorsFile(f) for f in _shard_files(path)}
    where: dict[str, str] = {}
    for file, reader in readers.items():
        for name in reader.keys():
            if name in where:
                raise ValueError(f"tensor {name} appears in both {where[name]} and {file}")
            where[name] = file
    return readers, where


# ---- reading params lazily ------------------------------------------------------------------

class Deferred:
    """A param not read yet: ``read(index)`` returns the part at ``index`` (a tuple of slices,
    as ``jax.make_array_from_callback`` passes) as a numpy array; ``read()`` all of it."""

    def __init__(self, make):
        self.make = make

    def read(self, index=()):
        return np.asarray(self.make())[tuple(index)]


class DeferredStack(Deferred):
    """Per-expert params stacked on axis 0, read expert by expert: a part whose first slice
    covers some experts reads only theirs."""

    def __init__(self, parts):
        self.parts = parts

    def read(self, index=()):
        index = tuple(index)
        first, rest = (index[0], index[1:]) if index else (slice(None), ())
        return np.stack([self.parts[e].read(rest) for e in range(len(self.parts))[first]])


def _getter(readers: dict, where: dict):
    """``get(hf_name)``: the tensor as stored, block-FP8 dequantised."""
    def get(name):
        w = readers[where[name]].get(name)
        scale = name + "_scale_inv"
        if scale in where:
            w = _dequant_fp8(w, readers[where[scale]].get(scale))
        return w
    return get


def _host(x, like):
    """An owned array in the param's dtype, never a view of a file."""
    x = np.asarray(x)
    if x.dtype != like.dtype:
        return x.astype(like.dtype)
    return x if x.flags.owndata else x.copy()


def write_safetensors(path: str, tensors: dict, max_shard_bytes: int | None = None) -> None:
    """Write ``{name: numpy array}`` as ``model.safetensors``, or, with ``max_shard_bytes``,
    as numbered shards of at most that size plus ``model.safetensors.index.json``."""
    from safetensors.numpy import save_file

    if max_shard_bytes is None:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return
    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        if cur and size + t.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += t.nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fn))
        weight_map.update({n: fn for n in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
