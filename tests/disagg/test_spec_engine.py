"""MTP speculative decoding in the serving engines (``speculative="mtp"``): PDEngine and
ColocatedEngine emit plain greedy's tokens, with drafts mostly rejected (random params) and
mostly accepted (a model trained on counting sequences); the paged cache keeps exactly the
verified rows (a rejected draft's row is rolled back, no block moves or leaks); the handoff
carries the MTP layer's rows; sampling keeps the target distribution (chi-square)."""

import collections

import jax
import numpy as np
import pytest
from scipy import stats as scipy_stats

import pdjax
from faults import assert_nothing_held, free_blocks
from mtp_models import counting_model, counting_sequences
from pdjax.disagg import AFDEngine, ColocatedEngine, PDEngine, SamplingParams
from pdjax.disagg.prefill import PrefillPool
from pdjax.disagg.prefix_store import PrefixStore
from pdjax.disagg.request import Request

CFG = pdjax.configs.tiny(num_nextn_predict_layers=1)
PROMPTS = [[5, 9, 200, 31, 7, 7, 64], [3], [250, 1, 2, 3], [17, 4], list(range(40, 56))]
NEW = 8


@pytest.fixture(scope="module")
def random_params():
    return pdjax.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def trained_params():
    params, loss = counting_model(CFG)
    assert loss < 0.1
    return params


def _colocated(params, **kw):
    return ColocatedEngine(params, CFG, devices=jax.devices()[:4], mesh={"expert": 4}, max_context=64,
                           speculative="mtp", **kw)


def _pd(params, **kw):
    """Prefill on 2 devices in 8-token chunks; decode on 4 (2 DP ranks x EP 2)."""
    return PDEngine(params, CFG, prefill_devices=jax.devices()[:2], decode_devices=jax.devices()[2:6],
                    decode_mesh={"data": 2, "expert": 2}, max_context=64, prefill_chunk_tokens=8,
                    speculative="mtp", **kw)


def _watch_rows(eng) -> list:
    """Wrap the decode pool's step: after each, every running slot's cached rows (on the
    device) must be its prompt plus the tokens emitted but the last (whose row the next step
    writes): a kept rejected row, or a token counted twice, breaks it. Returns a Counter of
    the decode steps each request (by index) took part in."""
    pool, seen = eng.decode, collections.Counter()
    step = pool.step

    def checked():
        out = step()
        lengths = jax.device_get(pool.cache.lengths)
        for s, toks in out.items():
            req = pool.slot_req[s].request
            emitted = len(req.output) + len(toks)
            assert lengths[s] == pool.kv_len[s] == len(req.prompt) + emitted - 1, (s, lengths[s], req, toks)
        seen.update(pool.slot_req[s].request.index for s in out)
        return out
    pool.step = checked
    return seen


def _spec_reference(params, prompts):
    want = pdjax.generate(params, CFG, prompts, max_new_tokens=NEW)
    got, st = pdjax.generate(params, CFG, prompts, max_new_tokens=NEW, speculative="mtp", return_stats=True)
    assert got == want and st["near_ties"] == 0
    return want, st


@pytest.mark.parametrize("make", [_colocated, _pd], ids=["colocated", "pd"])
def test_rejected_drafts_change_nothing(random_params, make):
    """Random params: nearly every draft is rejected, so nearly every step rolls a row back."""
    want, st = _spec_reference(random_params, PROMPTS)
    eng = make(random_params)
    free = free_blocks(eng)
    steps = _watch_rows(eng)
    assert eng.generate(PROMPTS, NEW) == want
    assert_nothing_held(eng, free)
    # the same drafts verified and accepted as pdjax.generate's speculative loop
    assert (eng.stats["drafts"], eng.stats["accepted"]) == (st["drafts"], round(st["accept_rate"] * st["drafts"]))
    assert eng.stats["accept_rate"] < 0.2 and steps


