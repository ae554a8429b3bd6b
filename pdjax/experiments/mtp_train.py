"""A small byte-level model with one MTP depth, trained until its drafts are worth verifying:
what the ``mtp_speculative`` experiment and ``benchmarks/mtp_decode.py`` share.

* Corpus (:func:`corpus`): the Python standard library's own source, the sorted top-level
  ``*.py`` files beside ``os.py`` concatenated, cut at ``corpus_mb`` MB; the last ``holdout``
  of it is kept out of training (:func:`split`).
* Model (:func:`model_config`): ``tiny`` scaled to hidden ``width`` and ``layers`` layers (the
  first dense), vocab 256 (bytes), one MTP depth.
* Training (:func:`train`): random windows of ``seq`` bytes, ``pdjax.loss(...,
  mtp_weight=MTP_WEIGHT)``, optax adamw with a linear warm-up and cosine decay to a tenth,
  gradients clipped to global norm 1. With the defaults (:class:`Training`) about 9 minutes
  on 2 CPU cores: held-out CE ~1.46 nats/byte, and depth 1's draft equals the model's own
  greedy token at ~0.78 of held-out positions (:func:`agreement`).
* Cache (:func:`trained_params`): the params go to an ``.npz`` holding the settings that made
  them (:func:`settings`: the model config, the training keys, the corpus size and the Python
  version whose standard library it is); a later call with the same settings loads them.

jax and optax are imported in the functions that use them (``pdjax list`` reads the schemas).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import sys
import time
from typing import Callable, Optional

import numpy as np

import pdjax.configs
from pdjax.experiments import progress
from pdjax.experiments.schema import knob

#: the MTP loss weight of training (``pdjax.loss(..., mtp_weight=...)``)
MTP_WEIGHT = 0.3
#: the keys of :class:`Training` that determine the params, besides the model config
SETTINGS = ("steps", "batch", "seq", "lr", "warmup", "seed", "corpus_mb", "holdout")


@dataclasses.dataclass(frozen=True)
class Training:
    """The model (hidden ``width``, ``layers`` decoder layers) and its training: ``steps`` of
    ``batch`` random windows of ``seq`` bytes, peak learning rate ``lr`` after ``warmup``
    steps, ``seed``; the corpus: at most ``corpus_mb`` MB, the last ``holdout`` held out."""

    width: int = knob(96, minimum=16)
    layers: int = knob(4, minimum=1)
    steps: int = knob(450, minimum=1)
    batch: int = knob(32, minimum=1)
    seq: int = knob(128, minimum=3)
    lr: float = knob(3e-3, above=0)
    warmup: int = knob(50, minimum=0)
    seed: int = 0
    corpus_mb: float = knob(3.0, above=0)
    holdout: float = knob(0.05, above=0)

    def __post_init__(self):
        if self.width % 16:
            raise ValueError(f"width: must be a multiple of 16 (the RoPE dims are width / 8, paired), "
                             f"got {self.width}")
        if self.holdout >= 1:
            raise ValueError(f"holdout: must be < 1 (a fraction of the corpus), got {self.holdout!r}")
        held = int(self.corpus_mb * 2**20 * self.holdout)
        if held <= self.seq:
            raise ValueError(f"holdout: the held-out bytes ({held} of corpus_mb={self.corpus_mb}) must exceed "
                             f"seq={self.seq} (the held-out windows)")


# ---- corpus ------------------------------------------------------------------------------

def corpus(max_mb: float) -> tuple[np.ndarray, list[str]]:
    """The standard library's top-level ``*.py`` files (sorted by name) as one int32 array of
    bytes, cut at ``max_mb`` MB; (bytes, the file names used)."""
    root = os.path.dirname(os.__file__)
    parts, names, size = [], [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        parts.append(data + b"\n\n")
        names.append(os.path.basename(path))
        size += len(data) + 2
        if size >= max_mb * 2**20:
            break
    data = np.frombuffer(b"".join(parts), np.uint8)[: int(max_mb * 2**20)]
    return data.astype(np.int32), names


def split(data: np.ndarray, holdout: float) -> tuple[np.ndarray, np.ndarray]:
    """(training bytes, held-out bytes): the last ``holdout`` fraction held out."""
    cut = int(len(data) * (1 - holdout))
    return data[:cut], data[cut:]


def windows(data: np.ndarray, rng, n: int, length: int) -> np.ndarray:
    """``n`` random windows [n, length] of ``data``."""
    if len(data) <= length:
        raise ValueError(f"windows of {length} bytes need more than {length} bytes of text, got {len(data)}")
    starts = rng.integers(0, len(data) - length, n)
    return data[starts[:, None] + np.arange(length)[None, :]]


def eval_windows(data: np.ndarray, t: Training) -> np.ndarray:
    """64 held-out windows of ``seq`` bytes (the held-out losses and agreement)."""
    return windows(split(data, t.holdout)[1], np.random.default_rng(t.seed + 1), 64, t.seq)


# ---- model and training ------------------------------------------------------------------

def model_config(width: int, layers: int):
    """``tiny`` scaled to hidden ``width`` and ``layers`` layers (the first dense), one MTP depth."""
    w = width
    return pdjax.configs.tiny(hidden_size=w, intermediate_size=2 * w, moe_intermediate_size=w // 2,
                              num_hidden_layers=layers, q_lora_rank=w // 2, kv_lora_rank=w // 2,
                              qk_nope_head_dim=w // 4, qk_rope_head_dim=w // 8, v_head_dim=w // 4,
                              num_nextn_predict_layers=1)


def param_count(cfg) -> int:
    """Parameters of ``cfg``'s params tree (the MTP depth included)."""
    import jax

    import pdjax
    like = jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))
    return int(sum(x.size for x in jax.tree.leaves(like)))


