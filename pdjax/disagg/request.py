"""Requests, their validation, sampling parameters and per-request metrics (host-side; the
sampler is :mod:`pdjax.disagg.sampling`, the engines' clock :mod:`pdjax.disagg.clock`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from pdjax.arguments import ArgumentTypeError, check_nonnegative
from pdjax.model.checks import prompt_problem


class RequestError(ValueError):
    """A request that cannot be served (bad prompt, bad parameters). It fails alone: the
    other requests of the batch still finish. Engines return it in place of the tokens."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; otherwise softmax(logits / temperature) restricted to the
    smallest set of tokens whose probability reaches top_p, drawn with a key derived from
    (seed, generation index), so a request samples the same tokens wherever it runs."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass
class Request:
    """One request in an engine: the prompt, its limits and sampling, the output so far and
    its metrics (times in seconds since the engine's clock start)."""

    index: int
    prompt: list
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_tokens: tuple = ()
    retention: str = "chat"
    output: list = dataclasses.field(default_factory=list)
    error: Optional[RequestError] = None
    # metrics (seconds since the engine's clock start)
    arrival: float = 0.0
    first_token_time: Optional[float] = None
    token_times: list = dataclasses.field(default_factory=list)
    finish_time: Optional[float] = None
    kv_bytes_sent: int = 0
    prefix_hit_tokens: int = 0
    kv_wait_s: float = 0.0
    reserve_wait_s: float = 0.0        # arrival to the first KV reservation (back-pressure)
    prefill_attempts: int = 0
    prefix_errors: list = dataclasses.field(default_factory=list)
    prefill_worker: Optional[int] = None
    predicted_prefill_s: Optional[float] = None
    prefill_chunks: list = dataclasses.field(default_factory=list)
    handoff_timeouts: int = 0
    mtp_draft: Optional[int] = None    # speculative decoding: the prefill's MTP draft of token 2

    @property
    def done(self) -> bool:
        return self.error is not None or self.finish_time is not None

    def metrics(self) -> dict:
        t = self.token_times
        tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None
        return {"index": self.index, "prompt_tokens": len(self.prompt), "new_tokens": len(self.output),
                "ttft": None if self.first_token_time is None else self.first_token_time - self.arrival,
                "tpot": tpot, "itl": [b - a for a, b in zip(t, t[1:])], "token_times": list(t),
                "e2e": None if self.finish_time is None else self.finish_time - self.arrival,
                "kv_bytes_sent": self.kv_bytes_sent, "prefix_hit_tokens": self.prefix_hit_tokens,
                "kv_wait_s": self.kv_wait_s, "reserve_wait_s": self.reserve_wait_s,
                "prefill_attempts": self.prefill_attempts,
                "prefix_errors": list(self.prefix_errors), "prefill_worker": self.prefill_worker,
                "predicted_prefill_s": self.predicted_prefill_s, "prefill_chunks": list(self.prefill_chunks),
                "handoff_timeouts": self.handoff_timeouts,
                "error": None if self.error is None else str(self.error)}


def validate_request(req: Request, vocab_size: int, max_context: int) -> None:
    """Raise RequestError naming the problem (caught per request by the engines)."""
    mnt = req.max_new_tokens
    if isinstance(mnt, (bool, np.bool_)) or not isinstance(mnt, (int, np.integer)) or mnt <= 0:
        raise RequestError(f"request {req.index}: max_new_tokens must be a positive integer, got {mnt!r}")
    problem = prompt_problem(req.prompt, vocab_size)
    if problem is not None:
        why = problem[1]
        raise RequestError(f"request {req.index}: " + ("empty prompt" if why == "is empty" else f"prompt {why}"))
    need = len(req.prompt) + req.max_new_tokens
    if need > max_context:
        raise RequestError(f"request {req.index}: prompt ({len(req.prompt)}) + max_new_tokens "
                           f"({req.max_new_tokens}) exceeds the context of {max_context} tokens")


def check_arrivals(arrival_times, n: int) -> list[float]:
    """``arrival_times`` of a ``generate`` call of ``n`` prompts as floats (None: all at 0),
    or raise naming the argument, the index and the value: one real number per prompt
    (not a bool), finite, >= 0 and non-decreasing. A NaN or infinite time would never be
    released (the engine would wait for it for ever)."""
    if arrival_times is None:
        return [0.0] * n
    if isinstance(arrival_times, (str, bytes)) or not isinstance(arrival_times, (list, tuple, np.ndarray)) \
            or np.ndim(arrival_times) != 1:
        raise ArgumentTypeError(f"arrival_times must be a list of one time (seconds) per prompt, "
                                f"got {arrival_times!r}")
    if len(arrival_times) != n:
        raise ValueError(f"arrival_times must hold one time per prompt: got {len(arrival_times)} times "
                         f"for {n} prompts")
    out = [float(check_nonnegative(f"arrival_times[{i}]", a)) for i, a in enumerate(arrival_times)]
    for i in range(1, n):
        if out[i] < out[i - 1]:
            raise ValueError(f"arrival_times must be non-decreasing, got arrival_times[{i}]={out[i]!r} "
                             f"after arrival_times[{i - 1}]={out[i - 1]!r}")
    return out


TokenCallback = Callable[[int, int], None]
