"""Synthetic serving workloads: arrivals, length distributions, sessions, system prompts.

A prompt is a tuple of *segments* ``(segment_id, length)``: equal segment ids mean equal
tokens, so prefix reuse is exact without materialising tokens. A shared system prompt is
one segment used by many requests; turn k+1 of a multi-turn session has prompt
``turn k's prompt + turn k's output + new user tokens`` (its output is the segment
``out_segment`` of turn k).

Arrivals are open-loop: session starts follow a Poisson (cv = 1) or gamma process at
``rate / mean_turns`` sessions per second, so requests arrive at ``rate`` per second on
average; turn k+1 arrives an exponential think time (mean ``think_time``) after turn k.
Everything is drawn from one ``numpy.random.default_rng(seed)``: the workload is a pure
function of its spec.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import numpy as np

from pdjax.arguments import check_int, check_nonnegative


class SimRequest:
    """One request and its lifecycle record (times in seconds since the start)."""

    __slots__ = ("rid", "arrival", "input_len", "output_len", "session_id", "turn",
                 "segments", "out_segment", "retention", "prefix_id",
                 # lifecycle
                 "status", "reason", "cached", "prefilled", "t_handshake", "t_prefill_start",
                 "t_first", "t_kv_ready", "t_join", "t_finish", "prefill_inst", "decode_inst",
                 "rank", "prank", "join_step", "pred_cost", "kv_wait", "_hashes")

    def __init__(self, rid: int, arrival: float, input_len: int, output_len: int,
                 session_id: int = -1, turn: int = 0, segments: Optional[tuple] = None,
                 out_segment: int = -1, retention: str = "default", prefix_id: int = -1):
        if input_len < 1 or output_len < 1:
            raise ValueError(f"request {rid}: input_len and output_len must be >= 1, "
                             f"got {input_len}, {output_len}")
        if not math.isfinite(arrival) or arrival < 0:
            raise ValueError(f"request {rid}: arrival must be a finite time >= 0, got {arrival}")
        self.rid, self.arrival = rid, float(arrival)
        self.input_len, self.output_len = int(input_len), int(output_len)
        self.session_id, self.turn, self.retention, self.prefix_id = session_id, turn, retention, prefix_id
        self.segments = segments if segments is not None else ((-1 - rid, self.input_len),)
        self.out_segment = out_segment
        self.status = None          # "finished" | "rejected"
        self.reason = ""
        self.cached = self.prefilled = 0
        self.t_handshake = self.t_prefill_start = self.t_first = math.nan
        self.t_kv_ready = self.t_join = self.t_finish = math.nan
        self.prefill_inst = self.decode_inst = None
        self.rank = self.prank = self.join_step = 0
        self.pred_cost = self.kv_wait = 0.0
        self._hashes = None

    def fresh(self) -> "SimRequest":
        """A copy with the same description and an empty lifecycle record."""
        return SimRequest(self.rid, self.arrival, self.input_len, self.output_len, self.session_id,
                       self.turn, self.segments, self.out_segment, self.retention, self.prefix_id)

    @property
    def context_len(self) -> int:
        return self.input_len + self.output_len

    def __repr__(self):
        return (f"SimRequest(rid={self.rid}, arrival={self.arrival:.4g}, in={self.input_len}, "
                f"out={self.output_len}, status={self.status})")


# ---- length distributions ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LengthDist:
    """Token-length distribution. kinds: "fixed" (value), "uniform" (low, high inclusive),
    "lognormal" (mean, cv, clipped to [low, high]), "list" (values, sampled uniformly)."""

    kind: str = "fixed"
    value: int = 1
    low: int = 1
    high: int = 1 << 30
    mean: float = 1.0
    cv: float = 1.0
    values: tuple = ()

    def __post_init__(self):
        k = self.kind
        if k == "fixed" and self.value < 1:
            raise ValueError(f"fixed length must be >= 1, got {self.value}")
        if k == "uniform" and not (1 <= self.low <= self.high):
            raise ValueError(f"uniform lengths need 1 <= low <= high, got {self.low}, {self.high}")
        if k == "lognormal" and (self.mean < 1 or self.cv <= 0 or self.low < 1 or self.low > self.high):
            raise ValueError(f"lognormal lengths need mean >= 1, cv > 0, 1 <= low <= high; got "
                             f"mean={self.mean}, cv={self.cv}, low={self.low}, high={self.high}")
        if k == "list" and (not self.values or min(self.values) < 1):
            raise ValueError("list lengths need a non-empty list of integers >= 1")
        if k not in ("fixed", "uniform", "lognormal", "list"):
            raise ValueError(f"unknown length distribution {k!r}; known: fixed, uniform, "
                             "lognormal, list")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=n)
        if self.kind == "list":
            return np.asarray(self.values, dtype=np.int64)[rng.integers(0, len(self.values), size=n)]
        sigma2 = math.log(1 + self.cv ** 2)      # lognormal with the given mean and cv
        mu = math.log(self.mean) - sigma2 / 2
        x = rng.lognormal(mu, math.sqrt(sigma2), size=n)
        return np.clip(np.rint(x), self.low, self.high).astype(np.int64)

    def expected(self) -> float:
        if self.kind == "fixed":
            return float(self.value)
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        if self.kind == "list":
            return float(np.mean(self.values))
        return float(self.mean)


LengthLike = Union[int, dict, LengthDist, Sequence[int]]


def length_dist(spec: LengthLike) -> LengthDist:
    """An int (fixed), a list (sampled uniformly), a dict ``{"kind": ..., ...}`` or a
    LengthDist."""
    if isinstance(spec, LengthDist):
        return spec
    if isinstance(spec, bool):
        raise ValueError(f"length distribution must be an int, list or dict, got {spec!r}")
    if isinstance(spec, (int, np.integer)):
        return LengthDist("fixed", value=int(spec))
    if isinstance(spec, dict):
        d = dict(spec)
        kind = d.pop("kind", "fixed")
        if "values" in d:
            d["values"] = tuple(int(v) for v in d["values"])
        try:
            return LengthDist(kind, **d)
        except TypeError as e:
            raise ValueError(f"bad length distribution {spec!r}: {e}") from None
    if isinstance(spec, (list, tuple)):
        return LengthDist("list", values=tuple(int(v) for v in spec))
    raise ValueError(f"length distribution must be an int, list or dict, got {spec!r}")


def arrival_gaps(rng: np.random.Generator, rate: float, n: int, cv: float = 1.0) -> np.ndarray:
    """``n`` inter-arrival gaps of a renewal process with mean 1/rate and coefficient of
    variation ``cv`` (gamma with shape 1/cv^2; cv = 1 is Poisson)."""
    check_rate(rate)
    if not (isinstance(cv, (int, float)) and cv > 0 and math.isfinite(cv)):
        raise ValueError(f"arrival cv must be > 0, got {cv!r}")
    shape = 1.0 / cv ** 2
    return rng.gamma(shape, 1.0 / (rate * shape), size=n)


def check_rate(rate) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"arrival rate must be a finite number > 0 requests/s, got {rate!r}")
    return float(rate)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """A synthetic workload. ``input``: new user tokens per turn; ``output``: generated
    tokens; ``system_prompts`` shared prefixes of ``system_prompt_len`` tokens (0 = none),
    each request drawing one uniformly; ``turns``: turns per session (1 = single-turn);
    ``retention``: traffic-class mix for the prefix cache, e.g. {"chat": 0.7, "agent": 0.3}.
    """

    num_requests: int
    rate: float
    input: LengthLike = 1024
    output: LengthLike = 128
    cv: float = 1.0
    seed: int = 0
    system_prompts: int = 0
    system_prompt_len: LengthLike = 0
    turns: LengthLike = 1
    think_time: float = 0.0
    retention: Optional[dict] = None

    def __post_init__(self):
        if isinstance(self.num_requests, bool) or not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"num_requests must be an integer >= 1, got {self.num_requests!r}")
        check_rate(self.rate)
        check_int("WorkloadSpec.system_prompts", self.system_prompts, 0)
        check_int("WorkloadSpec.seed", self.seed, 0)
        check_nonnegative("WorkloadSpec.cv", self.cv)
        check_nonnegative("WorkloadSpec.think_time", self.think_time)      # NaN and inf refused
        if self.retention is not None:
            if not self.retention or min(self.retention.values()) < 0 or sum(self.retention.values()) <= 0:
                raise ValueError(f"retention mix must map classes to weights >= 0, got {self.retention}")


def sample_requests(spec: WorkloadSpec) -> list[SimRequest]:
    """The requests of ``spec``, sorted by arrival (deterministic in ``spec.seed``)."""
    rng = np.random.default_rng(spec.seed)
    in_d, out_d, turn_d = length_dist(spec.input), length_dist(spec.output), length_dist(spec.turns)
    n = spec.num_requests
    mean_turns = max(1.0, turn_d.expected())
    n_sessions = max(1, math.ceil(n / mean_turns * 1.25) + 8)
    while True:  # enough sessions to cover n turns
        turns = turn_d.sample(rng, n_sessions)
        if turns.sum() >= n:
            break
        n_sessions *= 2
    starts = np.cumsum(arrival_gaps(rng, spec.rate / mean_turns, n_sessions, spec.cv))
    total = int(turns.sum())
    new_in = in_d.sample(rng, total)
    outs = out_d.sample(rng, total)
    thinks = rng.exponential(spec.think_time, size=total) if spec.think_time > 0 else np.zeros(total)
    sys_ids = rng.integers(0, spec.system_prompts, size=n_sessions) if spec.system_prompts else None
    sys_lens = (length_dist(spec.system_prompt_len).sample(rng, spec.system_prompts)
                if spec.system_prompts and spec.system_prompt_len else None)
    classes, cls_idx = ["default"], np.zeros(n_sessions, dtype=np.int64)
    if spec.retention:
        classes = sorted(spec.retention)
        w = np.asarray([spec.retention[c] for c in classes], dtype=float)
        cls_idx = rng.choice(len(classes), size=n_sessions, p=w / w.sum())
    seg = spec.system_prompts  # segment ids below this are system prompts
    rows = []
    k = 0
    for s in range(n_sessions):
        t = float(starts[s])
        prefix: tuple = ()
        pid = -1
        if sys_ids is not None and sys_lens is not None:
            pid = int(sys_ids[s])
            prefix = ((pid, int(sys_lens[pid])),)
        for turn in range(int(turns[s])):
            if turn:
                t += float(thinks[k])
            segs = prefix + ((seg, int(new_in[k])),)
            out_seg = seg + 1
            seg += 2
            rows.append((t, s, turn, segs, out_seg, int(outs[k]), classes[cls_idx[s]], pid))
            prefix = segs + ((out_seg, int(outs[k])),)
            k += 1
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    return [SimRequest(i, r[0], sum(x[1] for x in r[3]), r[5], session_id=r[1], turn=r[2],
                    segments=r[3], out_segment=r[4], retention=r[6], prefix_id=r[7])
            for i, r in enumerate(rows[:n])]
