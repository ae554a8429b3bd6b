"""Which decoder layers each stage holds: the model cut into chunks of consecutive layers,
one chunk per position in a pipeline (pure Python, shared by the executor and the cost
model built from a config, :mod:`pdjax.analysis.pipeline_costs`).

A pipeline of ``L`` stages holds the model in ``L`` chunks: chunk 0 also embeds the tokens,
chunk ``L-1`` also applies the final norm, the LM head and the loss (and, when the loss has
an MTP term, the MTP modules). Every stage runs the chunk at its position in its pipeline,
so DualPipe's two directions hold two copies of every chunk.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Layers ``[start, stop)`` of the model; ``first`` embeds, ``last`` ends in the loss."""

    index: int
    start: int
    stop: int
    first: bool
    last: bool


def split_layers(num_layers: int, num_chunks: int, layers=None) -> tuple[Chunk, ...]:
    """Cut ``num_layers`` decoder layers into ``num_chunks`` chunks of consecutive layers.

    ``layers``: the number of layers per chunk (sums to ``num_layers``); default: as even as
    possible, the earlier chunks taking the remainder. A chunk may hold no layer (it then
    only embeds, or only ends in the loss, or passes its input on).
    """
    if layers is None:
        q, r = divmod(num_layers, num_chunks)
        layers = [q + (1 if c < r else 0) for c in range(num_chunks)]
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__"):
        raise TypeError(f"layers_per_stage must be a list of {num_chunks} non-negative ints (one per chunk of "
                        f"the pipeline), got {layers!r}")
    layers = list(layers)
    if len(layers) != num_chunks or any(not isinstance(n, int) or n < 0 for n in layers):
        raise ValueError(f"layers_per_stage must be {num_chunks} non-negative ints (one per chunk of the "
                         f"pipeline), got {layers}")
    if sum(layers) != num_layers:
        raise ValueError(f"layers_per_stage {layers} sums to {sum(layers)}, but the model has "
                         f"{num_layers} layers")
    out, at = [], 0
    for c, n in enumerate(layers):
        out.append(Chunk(c, at, at + n, c == 0, c == num_chunks - 1))
        at += n
    return tuple(out)


def stage_chunks(layout) -> list[int]:
    """Per stage of ``layout`` (a :class:`~pdjax.schedules.Layout`), the chunk it runs: its
    position in its pipeline. Every pipeline must have the same number of stages (each
    holds the whole model), else a ValueError."""
    lengths = sorted(len(p.stages) for p in layout.pipelines)
    if len(set(lengths)) != 1:
        raise ValueError(f"every pipeline must have the same number of stages to hold the whole "
                         f"model, got {lengths}")
    out = [0] * layout.num_stages
    for pipe in layout.pipelines:
        for pos, s in enumerate(pipe.stages):
            out[s] = pos
    return out