def test_the_handoff_carries_the_mtp_layer(random_params):
    """Every prompt's rows of every main layer and of the MTP layer cross the link once."""
    eng = _pd(random_params)
    eng.generate(PROMPTS, 2)
    row = CFG.kv_latent_dim * np.dtype(CFG.kv_cache_dtype).itemsize
    assert eng.stats["kv_bytes_sent"] == sum(map(len, PROMPTS)) * (CFG.num_hidden_layers + 1) * row


@pytest.mark.parametrize("make", [_colocated, _pd], ids=["colocated", "pd"])
def test_accepted_drafts_emit_two_tokens_a_step_and_change_nothing(trained_params, make):
    prompts = counting_sequences(CFG, ((3, 5), (100, 2), (250, 7), (60, 12)))
    want, st = _spec_reference(trained_params, prompts)
    assert want[0][:4] == [8, 9, 10, 11] and st["accept_rate"] > 0.9
    eng = make(trained_params)
    free = free_blocks(eng)
    steps = _watch_rows(eng)
    assert eng.generate(prompts, NEW) == want
    assert_nothing_held(eng, free)
    assert eng.stats["accept_rate"] > 0.9 and eng.stats["tokens_per_step"] > 1.9
    # about half the steps of plain decoding: the prefill's token, then two a step
    assert sum(steps.values()) == eng.stats["drafts"] <= len(prompts) * ((NEW - 1) / 2 + 1), steps


def test_stop_tokens_and_limits_cut_a_two_token_step(trained_params):
    """A step that emits two tokens past a stop token or the request's limit: only what
    plain decoding would have emitted is kept."""
    prompts = counting_sequences(CFG, ((3, 5), (100, 2)))
    eng = _colocated(trained_params)
    free = free_blocks(eng)
    out = eng.generate(prompts, [4, 5], stop_tokens=[103])
    assert out == [[8, 9, 10, 11], [102, 103]]
    assert_nothing_held(eng, free)


def test_a_cached_prefix_gives_the_rows_and_draft_of_a_whole_prefill(trained_params):
    """Prompt A stores its blocks; prompt B shares its first two blocks (16 tokens) and then
    differs. B prefilled from the cache gives every layer's rows (the MTP layer's too) and the
    draft that B prefilled whole gives, and sends each row once. The cached MTP row of
    position 15 was made with A's token 16 (the token after it), not B's: the prefill reruns
    that position."""
    L = CFG.num_hidden_layers
    pool = PrefillPool(trained_params, CFG, jax.devices()[:2], {"expert": 2}, speculative="mtp")
    store = PrefixStore(CFG, 8, device_blocks=0, host_blocks=16, dtype=CFG.kv_cache_dtype, device=pool.replicated,
                        layers=L + 1)
    a = counting_sequences(CFG, ((3, 20),))[0]
    b = a[:16] + [100, 101, 102, 103]
    store.insert(a, pool.run(Request(0, a, 1), lambda *args: None)[1])
    whole = Request(1, b, 1)
    first, rows = pool.run(whole, lambda *args: None)
    sent = collections.defaultdict(list)
    cached = Request(2, b, 1)
    P = store.lookup(b)
    got_first, got = pool.run(cached, lambda l, r, s: sent[l].append((s, np.asarray(r))),
                              (P, store.load(b, P, pool.replicated)), chunk=3)
    assert P == 16 and (got_first, cached.mtp_draft) == (first, whole.mtp_draft) and len(got) == L + 1
    for l in range(L + 1):
        np.testing.assert_allclose(np.asarray(got[l]), np.asarray(rows[l]), atol=2e-5, err_msg=f"layer {l}")
        starts = [s for s, _ in sent[l]]
        assert starts[0] == 0 and sum(len(r) for _, r in sent[l]) == len(b)
        np.testing.assert_allclose(np.concatenate([r for _, r in sent[l]]), np.asarray(rows[l]), atol=2e-5)
    assert cached.prefill_chunks[0] == 3 and sum(cached.prefill_chunks) == len(b) - P + 1


