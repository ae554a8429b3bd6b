"""PD disaggregation on 8 CPU devices: PDEngine, ColocatedEngine and pdjax.generate produce
identical tokens; the KV handed off is exactly the latent rows; faults lose nothing."""

import jax
import numpy as np
import pytest

import pdjax
from pdjax.disagg import ColocatedEngine, PDEngine, RequestError, SamplingParams
from pdjax.disagg.prefill import bucket

from faults import Fault, FaultyLink, SlowLink, corrupt_block


@pytest.fixture(scope="module")
def prompts(pd_prompts):
    return pd_prompts


@pytest.fixture(scope="module")
def expected(pd_expected):
    return pd_expected


@pytest.fixture(scope="module")
def pd(tiny_cfg, tiny_params):
    return PDEngine(tiny_params, tiny_cfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:],
                    prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2}, block_size=16,
                    max_decode_slots=4, max_context=256)


def test_pd_equals_generate_and_sends_exact_latent_bytes(tiny_cfg, pd, prompts, expected):
    out = pd.generate(prompts, max_new_tokens=5)
    assert out == expected
    itemsize = 4
    want = sum(len(p) for p in prompts) * tiny_cfg.kv_latent_dim * tiny_cfg.num_hidden_layers * itemsize
    assert pd.stats["kv_bytes_sent"] == want
    for p, r in zip(prompts, pd.stats["requests"]):
        assert r["kv_bytes_sent"] == len(p) * (tiny_cfg.kv_lora_rank + tiny_cfg.qk_rope_head_dim) \
            * tiny_cfg.num_hidden_layers * itemsize
        assert r["ttft"] > 0 and r["new_tokens"] == 5 and r["error"] is None


