"""Hugging Face DeepSeek-V2/V3 checkpoints <-> pdjax params; orbax save/restore.

HF stores ``nn.Linear`` weights as [out, in]; pdjax keeps [in, out] with heads split out
(see transformer.py for the param layout). ``kv_b_proj`` [H*(K+V), C] splits into
``wk_b`` [C,H,K] and ``wv_b`` [C,H,V]. Routed experts use the published per-expert names
``mlp.experts.{e}.{gate,up,down}_proj.weight`` and are stacked to [E, ...].
Block-FP8 tensors (``weight`` in float8 with ``weight_scale_inv`` per 128x128 block, as
DeepSeek-V3 ships) are dequantised on load. The safetensors files themselves are read and
written by :mod:`pdjax.model.hf_files`.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.model_config import PARAM_DTYPES, ModelConfig, dtype_name, load_hf_config
# the checks of a checkpoint against its config live in hf_checks; expected_tensors importable here
from pdjax.model import dsa
from pdjax.model.checks import check_mesh
from pdjax.model.hf_checks import (MTP_COPIES, check_checkpoint, expected_tensors, mtp_layers,  # noqa: F401
                                   stored_dtype)
# the safetensors files live in hf_files; importable here
from pdjax.model.hf_files import (FP8_BLOCK, Deferred, DeferredStack, SafetensorsFile, _dequant_fp8,  # noqa: F401
                                  _getter, _host, open_checkpoint, write_safetensors)
from pdjax.model.params import param_shapes, param_shardings


# ---- the name map -------------------------------------------------------------------------

def _mlp_from_hf(get, prefix, leaf):
    return {"w_gate": leaf(lambda: get(prefix + "gate_proj.weight").T),
            "w_up": leaf(lambda: get(prefix + "up_proj.weight").T),
            "w_down": leaf(lambda: get(prefix + "down_proj.weight").T)}


def _layer_from_hf(cfg: ModelConfig, get, i: int, leaf, stack) -> dict:
    D, H, C = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    K, R, Vh = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    a = f"model.layers.{i}."
    s = a + "self_attn."
    m = a + "mlp."
    attn = {}
    if cfg.q_lora_rank is None:
        attn["wq"] = leaf(lambda: get(s + "q_proj.weight").T.reshape(D, H, K + R))
    else:
        attn["wq_a"] = leaf(lambda: get(s + "q_a_proj.weight").T)
        attn["q_norm"] = leaf(lambda: get(s + "q_a_layernorm.weight"))
        attn["wq_b"] = leaf(lambda: get(s + "q_b_proj.weight").T.reshape(cfg.q_lora_rank, H, K + R))
    attn["wkv_a"] = leaf(lambda: get(s + "kv_a_proj_with_mqa.weight").T)
    attn["kv_norm"] = leaf(lambda: get(s + "kv_a_layernorm.weight"))

    def kv_b():                                   # [H, K+V, C]
        return get(s + "kv_b_proj.weight").reshape(H, K + Vh, C)

    attn["wk_b"] = leaf(lambda: kv_b()[:, :K].transpose(2, 0, 1))
    attn["wv_b"] = leaf(lambda: kv_b()[:, K:].transpose(2, 0, 1))
    attn["wo"] = leaf(lambda: get(s + "o_proj.weight").T.reshape(H, Vh, D))
    if cfg.sparse_attention:
        attn["indexer"] = dsa.indexer_from_hf(cfg, get, s + "indexer.", leaf)
    layer = {"attn_norm": leaf(lambda: get(a + "input_layernorm.weight")), "attn": attn,
             "ffn_norm": leaf(lambda: get(a + "post_attention_layernorm.weight"))}
    if cfg.is_moe_layer(i):
        experts = [_mlp_from_hf(get, f"{m}experts.{e}.", leaf) for e in range(cfg.n_routed_experts)]
        moe = {k: stack([x[k] for x in experts]) for k in ("w_gate", "w_up", "w_down")}
        moe["router"] = leaf(lambda: get(m + "gate.weight").T)
        if cfg.topk_method == "noaux_tc":
            moe["router_bias"] = leaf(lambda: get(m + "gate.e_score_correction_bias").astype(np.float32))
        if cfg.n_shared_experts:
            moe["shared"] = _mlp_from_hf(get, m + "shared_experts.", leaf)
        layer["moe"] = moe
    else:
        layer["mlp"] = _mlp_from_hf(get, m, leaf)
    return layer


def params_from_tensors(cfg: ModelConfig, get, lazy: bool = False) -> dict:
    """Assemble params from a getter ``get(hf_name) -> np.ndarray`` (HF layout).

    ``lazy``: every leaf is a :class:`Deferred` (routed experts a :class:`DeferredStack`)
    that calls ``get`` only when read, so a loader can read each leaf, or each device's part
    of it, on its own."""
    if lazy:
        leaf, stack = Deferred, DeferredStack
    else:
        leaf, stack = (lambda make: make()), np.stack
    layers = [_layer_from_hf(cfg, get, i, leaf, stack) for i in range(cfg.num_hidden_layers)]
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    out = {"embed": leaf(lambda: get("model.embed_tokens.weight")), "layers": layers,
           "final_norm": leaf(lambda: get("model.norm.weight")), "lm_head": leaf(lambda: get(head).T)}
    if cfg.num_nextn_predict_layers:
        out["mtp"] = [{"enorm": leaf(lambda a=f"model.layers.{i}.": get(a + "enorm.weight")),
                       "hnorm": leaf(lambda a=f"model.layers.{i}.": get(a + "hnorm.weight")),
                       "eh_proj": leaf(lambda a=f"model.layers.{i}.": get(a + "eh_proj.weight").T),
                       "layer": _layer_from_hf(cfg, get, i, leaf, stack),
                       "head_norm": leaf(lambda a=f"model.layers.{i}.": get(a + "shared_head.norm.weight"))}
                      for i in mtp_layers(cfg)]
    return out


def params_to_tensors(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """The inverse of :func:`params_from_tensors`: HF names and layouts."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head"].T

    def mlp(prefix, p, e=None):
        sel = (lambda x: x[e]) if e is not None else (lambda x: x)
        out[prefix + "gate_proj.weight"] = sel(p["w_gate"]).T
        out[prefix + "up_proj.weight"] = sel(p["w_up"]).T
        out[prefix + "down_proj.weight"] = sel(p["w_down"]).T

    L = len(params["layers"])
    for i, lp in enumerate([*params["layers"], *(d["layer"] for d in params.get("mtp", ()))]):
        a = f"model.layers.{i}."
        if i >= L:                                # an MTP depth: its own tensors, the copies V3 stores
            d = params["mtp"][i - L]
            out.update({a + "enorm.weight": d["enorm"], a + "hnorm.weight": d["hnorm"],
                        a + "eh_proj.weight": d["eh_proj"].T, a + "shared_head.norm.weight": d["head_norm"],
                        a + "embed_tokens.weight": params["embed"], a + "shared_head.head.weight": params["lm_head"].T})
        s = a + "self_attn."
        at = lp["attn"]
        out[a + "input_layernorm.weight"] = lp["attn_norm"]
        out[a + "post_attention_layernorm.weight"] = lp["ffn_norm"]
        if "wq" in at:
            out[s + "q_proj.weight"] = at["wq"].reshape(D, -1).T
        else:
            out[s + "q_a_proj.weight"] = at["wq_a"].T
            out[s + "q_a_layernorm.weight"] = at["q_norm"]
            out[s + "q_b_proj.weight"] = at["wq_b"].reshape(at["wq_b"].shape[0], -1).T
        out[s + "kv_a_proj_with_mqa.weight"] = at["wkv_a"].T
        out[s + "kv_a_layernorm.weight"] = at["kv_norm"]
        kv_b = np.concatenate([np.asarray(at["wk_b"]), np.asarray(at["wv_b"])], axis=2)  # [C,H,K+V]
        out[s + "kv_b_proj.weight"] = kv_b.transpose(1, 2, 0).reshape(-1, kv_b.shape[0])
        out[s + "o_proj.weight"] = at["wo"].reshape(H * at["wo"].shape[1], D).T
        if "indexer" in at:
            out.update(dsa.indexer_to_hf(at["indexer"], s + "indexer."))
        m = a + "mlp."
        if "moe" in lp:
            p = lp["moe"]
            out[m + "gate.weight"] = p["router"].T
            if "router_bias" in p:
                out[m + "gate.e_score_correction_bias"] = p["router_bias"]
            for e in range(p["w_gate"].shape[0]):
                mlp(f"{m}experts.{e}.", p, e)
            if "shared" in p:
                mlp(m + "shared_experts.", p["shared"])
        else:
            mlp(m, lp["mlp"])
    return {k: np.ascontiguousarray(np.asarray(v)) for k, v in out.items()}


