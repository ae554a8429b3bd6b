"""Checkpoints across process counts on a local CPU cluster (2 processes x 4 simulated
devices): ``load_hf`` on meshes spanning both processes equals the one-process load with
each process reading only the tensors its devices hold, and orbax checkpoints written by 2
processes restore in 1 and back, exactly and in the sharding asked for."""

import collections
import io
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdjax
from pdjax.cluster import LaunchError, launch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import checkpoint_script as cs  # noqa: E402


def _launch(mode, d):
    stream = io.StringIO()
    try:
        launch([sys.executable, os.path.join(HERE, "checkpoint_script.py"), mode, str(d)], 2, 4,
               timeout_s=90.0, stream=stream)
    except LaunchError as e:
        pytest.fail(f"{e}\n{stream.getvalue()[-3000:]}")


def _expert(name):
    """The routed expert a tensor belongs to (``...mlp.experts.5.up_proj.weight``), else None."""
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


def _held(name, process):
    """The routed experts process ``process``'s devices hold on mesh ``name`` (every expert
    unless the experts' mesh axes cross the processes)."""
    axes, experts = cs.MESHES[name]
    if axes["data"] == 2 and experts is None:
        return set(range(8))
    return set(range(4 * process, 4 * process + 4))


def test_load_hf_on_meshes_spanning_two_processes(tmp_path):
    """On the (2, 4) data x expert mesh (default rules: experts over "expert", so each
    process holds all 8), the same mesh with the experts over both axes (EP 8) and the
    (1, 8) mesh, the params loaded by 2 processes equal this process's load leaf by leaf,
    exactly, in the same shardings, spanning both processes. Each process reads each tensor
    part it holds once, as the one-process load does, and nothing else: with the experts
    split over the processes, only its own experts, less than the whole checkpoint and
    fewer files (the checkpoint is 26 files). And no program runs during the load (no
    collective: ``jax.device_put`` of a host array to a multi-process sharding would compare
    it across the processes)."""
    cfg = pdjax.configs.tiny()
    pdjax.save_hf(str(tmp_path / "hf"), pdjax.init_params(cfg, jax.random.key(0)), cfg, max_shard_bytes=40_000)
    files = [f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]
    _launch("load", tmp_path)
    got = np.load(tmp_path / "load.npz")
    info = [json.load(open(tmp_path / f"reads{p}.json")) for p in (0, 1)]
    for name in cs.MESHES:
        mesh, rules = cs.mesh_and_rules(pdjax, name)
        with cs.counting_reads() as reads:
            _, params = pdjax.load_hf(str(tmp_path / "hf"), mesh=mesh, rules=rules)
        for leaf, want in cs.flat(params, name + " ").items():
            np.testing.assert_array_equal(got[leaf], np.asarray(want), err_msg=leaf)
            spec, processes = info[0][name]["where"][leaf]
            assert (spec, processes) == (str(tuple(want.sharding.spec)), [0, 1]), leaf
        one = collections.Counter(map(tuple, reads))
        total = sum(n for _, _, n in reads)
        for p in (0, 1):
            assert info[p][name]["programs"] == [], (name, p)     # no computation: no collective
            mine = collections.Counter(map(tuple, info[p][name]["reads"]))
            held = collections.Counter({r: c for r, c in one.items() if _expert(r[1]) in _held(name, p) | {None}})
            assert mine == held, (name, p, mine - held, held - mine)
            if name != "2x4":
                assert sum(n for _, _, n in mine) < total and len({f for f, _, _ in mine}) < len(files)
    assert len(got.files) == 3 * len(cs.flat(params))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # orbax, after that error
def test_orbax_checkpoints_between_one_and_two_processes(tmp_path):
    """1 -> 2: params saved here restore on the (2, 4) mesh of 2 processes (experts over both
    axes) in exactly the shardings asked for, and with no ``like`` replicated on every
    device; 2 -> 1: params the 2 processes made on that mesh and saved (each writing its own
    experts, plus a host-local scalar step saved replicated) restore here exactly, on a
    mesh and, with no ``like``, on the default device; a checkpoint without one process's
    files does not restore."""
    cfg = pdjax.configs.tiny()
    mesh, rules = cs.mesh_and_rules(pdjax, "2x4 ep8")
    ref = pdjax.init_params(cfg, jax.random.key(0), mesh=pdjax.parallel.make_mesh({"data": 2, "expert": 4}))
    pdjax.save_params(str(tmp_path / "one"), ref)
    _launch("orbax", tmp_path)
    got = np.load(tmp_path / "restored.npz")
    where = json.load(open(tmp_path / "orbax0.json"))
    sharding = pdjax.parallel.param_shardings(ref, cfg, mesh, rules)
    for leaf, want in cs.flat(ref).items():
        np.testing.assert_array_equal(got["restored " + leaf], np.asarray(want), err_msg=leaf)
        np.testing.assert_array_equal(got["default " + leaf], np.asarray(want), err_msg=leaf)
        assert where["restored"]["restored " + leaf] == [str(tuple(cs.flat(sharding)[leaf].spec)), [0, 1]], leaf
        assert where["default"]["default " + leaf] == ["()", [0, 1]], leaf
    assert len(got.files) == 2 * len(cs.flat(ref))

    two = pdjax.init_params(cfg, jax.random.key(1))
    like = {"params": two, "step": jnp.asarray(0, jnp.int32)}
    restored = pdjax.restore_params(str(tmp_path / "two"), like=like,
                                    sharding={"params": sharding, "step": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())})
    plain = pdjax.restore_params(str(tmp_path / "two"))
    for tree in (restored, plain):
        assert int(tree["step"]) == 7
        for leaf, want in cs.flat(two).items():
            np.testing.assert_array_equal(np.asarray(cs.flat(tree["params"])[leaf]), np.asarray(want), err_msg=leaf)
    for leaf, x in cs.flat(restored["params"]).items():
        assert x.sharding == cs.flat(sharding)[leaf], leaf
    assert all(x.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0]) for x in jax.tree.leaves(plain))

    shutil.copytree(tmp_path / "two", tmp_path / "dropped")
    shutil.rmtree(tmp_path / "dropped" / "ocdbt.process_1")
    with pytest.raises(Exception, match="error while reading"):      # orbax's error; never zeros
        pdjax.restore_params(str(tmp_path / "dropped"), like=like)