def test_speculative_serving_with_the_prefix_cache(trained_params):
    """Prefix cache on: the second round of the same prompts hits the cache and gives plain
    greedy's tokens and the same drafts accepted as pdjax.generate."""
    prompts = counting_sequences(CFG, ((3, 20), (3, 18), (40, 17)))
    prompts[1][16:] = [100, 101]                         # shares two blocks with prompt 0, then differs
    want, st = _spec_reference(trained_params, prompts)
    eng = _pd(trained_params, prefix_cache=True, block_size=8)
    free = free_blocks(eng)
    for round_ in range(2):
        assert eng.generate(prompts, NEW) == want, round_
        assert (eng.stats["drafts"], eng.stats["accepted"]) == (st["drafts"], round(st["accept_rate"] * st["drafts"]))
    assert [r["prefix_hit_tokens"] for r in eng.stats["requests"]] == [16, 16, 16]
    assert_nothing_held(eng, free)


def test_bad_speculative_options_are_refused(random_params):
    plain_cfg = CFG.replace(num_nextn_predict_layers=0)
    plain = {k: v for k, v in random_params.items() if k != "mtp"}
    with pytest.raises(ValueError, match="speculative must be None or 'mtp'"):
        ColocatedEngine(random_params, CFG, devices=jax.devices()[:2], speculative="eagle")
    with pytest.raises(ValueError, match="needs an MTP module"):
        ColocatedEngine(plain, plain_cfg, devices=jax.devices()[:2], speculative="mtp")
    with pytest.raises(ValueError, match="AFDEngine"):
        AFDEngine(random_params, CFG, attention_devices=jax.devices()[:2], ffn_devices=jax.devices()[2:4],
                  speculative="mtp")


# ---- sampling ---------------------------------------------------------------------------

SMALL = CFG.replace(vocab_size=8)


def test_speculative_sampling_keeps_the_target_distribution():
    """A vocabulary of 8, temperature 0.8, 240 seeds of one prompt: the engine's first three
    tokens (the prefill's, then the speculative steps') have the model's distribution. The
    exact joint law of (t1, t2) and of (t2, t3) comes from the model's logits after every
    continuation; chi-square over the 64 cells of each."""
    params = pdjax.init_params(SMALL, jax.random.key(3))
    prompt, T, n = [1, 5, 2], 0.8, 240
    eng = ColocatedEngine(params, SMALL, devices=jax.devices()[:2], mesh={"expert": 2}, max_context=16,
                          max_decode_slots=16, speculative="mtp")
    out = eng.generate([prompt] * n, 3, sampling=[SamplingParams(temperature=T, seed=s) for s in range(n)])
    assert 0.05 < eng.stats["accept_rate"] < 0.95          # both the accepted and the redrawn paths ran
    V = SMALL.vocab_size
    cont = np.array([[a, b] for a in range(V) for b in range(V)], np.int32)          # every (t1, t2)
    tokens = np.concatenate([np.tile(prompt, (len(cont), 1)), cont], axis=1)
    logits = np.asarray(pdjax.forward(params, SMALL, tokens), np.float64) / T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    p1 = probs[0, len(prompt) - 1]                                   # P(t1)
    p2 = probs[::V, len(prompt)]                                     # P(t2 | t1), rows t1
    p3 = probs[:, len(prompt) + 1].reshape(V, V, V)                  # P(t3 | t1, t2)
    joint12 = p1[:, None] * p2
    joint23 = np.einsum("ab,abc->bc", joint12, p3)
    for cells, law in (([(o[0], o[1]) for o in out], joint12), ([(o[1], o[2]) for o in out], joint23)):
        counts = collections.Counter(cells)
        observed = np.array([counts[(a, b)] for a in range(V) for b in range(V)])
        assert scipy_stats.chisquare(*_pooled(observed, law.reshape(-1) * n)).pvalue > 1e-3


def _pooled(observed, expected, least: float = 5.0):
    """The cells expected at least ``least`` times, and the rest pooled into one (the
    chi-square approximation needs expected counts of about 5 or more)."""
    big = expected >= least
    return (np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum()))