def optimizer(t: Training):
    import optax
    sched = optax.warmup_cosine_decay_schedule(0.0, t.lr, min(t.warmup, t.steps // 2), t.steps, end_value=t.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))


def make_step(cfg, opt):
    """The jitted train step: (params, opt state, tokens) -> (params, opt state, loss)."""
    import jax
    import optax

    import pdjax

    def step(params, state, tokens):
        value, grads = jax.value_and_grad(lambda p: pdjax.loss(p, cfg, tokens, mtp_weight=MTP_WEIGHT))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value
    return jax.jit(step, donate_argnums=(0, 1))


def eval_losses(params, cfg, tokens) -> tuple[float, float]:
    """(main CE, MTP depth-1 CE) on ``tokens``, in nats per byte."""
    import pdjax
    main = float(pdjax.loss(params, cfg, tokens))
    both = float(pdjax.loss(params, cfg, tokens, mtp_weight=MTP_WEIGHT))
    return main, (both - main) / MTP_WEIGHT


def train(cfg, train_data, eval_tokens, t: Training, log: Optional[Callable[[str], None]] = None,
          log_every: int = 50) -> tuple[dict, dict]:
    """Train from ``init_params(cfg, key(seed))`` for ``t.steps`` steps; (params, a summary:
    ``train_s``, ``heldout_main_ce``, ``heldout_mtp_ce``). ``log``: called with a line every
    ``log_every`` steps (and after the first, which compiles)."""
    import jax

    import pdjax
    log = log or (lambda msg: None)
    rng = np.random.default_rng(t.seed)
    params = pdjax.init_params(cfg, jax.random.key(t.seed))
    opt = optimizer(t)
    state, step = opt.init(params), make_step(cfg, opt)
    t0 = time.perf_counter()
    recent = []
    for i in progress.track(range(t.steps), "training the MTP model"):
        params, state, value = step(params, state, windows(train_data, rng, t.batch, t.seq))
        recent.append(value)
        if i == 0:
            jax.block_until_ready(value)
            log(f"step 1 (compiles) {time.perf_counter() - t0:.1f} s, loss {float(value):.3f}")
        if (i + 1) % log_every == 0 or i + 1 == t.steps:
            mean = float(np.mean([float(v) for v in recent]))
            recent = []
            log(f"step {i + 1}/{t.steps}  train loss {mean:.3f}  {time.perf_counter() - t0:.0f} s")
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    main, mtp_ce = eval_losses(params, cfg, eval_tokens)
    log(f"trained in {seconds:.0f} s: held-out main CE {main:.3f}, MTP CE {mtp_ce:.3f} nats/byte")
    return params, {"train_s": round(seconds, 1), "heldout_main_ce": round(main, 4), "heldout_mtp_ce": round(mtp_ce, 4)}


@functools.lru_cache(maxsize=None)
def _agreement_fn():
    import jax
    import jax.numpy as jnp

    from pdjax.model import mtp
    from pdjax.model import transformer as tfm

    @functools.partial(jax.jit, static_argnames=("cfg",))
    def fn(params, cfg, tokens):
        B, T = tokens.shape
        q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        x, _ = tfm.run_layers(params, cfg, tfm.embed(params, tokens, cfg), q_pos)
        g = tfm.final_hidden(params, cfg, x)
        main = jnp.argmax(tfm.logits_of(params, g), axis=-1)                      # [:, j] predicts token j+1
        draft = jnp.argmax(mtp.mtp_logits(params, cfg, g, tokens, tfm.layer)[0], axis=-1)  # [:, i]: token i+2
        return (jnp.mean(draft == main[:, 1:]), jnp.mean(main[:, :-1] == tokens[:, 1:]),
                jnp.mean(draft[:, :-1] == tokens[:, 2:]))
    return fn


def agreement(params, cfg, tokens) -> dict:
    """Teacher-forced on ``tokens`` [B, T]: ``agree``, how often depth 1's greedy draft of
    token i+2 equals the model's greedy token i+2 given the true tokens up to i+1 (the accept
    rate greedy decoding would see on text like this), and each one's top-1 accuracy
    (``main_acc``: the next byte, ``draft_acc``: the byte after next)."""
    agree, main_acc, draft_acc = (float(v) for v in _agreement_fn()(params, cfg, np.asarray(tokens, np.int32)))
    return {"agree": agree, "main_acc": main_acc, "draft_acc": draft_acc}


# ---- the params cache --------------------------------------------------------------------

def settings(cfg, t: Training, n_bytes: int) -> str:
    """What determines the trained params: compared with the cache's before loading it."""
    return json.dumps({"cfg": repr(cfg), "corpus_bytes": n_bytes, "python": sys.version.split()[0],
                       **{k: getattr(t, k) for k in SETTINGS}}, sort_keys=True)


def save(path: str, params, meta: str, summary: dict) -> None:
    import jax
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    leaves = jax.tree.leaves(params)
    np.savez(path, meta=np.array(meta), summary=np.array(json.dumps(summary)),
             **{f"leaf{i}": np.asarray(x) for i, x in enumerate(leaves)})


def load(path: str, cfg, meta: str):
    """(params, summary) from the cache, or None if it is missing or holds other settings."""
    import jax
    import jax.numpy as jnp

    import pdjax
    if not os.path.exists(path):
        return None
    with np.load(path) as f:
        if str(f["meta"]) != meta:
            return None
        like = jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))
        leaves, tree = jax.tree.flatten(like)
        params = tree.unflatten([jnp.asarray(f[f"leaf{i}"]) for i in range(len(leaves))])
        return params, json.loads(str(f["summary"]))


def trained_params(cfg, t: Training, data: np.ndarray, cache: str = "", retrain: bool = False,
                   log: Optional[Callable[[str], None]] = None, log_every: int = 50) -> tuple[dict, dict, str]:
    """(params, training summary, where from: ``"cache"`` or ``"trained"``): loaded from
    ``cache`` (an ``.npz`` path; "" for none) when it holds params of these settings and
    ``retrain`` is off, else trained (:func:`train`) and saved there."""
    if cache and not cache.endswith(".npz"):
        raise ValueError(f"cache: must be an .npz path (or empty for none), got {cache!r}")
    log = log or (lambda msg: None)
    meta = settings(cfg, t, len(data))
    cached = None if retrain or not cache else load(cache, cfg, meta)
    if cached is not None:
        log(f"loaded trained params from {cache}")
        return (*cached, "cache")
    if cache and os.path.exists(cache) and not retrain:
        log(f"{cache}: trained with other settings; training again")
    params, summary = train(cfg, split(data, t.holdout)[0], eval_windows(data, t), t, log, log_every)
    if cache:
        save(cache, params, meta, summary)
        log(f"saved {cache}")
    return params, summary, "trained"
