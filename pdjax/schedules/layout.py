"""Which rank owns which stage, and which stages form a pipeline.

A *pipeline* is a chain of stages that micro-batches traverse in order (forward) and in
reverse order (backward). Most schedules have one pipeline; DualPipe has two, one per
direction, each with its own micro-batches. Communication is derived from this layout:
a dependency between stages on different ranks is a send/recv, between stages on the
same rank (DualPipeV's turning point) it is local.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pipeline:
    """A chain of ``stages`` traversed by micro-batches ``first_microbatch`` ..
    ``first_microbatch + num_microbatches - 1``."""

    stages: tuple[int, ...]
    first_microbatch: int
    num_microbatches: int

    @property
    def microbatches(self) -> range:
        return range(self.first_microbatch, self.first_microbatch + self.num_microbatches)


@dataclass(frozen=True)
class Layout:
    """Stage ownership and pipelines.

    ``stage_rank[s]`` is the rank that owns stage ``s``. Every stage belongs to exactly
    one pipeline; micro-batch ids are global (each belongs to exactly one pipeline).
    """

    num_ranks: int
    stage_rank: tuple[int, ...]
    pipelines: tuple[Pipeline, ...]
    # derived lookups, filled in __post_init__
    prev_stage: tuple[int, ...] = field(init=False, repr=False, compare=False)
    next_stage: tuple[int, ...] = field(init=False, repr=False, compare=False)
    stage_pipeline: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int, got {self.num_ranks!r}")
        num_stages = len(self.stage_rank)
        if num_stages < 1:
            raise ValueError("stage_rank must name at least one stage")
        for s, r in enumerate(self.stage_rank):
            if not isinstance(r, int) or not 0 <= r < self.num_ranks:
                raise ValueError(f"stage_rank[{s}] must be a rank in [0, {self.num_ranks}), got {r!r}")
        prev = [-1] * num_stages
        nxt = [-1] * num_stages
        owner = [-1] * num_stages
        mb_seen: set[int] = set()
        for p, pipe in enumerate(self.pipelines):
            if not pipe.stages:
                raise ValueError(f"pipeline {p} has no stages")
            if pipe.num_microbatches < 1 or pipe.first_microbatch < 0:
                raise ValueError(
                    f"pipeline {p} needs num_microbatches >= 1 and first_microbatch >= 0, "
                    f"got {pipe.num_microbatches}, {pipe.first_microbatch}"
                )
            mbs = set(pipe.microbatches)
            if mbs & mb_seen:
                raise ValueError(f"pipeline {p} reuses micro-batch ids {sorted(mbs & mb_seen)[:4]}")
            mb_seen |= mbs
            for i, s in enumerate(pipe.stages):
                if not 0 <= s < num_stages:
                    raise ValueError(f"pipeline {p} names stage {s}, outside [0, {num_stages})")
                if owner[s] != -1:
                    raise ValueError(f"stage {s} is in pipelines {owner[s]} and {p}")
                owner[s] = p
                if i > 0:
                    prev[s] = pipe.stages[i - 1]
                if i + 1 < len(pipe.stages):
                    nxt[s] = pipe.stages[i + 1]
        missing = [s for s in range(num_stages) if owner[s] == -1]
        if missing:
            raise ValueError(f"stages {missing[:8]} belong to no pipeline")
        object.__setattr__(self, "prev_stage", tuple(prev))
        object.__setattr__(self, "next_stage", tuple(nxt))
        object.__setattr__(self, "stage_pipeline", tuple(owner))

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def num_microbatches(self) -> int:
        return sum(p.num_microbatches for p in self.pipelines)

    def stages_on_rank(self, rank: int) -> tuple[int, ...]:
        """Stages owned by ``rank``, ascending."""
        return tuple(s for s, r in enumerate(self.stage_rank) if r == rank)

    def pipeline_of_stage(self, stage: int) -> Pipeline:
        return self.pipelines[self.stage_pipeline[stage]]

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def chain(cls, stage_rank: tuple[int, ...] | list[int], num_microbatches: int,
              num_ranks: int | None = None) -> "Layout":
        """One pipeline through stages 0..S-1 in order (torch's convention)."""
        stage_rank = tuple(int(r) for r in stage_rank)
        if num_ranks is None:
            num_ranks = max(stage_rank) + 1 if stage_rank else 0
        pipe = Pipeline(tuple(range(len(stage_rank))), 0, num_microbatches)
        return cls(num_ranks, stage_rank, (pipe,))

    @classmethod
    def bidirectional(cls, num_ranks: int, num_microbatches: int) -> "Layout":
        """DualPipe's two directions over ``num_ranks`` ranks.

        Direction 0: stages 0..N-1 on ranks 0..N-1, micro-batches 0..C/2-1 (enter at rank 0).
        Direction 1: stages N..2N-1 on ranks N-1..0, micro-batches C/2..C-1 (enter at rank N-1).
        """
        n, half = num_ranks, num_microbatches // 2
        stage_rank = tuple(range(n)) + tuple(n - 1 - k for k in range(n))
        pipes = (Pipeline(tuple(range(n)), 0, half), Pipeline(tuple(range(n, 2 * n)), half, half))
        return cls(n, stage_rank, pipes)

    @classmethod
    def v_shape(cls, num_ranks: int, num_microbatches: int) -> "Layout":
        """DualPipeV / ZBV: 2N stages in a V, rank r owns stages r and 2N-1-r."""
        n = num_ranks
        stage_rank = tuple(range(n)) + tuple(n - 1 - k for k in range(n))
        return cls.chain(stage_rank, num_microbatches, num_ranks=n)
