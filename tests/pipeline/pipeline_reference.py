"""Independent re-derivation of DualPipe / DualPipeV op order for tests.

This mirrors the *control flow* of deepseek-ai/DualPipe's ``DualPipe.step()`` and
``DualPipeV.step()``: per-phase chunk counters, the ``phase ^= is_in_second_half`` swap,
a weight-grad store that caches the W of a zero-bubble backward, flushes it to a FIFO
queue and pops the oldest on ``_weight_chunk``; steps 1..8 with the reference's loop
bounds and ``enable_zb`` toggling. It records op strings instead of running modules.
It deliberately shares no code with pdjax.schedules.dualpipe.
"""

from __future__ import annotations

import queue


class _Emulator:
    def __init__(self, rank: int, num_ranks: int, num_chunks: int, v_shape: bool):
        self.rank, self.num_ranks, self.v = rank, num_ranks, v_shape
        self.is_last_rank = rank == num_ranks - 1
        if v_shape:
            self.is_in_second_half = False
            self.is_middle_rank = False
        else:
            self.is_in_second_half = rank >= num_ranks // 2
            self.is_middle_rank = rank in (num_ranks // 2 - 1, num_ranks // 2)
        self.num_chunks = num_chunks
        self.f_id = [0, 0]
        self.b_id = [0, 0]
        self.cache: list[str] = []
        self.q: queue.Queue = queue.Queue()
        self.enabled = False
        self.log: list[str] = []

    # naming: "phase" after the XOR is the direction for DualPipe (0: enters at rank 0)
    def _name(self, phase: int, kind: str, chunk: int) -> str:
        n = self.num_ranks
        if self.v:
            stage = self.rank if phase == 0 else 2 * n - 1 - self.rank
            return f"{stage}{kind}{chunk}"
        stage = self.rank if phase == 0 else 2 * n - 1 - self.rank
        mb = chunk if phase == 0 else chunk + self.num_chunks // 2
        return f"{stage}{kind}{mb}"

    def _fwd_compute(self, phase: int) -> str:
        phase ^= self.is_in_second_half
        chunk = self.f_id[phase]
        self.f_id[phase] += 1
        return self._name(phase, "F", chunk)

    def _bwd_compute(self, phase: int, enable_zb: bool) -> str:
        phase ^= self.is_in_second_half
        chunk = self.b_id[phase]
        self.b_id[phase] += 1
        self.enabled = enable_zb
        if enable_zb:
            self.cache.append(self._name(phase, "W", chunk))
        self.enabled = False
        if enable_zb:
            self.q.put(self.cache)
            self.cache = []
        return self._name(phase, "I" if enable_zb else "B", chunk)

    def forward_chunk(self, phase):
        self.log.append(self._fwd_compute(phase))

    def backward_chunk(self, phase, enable_zb=False):
        self.log.append(self._bwd_compute(phase, enable_zb))

    def forward_backward_chunk(self, phase0, phase1):
        f = self._fwd_compute(phase0)
        b = self._bwd_compute(phase1, False)
        self.log.append(f"({f};{b})OVERLAP_F_B")

    def weight_chunk(self):
        funcs = self.q.get_nowait()  # FIFO: oldest queued weight-grad
        self.log.extend(funcs)

    def step(self) -> list[str]:
        if self.v:
            half_ranks, half_rank, half_chunks = self.num_ranks, self.rank, self.num_chunks
            non_overlapped = self.is_last_rank
        else:
            half_ranks = self.num_ranks // 2
            half_rank = min(self.rank, self.num_ranks - 1 - self.rank)
            half_chunks = self.num_chunks // 2
            non_overlapped = self.is_middle_rank
        for _ in range((half_ranks - half_rank - 1) * 2):
            self.forward_chunk(0)
        for _ in range(half_rank + 1):
            self.forward_chunk(0)
            self.forward_chunk(1)
        for _ in range(half_ranks - half_rank - 1):
            self.backward_chunk(1, enable_zb=True)
            self.weight_chunk()
            self.forward_chunk(1)
        for i in range(half_chunks - 2 * half_ranks + half_rank + 1):
            if i == 0 and non_overlapped:
                self.forward_chunk(0)
                self.backward_chunk(1)
            else:
                self.forward_backward_chunk(0, 1)
            self.forward_backward_chunk(1, 0)
        for _ in range(half_ranks - half_rank - 1):
            self.backward_chunk(1)
            self.forward_backward_chunk(1, 0)
        step_6 = half_rank + 1
        enable_zb = False
        for i in range(step_6):
            if i == step_6 // 2 and half_rank % 2 == 1:
                enable_zb = True
            self.backward_chunk(1, enable_zb=enable_zb)
            if i == step_6 // 2 and half_rank % 2 == 0:
                enable_zb = True
            self.backward_chunk(0, enable_zb=enable_zb)
        for _ in range(half_ranks - half_rank - 1):
            self.weight_chunk()
            self.backward_chunk(0, enable_zb=True)
        for _ in range(half_rank + 1):
            self.weight_chunk()
        assert self.q.empty()
        return self.log


def reference_dualpipe(num_ranks: int, num_chunks: int) -> list[list[str]]:
    """Op strings per rank for DualPipe (direction-1 micro-batches offset by C/2)."""
    return [_Emulator(r, num_ranks, num_chunks, v_shape=False).step() for r in range(num_ranks)]


def reference_dualpipev(num_ranks: int, num_chunks: int) -> list[list[str]]:
    """Op strings per rank for DualPipeV (stages r and 2N-1-r)."""
    return [_Emulator(r, num_ranks, num_chunks, v_shape=True).step() for r in range(num_ranks)]
