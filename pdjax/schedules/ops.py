"""Compute ops of a pipeline schedule and their text form.

A schedule is, per rank, an ordered list of compute ops. Kinds:

- ``F``  forward of one stage for one micro-batch
- ``B``  full backward (input grads and weight grads together)
- ``I``  backward for inputs only (zero-bubble split); its weight grads wait for ``W``
- ``W``  backward for weights only
- ``F&B`` an overlapped pair: one forward and one backward (``B`` or ``I``) run together

The text form is torch.distributed.pipelining's: ``{stage}{kind}{microbatch}``
(``0F3``, ``1I0``, ``2W5``) and ``({forward};{backward})OVERLAP_F_B`` for a pair.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

FORWARD = "F"
FULL_BACKWARD = "B"
BACKWARD_INPUT = "I"
BACKWARD_WEIGHT = "W"
OVERLAP = "F&B"
SINGLE_KINDS = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
ALL_KINDS = SINGLE_KINDS + (OVERLAP,)
OVERLAP_SUFFIX = "OVERLAP_F_B"

_SINGLE_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")
_OVERLAP_RE = re.compile(r"^\(([^;()]*);([^;()]*)\)" + OVERLAP_SUFFIX + "$")


@dataclass(frozen=True, slots=True)
class Op:
    """One compute op: ``kind`` in F/B/I/W on ``stage`` for ``microbatch`` (both 0-based)."""

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in SINGLE_KINDS:
            raise ValueError(f"Op.kind must be one of {SINGLE_KINDS}, got {self.kind!r}")
        if not isinstance(self.stage, int) or self.stage < 0:
            raise ValueError(f"Op.stage must be an int >= 0, got {self.stage!r}")
        if not isinstance(self.microbatch, int) or self.microbatch < 0:
            raise ValueError(f"Op.microbatch must be an int >= 0, got {self.microbatch!r}")

    @property
    def parts(self) -> tuple["Op", ...]:
        """The single ops this op is made of (itself)."""
        return (self,)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True, slots=True)
class OverlapFB:
    """An overlapped pair: ``forward`` (kind F) and ``backward`` (kind B or I) run together.

    Both parts live on the same rank; the pair occupies the rank for the ``FB`` time and
    both results become available when the pair ends.
    """

    forward: Op
    backward: Op

    def __post_init__(self) -> None:
        if not isinstance(self.forward, Op) or self.forward.kind != FORWARD:
            raise ValueError(f"OverlapFB.forward must be an F op, got {self.forward!s}")
        if not isinstance(self.backward, Op) or self.backward.kind not in (FULL_BACKWARD, BACKWARD_INPUT):
            raise ValueError(f"OverlapFB.backward must be a B or I op, got {self.backward!s}")

    @property
    def kind(self) -> str:
        return OVERLAP

    @property
    def parts(self) -> tuple[Op, Op]:
        return (self.forward, self.backward)

    def __str__(self) -> str:
        return f"({self.forward};{self.backward}){OVERLAP_SUFFIX}"


#: Any op of a schedule: a single F/B/I/W op or an overlapped F&B pair.
AnyOp = Union[Op, OverlapFB]


def F(stage: int, microbatch: int) -> Op:
    """Shorthand for a forward op."""
    return Op(FORWARD, stage, microbatch)


def B(stage: int, microbatch: int) -> Op:
    """Shorthand for a full-backward op."""
    return Op(FULL_BACKWARD, stage, microbatch)


def I(stage: int, microbatch: int) -> Op:  # noqa: E743 (the kind's conventional letter)
    """Shorthand for an input-grad backward op."""
    return Op(BACKWARD_INPUT, stage, microbatch)


def W(stage: int, microbatch: int) -> Op:
    """Shorthand for a weight-grad backward op."""
    return Op(BACKWARD_WEIGHT, stage, microbatch)


def FB(forward: Op, backward: Op) -> OverlapFB:
    """Shorthand for an overlapped forward+backward pair."""
    return OverlapFB(forward, backward)


def parse_op(text: str, *, where: str = "") -> AnyOp:
    """Parse torch's action text (``0F3``, ``(0F7;7B3)OVERLAP_F_B``) into an op.

    ``where`` (e.g. ``"rank 2, cell 5"``) is put in the error message. Raises ValueError
    naming the cell when the text is not a compute op.
    """
    cell = text.strip()
    prefix = f"{where}: " if where else ""
    example = "expected e.g. 0F3, 1I0, 2W5, 3B1 or (0F7;7B3)OVERLAP_F_B"
    m = _SINGLE_RE.match(cell)
    if m:
        return Op(m.group(2), int(m.group(1)), int(m.group(3)))
    m = _OVERLAP_RE.match(cell)
    if m:
        parts = []
        for sub in (m.group(1).strip(), m.group(2).strip()):
            sm = _SINGLE_RE.match(sub)
            if not sm:
                raise ValueError(f"{prefix}op {cell!r} has a malformed part {sub!r} ({example})")
            parts.append(Op(sm.group(2), int(sm.group(1)), int(sm.group(3))))
        fwd, bwd = parts
        if fwd.kind != FORWARD or bwd.kind not in (FULL_BACKWARD, BACKWARD_INPUT):
            raise ValueError(
                f"{prefix}op {cell!r}: an OVERLAP_F_B pair is (forward;backward), "
                f"got kinds {fwd.kind!r} and {bwd.kind!r}"
            )
        return OverlapFB(fwd, bwd)
    raise ValueError(f"{prefix}{cell!r} is not a compute op ({example})")