# ---- loading ----------------------------------------------------------------------------

def _index_key(index) -> tuple:
    """A hashable key of a ``make_array_from_callback`` index (a tuple of slices)."""
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


def _place(d, like, sharding):
    """One param as a global array in ``sharding``: each distinct part this process's devices
    hold is read once (a replicated tensor once, an expert part once for all the devices
    that replicate it) and no part another process holds is read. Never a cross-process
    collective: ``jax.device_put`` of a host array to a multi-process sharding would gather
    the whole tensor from every process to check it is the same everywhere."""
    parts: dict = {}

    def read(index):
        key = _index_key(index)
        if key not in parts:
            parts[key] = _host(d.read(index), like)
        return parts[key]
    return jax.make_array_from_callback(like.shape, sharding, read)


def _materialise(cfg: ModelConfig, lazy, mesh, rules):
    """Read the :class:`Deferred` params onto the default device or, with a mesh (one process's
    devices or many processes'), each straight into its sharding by :func:`_place`."""
    # shapes and dtypes (router_bias float32) of the params, from the model's own definition
    # (traced, so nothing is computed: the load runs no program, hence no collective)
    shapes = param_shapes(cfg)
    if mesh is None:
        return jax.tree.map(lambda d, like: jnp.asarray(_host(d.read(), like)), lazy, shapes)
    return jax.tree.map(_place, lazy, shapes, param_shardings(shapes, cfg, mesh, rules))


