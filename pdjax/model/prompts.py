"""Prompts as the model takes them: an int array [B,T], or a ragged list of token lists
right-padded into one (every prompt checked first, the error naming its index)."""

from __future__ import annotations

import numpy as np

from pdjax.model_config import ModelConfig
from pdjax.model.checks import check_tokens, prompt_problem


def pad_prompts(cfg: ModelConfig, prompts):
    """prompts (array [B,T] or ragged list) -> (tokens [B,T] right-padded, lengths [B], ragged)."""
    ragged = isinstance(prompts, (list, tuple))
    if not ragged:
        tokens = np.asarray(prompts)
        check_tokens(cfg, tokens, 2, "prompts")
        return tokens, np.full((tokens.shape[0],), tokens.shape[1], np.int32), False
    if not prompts:
        raise ValueError("prompts is empty")
    for i, p in enumerate(prompts):
        problem = prompt_problem(p, cfg.vocab_size)
        if problem is not None:
            kind, why = problem
            raise kind(f"prompt {i} {why}")
    lens = [len(p) for p in prompts]
    padded = np.zeros((len(prompts), max(lens)), np.int64)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = np.asarray(p)
    return padded, np.asarray(lens, np.int32), True