def test_colocated_equals_generate_with_and_without_prefix_hits(tiny_cfg, tiny_params, prompts, expected):
    """The prefix cache on: the first run computes every prefix but one (the second prompt of
    the shared 40-token prefix hits two blocks), the second hits every full block; bad
    requests then fail alone beside good ones."""
    col = ColocatedEngine(tiny_params, tiny_cfg, devices=jax.devices()[:4], mesh={"expert": 4},
                          max_decode_slots=4, max_context=256, prefix_cache=True)
    # the params are on the devices once: both pools use the same buffers
    for a, b in zip(jax.tree.leaves(col.prefill.params), jax.tree.leaves(col.decode.params)):
        assert [s.data.unsafe_buffer_pointer() for s in a.addressable_shards] == \
            [s.data.unsafe_buffer_pointer() for s in b.addressable_shards]
    assert col.generate(prompts, max_new_tokens=5) == expected
    assert col.stats["kv_bytes_sent"] == 0
    assert [r["prefix_hit_tokens"] for r in col.stats["requests"]] == [0] * 7 + [32]
    assert col.generate(prompts, max_new_tokens=5) == expected
    assert [r["prefix_hit_tokens"] for r in col.stats["requests"]] == [((len(p) - 1) // 16) * 16 for p in prompts]
    # bad requests fail alone on the colocated engine too
    out = col.generate([prompts[1], [], [[1, 2], [3, 4]], [tiny_cfg.vocab_size], prompts[3]], max_new_tokens=5)
    assert out[0] == expected[1] and out[4] == expected[3]
    for i, says in ((1, "empty prompt"), (2, "flat list"), (3, "outside")):
        assert isinstance(out[i], RequestError) and says in str(out[i]), (i, out[i])


def test_bad_requests_fail_alone(pd, tiny_cfg, prompts, expected):
    batch = [prompts[1], [], [tiny_cfg.vocab_size], prompts[3], [1] * 300]
    out = pd.generate(batch, max_new_tokens=5)
    assert out[0] == expected[1] and out[3] == expected[3]
    assert isinstance(out[1], RequestError) and "empty prompt" in str(out[1])
    assert isinstance(out[2], RequestError) and "outside" in str(out[2])
    assert isinstance(out[4], RequestError) and "exceeds the context" in str(out[4])
    bad = pd.generate([prompts[1], prompts[1]], max_new_tokens=[0, 5])
    assert isinstance(bad[0], RequestError) and bad[1] == expected[1]
    # nothing coerced: nested, float, string, bool and non-list prompts, a bool count
    batch = [[[1, 2], [3, 4]], prompts[1], [2.9, 7], ["5", 7], [True, 3], 5, prompts[3], [[1, 2], [3]]]
    out = pd.generate(batch, max_new_tokens=[5, 5, 5, 5, 5, 5, True, 5])
    assert out[1] == expected[1]
    for i, says in ((0, "flat list"), (2, "float64"), (3, "<U"), (4, "bool"), (5, "got int"),
                    (6, "max_new_tokens must be a positive integer, got True"), (7, "ragged")):
        assert isinstance(out[i], RequestError) and says in str(out[i]), (i, out[i])


def test_failed_handoff_is_reprefilled(pd, prompts, expected):
    link = pd.link
    pd.link = FaultyLink(link, [Fault("fail", layer=1, request=i) for i in range(4)])
    try:
        out = pd.generate(prompts[:4], max_new_tokens=5)
    finally:
        pd.link = link
    assert out == expected[:4]
    assert [r["prefill_attempts"] for r in pd.stats["requests"]] == [2] * 4


def test_full_decode_pool_applies_back_pressure(tiny_cfg, tiny_params, prompts, expected):
    # 2 ranks x 3 blocks (1 scratch): each rank holds one request of <= 32 tokens at a time
    eng = PDEngine(tiny_params, tiny_cfg, prefill_devices=jax.devices()[:2], decode_devices=jax.devices()[2:4],
                   prefill_mesh={"expert": 2}, decode_mesh={"data": 2}, block_size=16, max_decode_slots=2,
                   max_context=64, num_blocks=3)
    small = [p for p in prompts if len(p) + 5 <= 32]
    want = [e for p, e in zip(prompts, expected) if len(p) + 5 <= 32]
    assert len(small) > 2
    assert eng.generate(small, max_new_tokens=5) == want
    # the scheduler refused reservations while both ranks were full, and every request after
    # the first two waited for a release before its prefill could start
    assert eng.stats["pool_full"] > 0
    waits = [r["reserve_wait_s"] for r in eng.stats["requests"]]
    assert waits[:2] == [0.0, 0.0] and all(w > 0 for w in waits[2:]), waits
    # from the scheduler's own record: request i >= 2 was refused (pool full) and its prefill
    # started only after i - 1 requests had finished and freed their blocks
    trace = [(what, i) for _, what, i in eng.stats["trace"]]
    for i in range(2, len(small)):
        start = trace.index(("StartPrefill", i))
        assert ("PoolFull", i) in trace[:start]
        assert sum(what == "Finished" for what, _ in trace[:start]) >= i - 1, (i, trace[:start])


def test_sampling_is_per_request_and_reproducible(pd, prompts):
    sp = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(3)]
    a = pd.generate(prompts[:3], max_new_tokens=4, sampling=sp)
    b = pd.generate(prompts[:3][::-1], max_new_tokens=4, sampling=sp[::-1])
    assert a == b[::-1]


def test_stop_tokens_and_streaming(pd, prompts, expected):
    seen = []
    stop = expected[0][2]
    out = pd.generate([prompts[0]], max_new_tokens=5, stop_tokens=(stop,),
                      on_token=lambda i, t: seen.append((i, t)))
    first_stop = expected[0].index(stop)
    assert out[0] == expected[0][: first_stop + 1]
    assert seen == [(0, t) for t in out[0]]


def test_engine_config_errors(tiny_cfg, tiny_params):
    with pytest.raises(ValueError, match="disjoint"):
        PDEngine(tiny_params, tiny_cfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[3:7])
    with pytest.raises(ValueError, match="max_decode_slots=3"):
        PDEngine(tiny_params, tiny_cfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:],
                 decode_mesh={"data": 2, "expert": 2}, max_decode_slots=3)


def test_prefill_bucket():
    assert [bucket(n, 4) for n in (1, 16, 17, 200)] == [16, 16, 32, 256]
    assert bucket(5, 3) == 18


