"""MTP speculative decoding on the decode pool's paged cache (``speculative="mtp"``).

Each running slot holds, besides its last emitted token, the draft the MTP module proposed
for the position after it (:class:`~pdjax.disagg.decode.SlotState` ``draft``). A step runs
both through the main model as one two-token chunk (positions p and p+1, absorbed MLA over
the paged latent cache), then:

* the token at p+1 is chosen from the main model's logits at p: greedy, it is the argmax and
  the draft is accepted when it equals it; sampled, :func:`pdjax.disagg.sampling.verify_draft`
  keeps the draft with probability p(draft) and otherwise redraws without it (the token's
  distribution stays the target's). When the draft is accepted, the token at p+2 is chosen
  from the logits at p+1 as plain decoding would (greedy, or :func:`~pdjax.disagg.sampling.sample`
  at the next generation index): one or two tokens a step;
* the cache keeps the rows it verified: the slot's length advances by the tokens emitted
  (1 or 2). A rejected draft's row at p+1 stays in its block past the length, masked, and the
  next step overwrites it (the blocks were reserved for the whole request: rolling back moves
  no block);
* the MTP module (depth 1, its own paged layer after the main model's, same block tables and
  lengths) runs on the same two positions, from the main model's normed states and the
  embeddings of the tokens now known to follow them, and drafts the next token from the last
  position kept (its greedy token: a point-mass proposal).

Every update is donated (in place); the step returns [slots, 3] int32 (the two tokens and how
many of them count), the step's one device-to-host transfer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pdjax.disagg.sampling import sample, verify_draft
from pdjax.model.mtp_decode import choose_greedy, verify_and_draft


def _choose(logits_S2V, state, sampling: bool):
    """(the token after p [S], the token after p+1 [S], the draft accepted [S])."""
    if not sampling:
        return choose_greedy(state.draft)(logits_S2V)
    args = (state.temperature, state.top_p, state.seed)
    t0, accepted = verify_draft(logits_S2V[:, 0], state.draft, *args, state.gen)
    t1 = sample(logits_S2V[:, 1], *args, state.gen + 1)
    return t0, t1, accepted


@functools.partial(jax.jit, static_argnames=("cfg", "moe_impl", "sampling"), donate_argnames=("cache", "state"))
def spec_step(params, cfg, cache, state, moe_impl, sampling=True):
    """One speculative step of every slot (see the module docstring): (out [slots, 3] int32:
    token after p, token after p+1, tokens kept (0 for an empty slot, 1 or 2); cache; state).
    ``cache``: the pool's paged cache with the main model's layers and then the MTP layer."""
    L = cfg.num_hidden_layers
    main = dataclasses.replace(cache, pools=cache.pools[:L])
    _, follow, accepted, keep, main, mtp_layer, draft = verify_and_draft(
        params, cfg, moe_impl, main, cache.layers()[L], state.last_token, state.draft, state.valid,
        functools.partial(_choose, state=state, sampling=sampling))
    cache = dataclasses.replace(main, pools=main.pools + (mtp_layer.pool,))
    t0, t1 = follow[:, 0], follow[:, 1]
    state = dataclasses.replace(
        state, last_token=jnp.where(accepted, t1, jnp.where(state.valid, t0, state.last_token)),
        draft=jnp.where(state.valid, draft, state.draft), gen=state.gen + keep)
    return jnp.stack([t0, t1, keep], axis=1), cache, state