def _check_copies(cfg: ModelConfig, get, names, path: str) -> None:
    """The MTP layers' copies of the embedding and head equal the model's (pdjax shares them,
    as DeepSeek-V3 trains them)."""
    for name in names:
        main = MTP_COPIES[name.split(".", 3)[3]]
        main = "model.embed_tokens.weight" if main == "lm_head.weight" and cfg.tie_word_embeddings else main
        if not np.array_equal(get(name), get(main)):
            raise ValueError(f"tensor {name} of checkpoint {path} differs from {main}: pdjax shares the model's "
                             "embedding and head with its multi-token-prediction layers, so their copies must be "
                             "equal (load_hf(path, mtp=False) loads the model without them)")


def load_hf(path: str, dtype=None, *, mesh=None, rules=None, mtp: bool = True):
    """Load a HF DeepSeek-V2/V3 checkpoint directory. Returns (cfg, params).

    ``dtype``: the params' dtype (float32, bfloat16 or float16); default the checkpoint's own,
    the dtype of its embedding (block-FP8 weights are dequantised to it). The returned
    ``cfg.param_dtype`` is the dtype loaded; ``router_bias`` is float32 whatever it is.
    ``mesh`` (a jax.sharding.Mesh, with optional ``rules``: :class:`pdjax.parallel.ShardingRules`,
    mapping the logical axes the model declares for every weight): the params are placed as :func:`pdjax.parallel.shard_params` would place them, straight
    from the files with ``jax.make_array_from_callback``: each process reads only the parts
    its own devices hold (e.g. only its experts), each distinct part once, a replicated tensor
    once, and never one another process holds; the mesh may span processes
    (``jax.distributed``, :mod:`pdjax.cluster`), with no collective during the load. Without
    a mesh they go to the default device. Host memory holds one tensor (or its parts) at a
    time beyond the memory-mapped files.

    Before any tensor is read, raises ValueError naming the file, the tensor and the problem
    for a safetensors header the format does not allow (:class:`pdjax.model.hf_files.SafetensorsFile`),
    and naming the tensor or config.json field for a checkpoint that disagrees with its
    config.json (:mod:`pdjax.model.hf_checks`): layer or routed-expert counts, a missing or
    unexpected tensor, a shape, a stored dtype that is not a float (block-FP8 only with its
    ``weight_scale_inv``).

    The ``num_nextn_predict_layers`` multi-token-prediction layers config.json declares after
    the decoder's (layer 61 of V3) load into ``params["mtp"]`` (:mod:`pdjax.model.mtp`); the
    copies of the embedding and head they store must equal the model's (a ValueError names
    the one that differs). ``mtp=False`` leaves them out: the config returned then has
    ``num_nextn_predict_layers=0``.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a checkpoint directory (str or os.PathLike), got {path!r}")
    check_mesh(mesh)
    if dtype is not None:
        dtype_name(dtype, "load_hf dtype", PARAM_DTYPES)        # before reading anything
    path = os.fspath(path)
    cfg = load_hf_config(path)
    readers, where = open_checkpoint(path)
    left = check_checkpoint(cfg, path, readers, where, bool(mtp))
    if dtype is None:
        dtype = stored_dtype(path, readers, where)
    get = _getter(readers, where)
    if mtp:
        _check_copies(cfg, get, left, path)
    cfg = cfg.replace(param_dtype=dtype_name(dtype, "load_hf dtype", PARAM_DTYPES),
                      num_nextn_predict_layers=cfg.num_nextn_predict_layers if mtp else 0)
    lazy = params_from_tensors(cfg, get, lazy=True)
    return cfg, _materialise(cfg, lazy, mesh, rules)


# ---- saving -----------------------------------------------------------------------------

def save_hf(path: str, params, cfg: ModelConfig, max_shard_bytes: int | None = None) -> None:
    """Write params as a HF checkpoint (config.json + safetensors, sharded with an index
    when ``max_shard_bytes`` is given)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    write_safetensors(path, params_to_tensors(cfg, params), max_shard_bytes)


