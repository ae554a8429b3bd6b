"""The top-level model API: the single-device functions of pdjax.model, plus ``mesh=`` to run
them with DP attention and expert-parallel MoE layers on a jax.sharding mesh."""

from __future__ import annotations

import jax

from pdjax.model_config import ModelConfig
from pdjax.model import checks, mtp, mtp_decode, transformer
from pdjax.model.sharding import ShardingRules
from pdjax.parallel.dbo import DualBatchOverlap
from pdjax.parallel.ep import ExpertParallel
from pdjax.parallel.mesh import batch_sharding, check_batch, shard_params


def _on_mesh(params, cfg, mesh, batch: int, capacity_factor, rules, overlap, dispatch="auto"):
    """(params placed on the mesh, EP MoE implementation, batch sharding)."""
    checks.check_mesh(mesh)
    checks.check_cfg(cfg)
    if "layers" not in params:
        raise ValueError("mesh= takes per-layer params (params['layers']); stacked params "
                         "(pdjax.stack_layers) run on one device: pdjax.unstack_layers first")
    rules = rules or ShardingRules.default(mesh)
    rules.check(mesh)
    check_batch(mesh, batch, rules)
    if overlap not in (None, "dbo"):
        raise ValueError(f"overlap must be None or 'dbo', got {overlap!r}")
    kind = DualBatchOverlap if overlap == "dbo" else ExpertParallel
    ep = kind(mesh, batch_axes=rules.axes("batch"), capacity_factor=capacity_factor,
              expert_axis=(rules.axes("experts") or ("expert",))[0], dispatch=dispatch)
    leaf = jax.tree.leaves(params)[0]
    if getattr(getattr(leaf, "sharding", None), "mesh", None) != mesh:
        params = shard_params(params, cfg, mesh, rules)
    return params, ep, batch_sharding(mesh, rules, ndim=1)   # P(batch): any rank >= 1


def _batch_of(tokens) -> int:
    if isinstance(tokens, (list, tuple)):
        return len(tokens)
    return tokens.shape[0]


def forward(params, cfg: ModelConfig, tokens, *, mesh=None, capacity_factor=None, rules=None,
            overlap=None, dispatch="auto", moe_impl=None, return_stats: bool = False):
    """Logits [B,T,V]. With ``mesh``: attention data-parallel over the batch axes, MoE layers
    expert-parallel (``capacity_factor=None``: dropless; ``overlap="dbo"``: dual-batch
    overlap of two micro-batches; ``dispatch``: "auto" (dropless ragged_all_to_all on GPU/TPU
    when no capacity factor is set, capacity-padded all_to_all otherwise), "padded",
    "ragged" or "ragged-emulated", see :class:`pdjax.parallel.ExpertParallel`)."""
    if mesh is None:
        return transformer.forward(params, cfg, tokens, moe_impl=moe_impl, return_stats=return_stats)
    params, ep, bs = _on_mesh(params, cfg, mesh, _batch_of(tokens), capacity_factor, rules, overlap,
                                  dispatch)
    return transformer.forward(params, cfg, tokens, moe_impl=ep, batch_sharding=bs,
                               return_stats=return_stats)


def prefill(params, cfg: ModelConfig, tokens, *, mesh=None, capacity_factor=None, rules=None, overlap=None,
            dispatch="auto", **kwargs):
    """See :func:`pdjax.model.transformer.prefill`; ``mesh`` as in :func:`forward`."""
    if mesh is None:
        return transformer.prefill(params, cfg, tokens, **kwargs)
    params, ep, bs = _on_mesh(params, cfg, mesh, _batch_of(tokens), capacity_factor, rules, overlap,
                                  dispatch)
    return transformer.prefill(params, cfg, tokens, moe_impl=ep, batch_sharding=bs, **kwargs)


def decode_step(params, cfg: ModelConfig, next_tokens, cache, *, mesh=None, capacity_factor=None,
                rules=None, overlap=None, dispatch="auto", **kwargs):
    """See :func:`pdjax.model.transformer.decode_step`; ``mesh`` as in :func:`forward`."""
    if mesh is None:
        return transformer.decode_step(params, cfg, next_tokens, cache, **kwargs)
    params, ep, bs = _on_mesh(params, cfg, mesh, _batch_of(next_tokens), capacity_factor, rules, overlap,
                                  dispatch)
    return transformer.decode_step(params, cfg, next_tokens, cache, moe_impl=ep, batch_sharding=bs, **kwargs)


def generate(params, cfg: ModelConfig, prompts, *, max_new_tokens: int, mesh=None, capacity_factor=None,
             rules=None, overlap=None, dispatch="auto", speculative=None, return_stats: bool = False, **kwargs):
    """Greedy generation; see :func:`pdjax.model.transformer.generate`. ``speculative="mtp"``:
    the MTP module drafts and the model verifies (:mod:`pdjax.model.mtp_decode`; the same
    tokens, up to near ties: ``stats["near_ties"]``). ``return_stats``: (tokens, stats) with
    ``accept_rate`` and ``tokens_per_step`` (None and 1.0 without drafts), ``steps`` (decode
    iterations), ``drafts`` and ``near_ties`` (None without drafts)."""
    mtp.check_speculative(params, cfg, speculative)
    if mesh is not None:
        params, ep, bs = _on_mesh(params, cfg, mesh, _batch_of(prompts), capacity_factor, rules, overlap, dispatch)
        kwargs = {**kwargs, "moe_impl": ep} if speculative else {**kwargs, "moe_impl": ep, "batch_sharding": bs}
    if speculative == "mtp":
        out, stats = mtp_decode.generate(params, cfg, prompts, max_new_tokens=max_new_tokens, **kwargs)
    else:
        out = transformer.generate(params, cfg, prompts, max_new_tokens=max_new_tokens, **kwargs)
        stats = {"accept_rate": None, "tokens_per_step": 1.0, "steps": max_new_tokens - 1, "drafts": 0,
                 "near_ties": None}
    return (out, stats) if return_stats else out