def test_prefix_cache_hits_and_identical_tokens(tiny_cfg, tiny_params, prompts, expected):
    eng = PDEngine(tiny_params, tiny_cfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:],
                   prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2}, block_size=16,
                   max_decode_slots=4, max_context=256, prefix_cache={"device_blocks": 4, "host_blocks": 64})
    assert eng.generate(prompts, max_new_tokens=5) == expected
    first = eng.stats["requests"]
    # the second prompt with the 40-token system prefix hits its first two full blocks
    assert [r["prefix_hit_tokens"] for r in first][-2:] == [0, 32]
    again = eng.generate(prompts, max_new_tokens=5)
    assert again == expected
    hits = [r["prefix_hit_tokens"] for r in eng.stats["requests"]]
    assert hits == [((len(p) - 1) // 16) * 16 for p in prompts]          # every full block but the last token
    itemsize = 4
    assert eng.stats["kv_bytes_sent"] == sum(len(p) for p in prompts) * tiny_cfg.kv_latent_dim \
        * tiny_cfg.num_hidden_layers * itemsize

    # a corrupted block: checksum mismatch, the prefix is recomputed, tokens unchanged
    big = prompts[2]
    corrupt_block(eng.store, eng.store.hashes(big)[0])
    out = eng.generate([big], max_new_tokens=5)
    assert out == [expected[2]]
    r = eng.stats["requests"][0]
    assert r["prefix_hit_tokens"] == 0
    assert len(r["prefix_errors"]) == 1 and "failed its checksum" in r["prefix_errors"][0]
    assert eng.store.stats["corrupt_blocks"] == 1


def test_layer_transfer_overlaps_next_layer_compute(tiny_cfg, pd, prompts, expected, tmp_path):
    """The engine's own handoff, over a link slower than the compute (each copy takes ~0.1 s
    of device time): the prefill worker sends layer l as soon as layer l is dispatched and
    goes on to layer l+1 without waiting for the copy, which is still in flight when layer
    l+1 is dispatched (a serialised handoff, waiting for each copy, fails the last assertion)."""
    from pdjax.disagg.device_spans import DeviceSpans
    link = pd.link
    pd.link = SlowLink(link)
    try:
        assert pd.generate([prompts[2]], max_new_tokens=5) == [expected[2]]   # compiled: time the ops only
        pd.timeline = tl = DeviceSpans()
        assert pd.generate([prompts[2]], max_new_tokens=5) == [expected[2]]
    finally:
        pd.link, pd.timeline = link, None
    tl.wait()
    L = tiny_cfg.num_hidden_layers
    assert all(s["ready"] is not None for s in tl.spans)
    pairs = [(tl.span("kv transfer", f"layer {l}"), tl.span("prefill compute", f"layer {l + 1}")) for l in range(L - 1)]
    assert all(xfer["issued"] <= nxt["issued"] for xfer, nxt in pairs)
    assert all(nxt["issued"] < xfer["ready"] for xfer, nxt in pairs), pairs
    trace = tl.to_chrome_trace(str(tmp_path / "handoff_trace.json"))
    assert sum(e.get("ph") == "X" for e in trace["traceEvents"]) == 2 * L


def test_a_cold_prefill_says_it_is_compiling_once(pd, tiny_cfg, monkeypatch, capsys):
    """A prompt length whose prefill programs this engine has not run prints one progress
    line (here at once: the threshold set to 0); the same length again prints nothing."""
    import pdjax.compilation

    monkeypatch.setattr(pdjax.compilation, "progress_after_s", 0.0)
    warm = {k[1] for k in pd.prefill._warm if k[0] == "embed"}
    T = next(n for n in range(17, 250) if bucket(n, pd.prefill.size) not in warm)
    prompt = [int(t) for t in np.random.RandomState(5).randint(0, tiny_cfg.vocab_size, T)]
    capsys.readouterr()
    pd.generate([prompt], max_new_tokens=2)
    err = capsys.readouterr().err
    assert err.count("pdjax: compiling the prefill's programs for a new prompt length...") == 1, err
    pd.generate([prompt], max_new_tokens=2)
    assert "pdjax: compiling" not in capsys.readouterr().err