# ---- orbax -------------------------------------------------------------------------------
# A checkpoint written by N processes (each writes the shards it holds, its own
# ``ocdbt.process_i``; several hosts need a shared filesystem) restores in M processes: the
# target says the shapes, dtypes and shardings, orbax reads whatever parts each process needs.

def _replicated_everywhere():
    """Replicated over every device of the cluster: each process holds the whole array."""
    return jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("all",)),
                                      jax.sharding.PartitionSpec())


def _default_sharding():
    """Where a restored array goes when nothing says: the default device in one process,
    replicated over the cluster's devices in several (so every process holds it)."""
    if jax.process_count() == 1:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return _replicated_everywhere()


def _global(x):
    """A leaf orbax can write from every process: a jax array held by this process alone (a
    scalar step, an unsharded array) becomes the same array replicated over the cluster; it
    must hold the same value in every process. Global arrays and host values pass as they are."""
    if jax.process_count() == 1 or not isinstance(x, jax.Array) or not x.is_fully_addressable:
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, _replicated_everywhere(), lambda index: host[index])


def _checkpoint_path(path, saving: bool) -> str:
    """``path`` as an absolute path, checked before orbax starts: a str or os.PathLike; to
    save, nothing there yet and its parent a directory; to restore, a directory."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} {path!r}")
    path = os.path.abspath(os.fspath(path))
    if saving:
        if os.path.lexists(path):
            raise ValueError(f"path {path!r} already exists: save_params writes a new checkpoint directory")
        if not os.path.isdir(os.path.dirname(path)):
            raise ValueError(f"path {path!r}: its parent directory does not exist")
    elif not os.path.isdir(path):
        raise ValueError(f"path {path!r} is not a checkpoint directory "
                         f"({'a file' if os.path.exists(path) else 'nothing there'})")
    return path


def _check_leaves(params) -> None:
    """Every leaf an array or a number (what orbax can write), named by its key path."""
    for key, leaf in jax.tree_util.tree_leaves_with_path(params):
        ok = isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or (
            isinstance(leaf, (int, float)) and not isinstance(leaf, bool))
        if not ok:
            raise TypeError(f"params leaf {jax.tree_util.keystr(key)} is a {type(leaf).__name__}, "
                            f"not an array or a number")
    if not jax.tree.leaves(params):
        raise ValueError("params holds no arrays: nothing to save")


def save_params(path: str, params) -> None:
    """Save a params pytree with orbax (path must not exist). In a cluster every process calls
    it with the same tree of global arrays (e.g. sharded over a mesh spanning the processes,
    as :func:`load_hf` and ``init_params`` make them) and writes the shards it holds; a jax
    array held by one process only (a scalar) is saved replicated (the same value everywhere)."""
    import orbax.checkpoint as ocp

    path = _checkpoint_path(path, saving=True)
    _check_leaves(params)
    params = jax.tree.map(_global, params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), params)
        ckptr.wait_until_finished()


def _target(x, sharding):
    """The restore target of one leaf: a ShapeDtypeStruct in ``sharding`` (else the leaf's
    own, else :func:`_default_sharding`); a Python scalar as it is."""
    if not hasattr(x, "shape"):
        return x
    sharding = sharding or getattr(x, "sharding", None) or _default_sharding()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _saved_like(ckptr, path: str):
    """The saved tree with shapes and dtypes, from the checkpoint's metadata; scalars as
    scalars of their dtype."""
    import orbax.checkpoint as ocp

    meta = ckptr.metadata(path)
    if meta is None or getattr(meta, "item_metadata", None) is None:
        raise ValueError(f"path {path!r} holds no checkpoint written by save_params (no orbax metadata)")
    tree = meta.item_metadata.tree
    return jax.tree.map(lambda m: np.zeros((), m.dtype).item() if isinstance(m, ocp.metadata.ScalarMetadata)
                        else jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree,
                        is_leaf=lambda m: isinstance(m, ocp.metadata.Metadata))


def restore_params(path: str, like=None, sharding=None):
    """Restore params saved by :func:`save_params`, by any number of processes (N processes'
    checkpoint in M; in a cluster every process calls it).

    ``like``: a params pytree (or of jax.ShapeDtypeStruct) giving structure, shapes and
    dtypes (default: the checkpoint's own); ``sharding``: a single jax.sharding.Sharding or a
    pytree of them matching ``like``, the placement of the restored arrays, e.g.
    ``pdjax.parallel.param_shardings(like, cfg, mesh)`` on a mesh spanning processes (each
    process then reads only the parts its devices hold). Default: as ``like`` is placed,
    else the default device (in a cluster: replicated over every device).
    """
    import orbax.checkpoint as ocp

    path = _checkpoint_path(path, saving=False)
    if not (sharding is None or isinstance(sharding, jax.sharding.Sharding)):
        bad = [x for x in jax.tree.leaves(sharding) if not isinstance(x, jax.sharding.Sharding)]
        if bad or not jax.tree.leaves(sharding):
            raise TypeError(f"sharding must be a jax.sharding.Sharding or a pytree of them matching like, "
                            f"got {type(bad[0] if bad else sharding).__name__}")
    with ocp.StandardCheckpointer() as ckptr:
        if like is None:
            like = _saved_like(ckptr, path)
        if sharding is None or isinstance(sharding, jax.sharding.Sharding):
            target = jax.tree.map(lambda x: _target(x, sharding), like)
        else:
            target = jax.tree.map(_target, like, sharding)
        return ckptr.restore(path, target)
