"""Dual-batch overlap: identical results to the single-device model; the lowered program
interleaves the two micro-batches as the timeline model assumes; the timeline model against
hand-derived schedules."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdjax
from pdjax.parallel import DualBatchOverlap, dbo_gain, make_mesh, overlap_timeline

TOL = 1e-5


@pytest.mark.parametrize("axes", [{"data": 2, "expert": 4}, {"data": 1, "expert": 8}],
                         ids=["data2xexpert4", "data1xexpert8"])
def test_dbo_equals_single_device(tiny_cfg, tiny_params, case, axes):
    toks, full, pre, step = case
    mesh = make_mesh(axes)
    out = pdjax.forward(tiny_params, tiny_cfg, toks, mesh=mesh, overlap="dbo")
    np.testing.assert_allclose(out, full, atol=TOL, rtol=0)
    logits, cache = pdjax.prefill(tiny_params, tiny_cfg, toks[:, :5], max_len=8, mesh=mesh, overlap="dbo")
    np.testing.assert_allclose(logits, pre, atol=TOL, rtol=0)
    got, cache = pdjax.decode_step(tiny_params, tiny_cfg, toks[:, 5], cache, mesh=mesh, overlap="dbo")
    np.testing.assert_allclose(got, step, atol=TOL, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [6] * 16


def test_dbo_needs_two_divisible_halves(tiny_cfg, tiny_params):
    mesh = make_mesh({"data": 1, "expert": 8})
    with pytest.raises(ValueError, match="two halves"):
        pdjax.forward(tiny_params, tiny_cfg, np.zeros((8, 3), np.int32), mesh=mesh, overlap="dbo")
    with pytest.raises(ValueError, match="overlap"):
        pdjax.forward(tiny_params, tiny_cfg, np.zeros((8, 3), np.int32), mesh=mesh, overlap="tbo")


def test_timeline_serial_is_the_sum():
    t = overlap_timeline(2.0, 3.0, 0.5, 0.7, num_layers=5, dbo=False)
    assert t["makespan"] == pytest.approx(5 * (2.0 + 3.0 + 0.5 + 0.7))
    assert t["compute_busy"] == pytest.approx(5 * 5.0) and t["comm_busy"] == pytest.approx(5 * 1.2)


def test_timeline_dbo_hand_derived():
    # halves: A=1, D=.5, E=1, C=.5. compute: A0[0,1] A1[1,2] E0[2,3] E1[3,4];
    # comm: D0[1,1.5] D1[2,2.5] C0[3,3.5] C1[4,4.5]  -> 4.5 (serial 6)
    t = overlap_timeline(2.0, 2.0, 1.0, 1.0, num_layers=1, dbo=True)
    assert t["makespan"] == pytest.approx(4.5)


def test_dbo_gain_limits():
    assert dbo_gain(1.0, 0.0) == pytest.approx(1.0)        # nothing to hide
    assert dbo_gain(0.0, 1.0) == pytest.approx(1.0)        # nothing to hide behind
    gains = [dbo_gain(1.0, c) for c in (0.1, 0.5, 1.0, 2.0)]
    assert all(1.0 < g < 2.0 for g in gains)
    # the gain peaks near compute:communication = 1:1, where each stream can hide the other
    assert max(gains) == gains[2]


def test_timeline_bad_input():
    with pytest.raises(ValueError, match="t_dispatch"):
        overlap_timeline(1.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="num_layers"):
        overlap_timeline(1.0, 1.0, 1.0, num_layers=0)


# ---- program order: the lowered program interleaves the two micro-batches -----------------

_COLLECTIVE = re.compile(r"stablehlo\.(all_to_all|ragged_all_to_all|all_gather|all_reduce|reduce_scatter|"
                         r"collective_permute|collective_broadcast)\b")
_COMPUTE = re.compile(r"stablehlo\.(dot_general|dot|convolution)\b")


def _main_ops(module):
    """The ops directly in ``@main`` of a StableHLO module's text, in program order, as
    dicts: ``text`` (with nested regions), ``defs`` (result names), ``coll`` / ``compute``
    (contains a collective / a matmul, following calls), ``slice`` ((``%argN``, start on
    dim 0) for a ``stablehlo.slice`` of a function argument, else None)."""
    funcs, lines = {}, []
    for line in module.splitlines():
        m = re.match(r"  func\.func \w+ @([\w.$-]+)\(", line)
        if m:
            funcs[m.group(1)] = lines = []
        lines.append(line)

    def has(text, pat, seen=()):
        return bool(pat.search(text)) or any(
            has("\n".join(funcs[f]), pat, seen + (f,))
            for f in re.findall(r"@([\w.$-]+)", text) if f in funcs and f not in seen)

    ops = []
    for line in funcs["main"][1:]:
        if re.match(r"    [^ }]", line):          # a new op; deeper lines and "    }" continue it
            ops.append([line])
        elif ops and line.startswith("    "):
            ops[-1].append(line)
    out = []
    for op in ops:
        text = "\n".join(op)
        m = re.match(r"    (%\S+(?:, %\S+)*) = ", op[0])
        sl = re.match(r"    \S+ = stablehlo\.slice (%arg\d+) \[(\d+):", op[0])
        out.append(dict(text=text, defs=[d.split(":")[0] for d in m.group(1).split(", ")] if m else [],
                        coll=has(text, _COLLECTIVE), compute=has(text, _COMPUTE),
                        slice=(sl.group(1), int(sl.group(2))) if sl else None))
    return out


def _micro_batch_order(module, sources):
    """Each stream's order in the lowered program, named like ``overlap_timeline``'s events:
    {"compute": [...], "comm": [...]}.

    Micro-batch m's ops are those that depend (through their operands) on the m-th half of
    the ``sources`` arguments and not on the other's; its collectives alternate dispatch
    ``D{m}.{l}`` and combine ``C{m}.{l}`` (l: MoE layer), its compute (matmuls) splits into
    attention ``A{m}.{l}`` (feeds the dispatch, after the previous combine) and experts
    ``E{m}.{l}`` (between dispatch and combine). An attention phase counts as issued at its
    last matmul; an experts phase spans its first to last."""
    ops = _main_ops(module)
    where, half, anc = {}, [], []
    for k, op in enumerate(ops):
        refs = {where[r] for r in re.findall(r"%[\w.$-]+", op["text"]) if r in where}
        h = frozenset().union(*(half[r] for r in refs))
        a = 0
        for r in refs:
            a |= anc[r] | (1 << r)
        if op["slice"] and op["slice"][0] in sources:
            h = frozenset({0 if op["slice"][1] == 0 else 1})
        half.append(h)
        anc.append(a)
        where.update((d, k) for d in op["defs"])
    mixed = [k for k, op in enumerate(ops) if op["coll"] and len(half[k]) != 1]
    assert not mixed, f"{len(mixed)} collectives depend on both micro-batches (or on neither)"
    coll = {m: [k for k, op in enumerate(ops) if op["coll"] and half[k] == {m}] for m in (0, 1)}
    layers = len(coll[0]) // 2
    assert layers and len(coll[0]) == len(coll[1]) == 2 * layers, coll
    phases = {"compute": [], "comm": []}     # (first, last, name)
    for m in (0, 1):
        compute = [k for k, op in enumerate(ops) if op["compute"] and not op["coll"] and half[k] == {m}]
        for l in range(layers):
            d, c = coll[m][2 * l], coll[m][2 * l + 1]
            prev = coll[m][2 * l - 1] if l else None
            attn = [k for k in compute if anc[d] >> k & 1 and (prev is None or not anc[prev] >> k & 1)]
            experts = [k for k in compute if anc[k] >> d & 1 and anc[c] >> k & 1]
            assert attn and experts, (m, l)
            phases["compute"] += [(attn[-1], attn[-1], f"A{m}.{l}"), (experts[0], experts[-1], f"E{m}.{l}")]
            phases["comm"] += [(d, d, f"D{m}.{l}"), (c, c, f"C{m}.{l}")]
    order = {}
    for stream, ph in phases.items():
        ph.sort()
        for (_, last, a), (first, _, b) in zip(ph, ph[1:]):
            assert last < first, f"{a} and {b} interleave on the {stream} stream"
        order[stream] = [name for _, _, name in ph]
    return order


@pytest.mark.parametrize("dispatch", ["padded", "ragged-emulated"])
def test_dbo_program_interleaves_micro_batches(tiny_cfg, tiny_params, dispatch):
    """The lowered program (StableHLO, what jax hands XLA) issues each stream's ops in the
    order ``overlap_timeline(dbo=True)`` models: compute attn(0) attn(1) experts(0)
    experts(1), communication dispatch(0) dispatch(1) combine(0) combine(1), in every MoE
    layer, and no collective mixes the micro-batches. Running the halves one after the
    other computes the same outputs but fails here. (XLA's scheduler reorders by dataflow:
    XLA:CPU's scheduled HLO is the same for both orders, so this is the level to check.)"""
    ep = DualBatchOverlap(make_mesh({"data": 2, "expert": 4}), dispatch=dispatch)
    x = jnp.zeros((16, 2, tiny_cfg.hidden_size), tiny_cfg.compute_dtype)
    q_pos = jnp.zeros((16, 2), jnp.int32)

    def layers(x, q_pos, params):        # x, q_pos: %arg0, %arg1 of @main
        return ep.run_layers(params, tiny_cfg, x, q_pos, None, None, False)[0]

    module = jax.jit(layers).lower(x, q_pos, tiny_params).as_text()
    order = _micro_batch_order(module, {"%arg0", "%arg1"})
    moe_layers = sum("moe" in lp for lp in tiny_params["layers"])
    model = overlap_timeline(1.0, 1.0, 1.0, num_layers=moe_layers, dbo=True)["events"]
    assert order == {s: [name for st, name, _, _ in model if st == s] for s in ("compute", "comm")}
