"""Models whose MTP drafts are mostly right, for the speculative-decoding tests (the model's
``generate`` and the serving engines)."""

import jax
import jax.numpy as jnp

import pdjax


def perfect_drafter(cfg, key=1):
    """A model whose next token depends on the current one only (attention off, embedding
    rows of unit RMS) and an MTP depth that is a copy of its one layer reading the next
    token's embedding: every draft is what the model says next. Returns (cfg, params)."""
    cfg = cfg.replace(num_hidden_layers=1, first_k_dense_replace=0)
    p = pdjax.init_params(cfg, jax.random.key(key))
    emb = p["embed"] / jnp.sqrt(jnp.mean(p["embed"] ** 2, -1, keepdims=True))
    layer = dict(p["layers"][0], attn=dict(p["layers"][0]["attn"], wo=jnp.zeros_like(p["layers"][0]["attn"]["wo"])))
    D = cfg.hidden_size
    depth = dict(p["mtp"][0], layer=layer, head_norm=p["final_norm"],
                 eh_proj=jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))]))
    return cfg, dict(p, embed=emb, layers=[layer], mtp=[depth])


def counting_sequences(cfg, starts):
    """Rows t, t+1, t+2, ... (mod the vocabulary) of lengths n, for (t, n) in ``starts``."""
    return [[(s + j) % cfg.vocab_size for j in range(n)] for s, n in starts]


def counting_model(cfg, steps: int = 100):
    """``cfg``'s model trained with the MTP loss (weight 0.3) on counting sequences for
    ``steps`` Adam steps (learning rate 1e-2; seconds on CPU): its drafts are nearly always
    right. Returns (params, final loss)."""
    import optax

    params = pdjax.init_params(cfg, jax.random.key(6))
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, state, key):
        tokens = (jax.random.randint(key, (16, 1), 0, cfg.vocab_size) + jnp.arange(12)) % cfg.vocab_size
        loss, grads = jax.value_and_grad(lambda p: pdjax.loss(p, cfg, tokens, mtp_weight=0.3))(params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    state = opt.init(params)
    for key in jax.random.split(jax.random.key(7), steps):
        params, state, loss = step(params, state, key)
    return params, float(loss)
