"""Safetensors files: reading them memory-mapped and checked (any dtype ml_dtypes knows:
bf16, fp8; block-FP8 dequantisation), lazily (a param read whole or part by part, only
when asked), and writing them, single or sharded with an index."""

from __future__ import annotations

import json
import math
import os

import numpy as np

FP8_BLOCK = 128


def _weight_map(index: str) -> dict:
    """The ``weight_map`` of a ``model.safetensors.index.json``: tensor name -> shard file."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"malformed {index}: {e!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ValueError(f"malformed {index}: weight_map must map tensor names to shard file names, "
                         f"got {type(weight_map).__name__}")
    return weight_map


def _shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(_weight_map(index).values()))
        for fn in files:
            if not os.path.exists(os.path.join(path, fn)):
                raise FileNotFoundError(f"{index} names shard {fn}, which is missing")
        return [os.path.join(path, fn) for fn in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


#: The largest header the safetensors library reads (its ``MAX_HEADER_SIZE``), in bytes.
MAX_HEADER_BYTES = 100_000_000
#: Safetensors dtypes pdjax cannot memory-map: floats packed below a byte per element.
PACKED_DTYPES = ("F4", "F6_E2M3", "F6_E3M2")


def _st_dtypes():
    import ml_dtypes
    dtypes = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
              "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
              "BOOL": np.bool_, "C64": np.complex64}
    if hasattr(ml_dtypes, "float8_e8m0fnu"):
        dtypes["F8_E8M0"] = ml_dtypes.float8_e8m0fnu
    return {k: np.dtype(v) for k, v in dtypes.items()}


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs):
    """json object hook: a key given twice is an error, not the last one silently winning."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _read_header(file: str) -> tuple[dict, int, int]:
    """(header, data_start, file size) of a safetensors file: the 8-byte little-endian header
    length (within the file and the format's limit), then a UTF-8 JSON object."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"truncated safetensors file {file}: {size} bytes, no header")
        n = int.from_bytes(raw, "little")
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"corrupt safetensors file {file}: header length {n} bytes, over the "
                             f"format's limit of {MAX_HEADER_BYTES}")
        if 8 + n > size:
            raise ValueError(f"truncated safetensors file {file}: header claims {n} bytes, file has {size}")
        text = f.read(n)
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt safetensors header in {file}: {e}") from None
    except _Duplicate as e:
        raise ValueError(f"corrupt safetensors header in {file}: key {e.args[0]!r} given twice") from None
    if not isinstance(header, dict):
        raise ValueError(f"corrupt safetensors header in {file}: a JSON {type(header).__name__}, expected "
                         "a JSON object (a mapping of tensor name -> {dtype, shape, data_offsets})")
    return header, 8 + n, size


def _ints(x) -> bool:
    return isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


def _check_entry(file: str, name: str, info, data_len: int, dtypes: dict) -> dict:
    """One header entry checked as the format says; returns it with its numpy dtype."""
    what = f"tensor {name} in {file}"
    if not isinstance(info, dict) or {"dtype", "shape", "data_offsets"} - set(info):
        raise ValueError(f"{what}: header entry {info!r}, expected an object with dtype, shape "
                         "and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in dtypes:
        if dtype in PACKED_DTYPES:
            raise ValueError(f"{what}: dtype {dtype} (packed below a byte per element) is not read by pdjax")
        raise ValueError(f"{what}: unknown safetensors dtype {dtype!r}, expected one of {sorted(dtypes)}")
    if not _ints(shape) or any(d < 0 for d in shape):
        raise ValueError(f"{what}: shape {shape!r}, expected a list of non-negative integers")
    if not _ints(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise ValueError(f"{what}: data_offsets {offsets!r}, expected [begin, end], integers "
                         "with 0 <= begin <= end")
    begin, end = offsets
    nbytes = math.prod(shape) * dtypes[dtype].itemsize
    if end - begin != nbytes:
        raise ValueError(f"{what}: data_offsets {offsets} hold {end - begin} bytes, shape {shape} "
                         f"of {dtype} takes {nbytes}")
    if end > data_len:
        raise ValueError(f"truncated safetensors file {file} (or a corrupt header): tensor {name}'s "
                         f"data_offsets {offsets} end past its data section of {data_len} bytes")
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets, "np_dtype": dtypes[dtype]}


def _check_layout(file: str, header: dict, data_len: int) -> None:
    """The tensors' byte ranges, in order, cover the data section exactly: no overlap, no gap,
    nothing after the last (as the safetensors library requires)."""
    pos, prev = 0, None
    for begin, end, name in sorted((*info["data_offsets"], name) for name, info in header.items()):
        if begin < pos:
            raise ValueError(f"tensor {name} in {file}: data_offsets [{begin}, {end}] overlap tensor "
                             f"{prev}'s, which ends at {pos}")
        if begin > pos:
            raise ValueError(f"tensor {name} in {file}: data_offsets [{begin}, {end}] leave bytes "
                             f"{pos}..{begin} of the data section to no tensor")
        pos, prev = end, name
    if pos != data_len:
        raise ValueError(f"safetensors file {file}: its tensors end at byte {pos} of a {data_len}-byte "
                         "data section; the rest belongs to no tensor")


def _check_metadata(file: str, metadata) -> None:
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ValueError(f"corrupt safetensors header in {file}: __metadata__ {metadata!r}, expected "
                         "an object of strings")


class SafetensorsFile:
    """A safetensors file read through np.memmap (any dtype ml_dtypes knows: bf16, fp8).

    The whole header is checked on open, as the safetensors format specifies, before any
    tensor is read: its length within the file, a JSON object, each entry's dtype, shape and
    data_offsets (0 <= begin <= end, end - begin the shape's bytes), the byte ranges covering
    the data section without overlap or gap. Raises ValueError naming the file, the tensor
    and the problem.
    """

    def __init__(self, file: str):
        self.file = file
        header, self.data_start, size = _read_header(file)
        _check_metadata(file, header.pop("__metadata__", None))
        dtypes = _st_dtypes()
        data_len = size - self.data_start
        self.header = {name: _check_entry(file, name, info, data_len, dtypes) for name, info in header.items()}
        _check_layout(file, self.header, data_len)

    def keys(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        begin, end = info["data_offsets"]
        if begin == end:                          # np.memmap cannot map zero bytes
            return np.zeros(info["shape"], info["np_dtype"])
        return np.memmap(self.file, dtype=info["np_dtype"], mode="r", offset=self.data_start + begin,
                         shape=tuple(info["shape"]))


def _dequant_fp8(w, scale_inv):
    """Block-FP8: each 128x128 block of w is multiplied by its scale_inv entry."""
    w = w.astype(np.float32)
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)
    return w * s[: w.shape[0], : w.shape[1]]


def open_checkpoint(path: str) -> tuple[dict, dict]:
    """(readers, where) of a checkpoint directory: ``{file: SafetensorsFile}`` and
    ``{tensor name: file}``, every file's header checked. Raises ValueError for a tensor in
    two files or one the index places in a file that does not hold it."""
    readers = {f: SafetensorsFile(f) for f in _shard_files(path)}
    where: dict[str, str] = {}
    for file, reader in readers.items():
        for name in reader.keys():
            if name in where:
                raise ValueError(f"tensor {name} appears in both {where[name]} and {file}")
            where[name] = file
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        for name, fn in _weight_map(index).items():
            if where.get(name) != os.path.join(path, fn):
                raise ValueError(f"{index} places tensor {name} in {fn}, which does not hold it")
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
