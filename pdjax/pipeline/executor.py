"""Run a schedule of the IR on devices as a real training step of the pdjax model.

An MPMD interpreter: one host thread per rank dispatches that rank's ops in schedule order;
values cross ranks with ``jax.device_put``; a rank waits only for the value its next op
needs. Each op is a compiled program of :mod:`pdjax.pipeline.stages` (F, B, I, W, or an
overlapped F&B pair as one program). A rank is one device, or several: then its MoE layers
run expert-parallel over them (:class:`pdjax.parallel.ExpertParallel`) and attention
data-parallel, as DeepSeek-V3 combines PP with EP.

    s = pdjax.pipeline.build("dualpipe", num_ranks=4, num_microbatches=8)
    ex = pdjax.pipeline.Executor(s, cfg, devices=jax.devices()[:4])
    loss, grads = ex.step(params, tokens)      # == jax.value_and_grad(pdjax.loss)
    ex.last_timeline, ex.last_memory

Measurement (``measure=True``): every op blocks on its outputs, and its start and end are
wall-clock times taken around the dispatch and the wait, so ``last_timeline`` holds what
each rank really did, in order (an in-order stream per rank, as a GPU stream is; the cost
is one host round trip per op, reported by the benchmark). ``measure=False`` dispatches
ahead with no host sync until the step's results are read, and keeps no per-op account
(``last_timeline`` and ``last_memory`` are None).

Memory (``last_memory``): per rank, the peak bytes the executor held for pending backward
work: each micro-batch's residuals (and its stage input when the backward reads it) from
its F until its B or W, the I-to-W carry (per-layer cotangents, the output gradient) from
its I until its W. An op's retained outputs count from its start, what it releases from its
end (an overlapped pair holds both micro-batches). The byte counts are the held arrays'
shard sizes summed over the rank's devices.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.arguments import check_int
from pdjax.model.loss import check_mtp_weight
from pdjax.model_config import ModelConfig
from pdjax.pipeline import executor_checks as ec
from pdjax.pipeline import multiprocess
from pdjax.pipeline import stages as st
from pdjax.pipeline.compiled import CompiledStage, compile_all, compiling, warm_helpers
from pdjax.pipeline.rank import Rank
from pdjax.schedules.layer_split import split_layers, stage_chunks
from pdjax.schedules.ops import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, OverlapFB
from pdjax.pipeline.step_run import StepRun

LOSSES = ec.LOSSES   # the losses the executor runs


def _equivalent(shardings, others) -> bool:
    """Whether two pytrees of shardings are the same, leaf by leaf (when not, the executor
    moves the arrays: correct, at the cost of a copy)."""
    a, b = jax.tree.leaves(shardings), jax.tree.leaves(others)
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


def _check_acc(i, shardings) -> None:
    """A program that accumulates a stage's gradients must return the accumulator where the
    next one expects it (the params' shardings); ``acc_reshard`` marks a stage that does not."""
    want = jax.tree.map(lambda a: a.sharding, i.sp)
    i.acc_reshard = i.acc_reshard or not _equivalent(shardings, want)


def _placement(a):
    """Where a gradient goes: like its param (the default device for a host array)."""
    return getattr(a, "sharding", None) or jax.devices()[0]


def _zeros_like(tree):
    """A stage's gradient accumulator: zeros like its params (built once per executor)."""
    return jax.tree.map(jnp.zeros_like, tree)


class Executor:
    """Runs ``schedule`` as training steps of the model ``cfg`` on ``devices``.

    ``devices``: a list of devices (default: all), split into ``num_ranks`` equal consecutive
    groups; a group of several devices runs its stages' MoE layers expert-parallel.
    ``loss``: "next_token" (mean cross-entropy of every position's next token over the batch).
    ``layers_per_stage``: layers per model chunk (one chunk per position in a pipeline; default
    as even as possible). ``measure``: block on every op to time it (``last_timeline``).
    ``timeout_s``: how long a rank waits for one value before the step fails. ``mtp_weight``:
    the loss is ``pdjax.loss(..., mtp_weight=)``: the MTP modules sit on the stage that holds
    the output head, beside a copy of the embedding (one rank holds both in DualPipe and
    DualPipeV; otherwise the embedding's two gradients are summed).
    """

    def __init__(self, schedule, cfg: ModelConfig, devices=None, loss: str = "next_token", *,
                 layers_per_stage=None, measure: bool = True, timeout_s: float = 600.0, mtp_weight: float = 0.0):
        devices, k, num_chunks = ec.check_setup(schedule, cfg, devices, loss)
        self.mtp_weight = float(check_mtp_weight(mtp_weight, cfg))
        layout, n = schedule.layout, schedule.num_ranks
        self.schedule, self.cfg, self.loss, self.measure, self.timeout_s = schedule, cfg, loss, measure, timeout_s
        self.devices_per_rank = k
        self.ranks = [Rank(r, devices[r * k:(r + 1) * k]) for r in range(n)]
        # the ranks whose programs this process compiles and runs (None: all). Ranks in other
        # processes of a jax.distributed launch: :mod:`pdjax.pipeline.multiprocess`
        self.local_ranks = multiprocess.local_ranks(self.ranks)
        self.spanning = None if self.local_ranks is None else multiprocess.Spanning(self, self.local_ranks)
        self.chunks = split_layers(cfg.num_hidden_layers, num_chunks, layers_per_stage)
        empty = [c.index for c in self.chunks if c.stop == c.start]
        if empty and layers_per_stage is None:      # said out loud unless the caller chose it
            warnings.warn(f"the {cfg.num_hidden_layers}-layer model splits over {num_chunks} pipeline stages as "
                          f"{self.layer_split()}: stage(s) {empty} hold no transformer layer (pass "
                          "layers_per_stage to choose the split)", UserWarning, stacklevel=2)
        self.stage_chunk = stage_chunks(layout)     # stage -> chunk (its position in its pipeline)
        self._compiled: dict = {}
        self.last_timeline = None
        self.last_memory = None
        self.stage_memory = None

    # ---- checks -----------------------------------------------------------------------------
    def check_batch(self, tokens):
        """Checks of a token batch [B,T] before any compute (the model's token checks, then
        the split into micro-batches: :func:`pdjax.pipeline.executor_checks.check_batch`). A
        host array is checked fully (shape, dtype, ids in the vocabulary) and returned as
        int32 numpy; a jax.Array only by shape and dtype (reading its values would wait for
        the device)."""
        return ec.check_batch(tokens, self.cfg, self.schedule.num_microbatches, self.devices_per_rank)

    def check_shape(self, batch_shape) -> None:
        """A batch [B,T] must split into the micro-batches and over a rank's devices."""
        ec.check_shape(batch_shape, self.cfg, self.schedule.num_microbatches, self.devices_per_rank,
                       self.mtp_weight)

    def check_params(self, params) -> None:
        """The model's param tree for ``cfg``, per layer: same structure and shapes as
        ``init_params`` (:func:`pdjax.pipeline.executor_checks.check_params`)."""
        ec.check_params(params, self.cfg)

    # ---- placement ----------------------------------------------------------------------------
    def place(self, params) -> list[dict]:
        """Per stage, its chunk's params on the stage's rank (DualPipe: two copies per chunk);
        a stage of another process: the shapes of its params only."""
        if self.spanning is not None:
            params = jax.tree.map(self.spanning.place_leaf, params)
        out = []
        for s, r in enumerate(self.schedule.layout.stage_rank):
            chunk_params = st.chunk_params(params, self.chunks[self.stage_chunk[s]], bool(self.mtp_weight))
            if self._here(s):
                out.append(self.ranks[r].place_params(chunk_params, self.cfg))
            else:
                where = self.ranks[r].batch(0)
                out.append(jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=where),
                                        chunk_params))
        return out

    def gather_grads(self, stage_grads, like) -> dict:
        """Sum each chunk's gradients over its copies and put them back into the structure
        (and placement) of ``like`` (the params)."""
        out = {"layers": [None] * len(like["layers"])}
        for s in range(self.schedule.num_stages):
            chunk = self.chunks[self.stage_chunk[s]]
            g = stage_grads[s]
            if g is None:              # a stage of another process
                continue
            for key in ("embed", "final_norm", "lm_head", "mtp"):
                if key in g:
                    val = jax.device_put(g[key], jax.tree.map(_placement, like[key]))
                    out[key] = val if key not in out else jax.tree.map(jnp.add, out[key], val)
            for i, gl in enumerate(g["layers"]):
                li = chunk.start + i
                val = jax.device_put(gl, jax.tree.map(_placement, like["layers"][li]))
                prev = out["layers"][li]
                out["layers"][li] = val if prev is None else jax.tree.map(jnp.add, prev, val)
        zeros = lambda a: jnp.zeros(a.shape, a.dtype, device=_placement(a))  # noqa: E731 - held elsewhere
        out["layers"] = [jax.tree.map(zeros, lk) if g is None else g for g, lk in zip(out["layers"], like["layers"])]
        return {k: out[k] if k in out else jax.tree.map(zeros, like[k]) for k in like}

    # ---- compiling ----------------------------------------------------------------------------
    def _spec(self, shape, dtype, sharding):
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

    def compile(self, params_or_staged, batch_shape) -> dict:
        """Compile every program the schedule uses for a batch [B,T] (done by the first step;
        call it first to keep compile time out of a measurement). Returns one
        :class:`~pdjax.pipeline.compiled.CompiledStage` per stage.

        Three rounds: the forwards (whose residual shardings the backwards are compiled
        for), then the B, I and F&B programs (the first I of a stage fixes its carry's
        shardings), then the W programs."""
        self.check_shape(batch_shape)
        B, T = (int(v) for v in batch_shape)
        staged = params_or_staged
        if isinstance(params_or_staged, dict):
            self.check_params(params_or_staged)
            staged = self.place(params_or_staged)
        key = (B, T, tuple((a.shape, str(a.dtype), a.sharding) for a in jax.tree.leaves(staged)))
        if key in self._compiled:
            return self._compiled[key]
        with compiling(f"{self.schedule.name} ({self.schedule.num_ranks} ranks)"):
            info = self._compile_stages(staged, B, T)
            if isinstance(params_or_staged, dict) and self.spanning is None:  # the step's jnp helpers too
                warm_helpers(self, info, staged, params_or_staged)
        self._compiled[key] = info
        return info

    def _compile_stages(self, staged, B: int, T: int) -> list:
        """The forwards (with the gradient accumulators' zeros), then the backwards."""
        b = B // self.schedule.num_microbatches
        scale = 1.0 / (B * (T - 1))
        info, jobs = [None] * self.schedule.num_stages, [None] * self.schedule.num_stages
        zeros = [None] * self.schedule.num_stages
        for pipe in self.schedule.layout.pipelines:        # in pipeline order: a stage's input
            prev = None                                    # dtype is its predecessor's output's
            for s in pipe.stages:
                rank = self.ranks[self.schedule.layout.stage_rank[s]]
                chunk = self.chunks[self.stage_chunk[s]]
                sp_spec = jax.tree.map(lambda a: self._spec(a.shape, a.dtype, a.sharding), staged[s])
                x_spec = (self._spec((b, T), jnp.int32, rank.batch(2)) if prev is None
                          else self._spec((b, T, self.cfg.hidden_size), prev.y_shape.dtype, rank.batch(3)))
                tok_spec = self._spec((b, T), jnp.int32, rank.batch(2)) if chunk.last else None
                prog = st.stage_program(self.cfg, chunk, rank.moe_impl, scale, sp_spec, x_spec, tok_spec,
                                        self.mtp_weight)
                zero = jax.jit(_zeros_like, out_shardings=jax.tree.map(lambda a: a.sharding, sp_spec))
                info[s] = CompiledStage(prog=prog, rank=rank, chunk=chunk, sp=sp_spec, x=x_spec, tok=tok_spec,
                                        x_arg=x_spec if prog.keeps_input else None, zeros=zero)
                if self._here(s):
                    jobs[s] = ((prog.key, "F"), prog.F, (sp_spec, x_spec, tok_spec))
                    zeros[s] = (("zeros",), zero, (sp_spec,))   # compiled now: not in the first step
                prev = prog
        here = [s for s in range(len(info)) if self._here(s)]
        compiled = compile_all([jobs[s] for s in here] + [zeros[s] for s in here])
        for s, f, z in zip(here, compiled, compiled[len(here):]):
            i = info[s]
            i.zeros = z
            prog = i.prog
            y_sh, res_sh = f.output_shardings
            i.F = f
            i.res = [self._spec(a.shape, a.dtype, sh) for a, sh in zip(prog.res_shapes, res_sh)]
            i.gy = self._spec(prog.y_shape.shape, prog.y_shape.dtype, y_sh)
        self._compile_backwards(info)
        return info

    def _compile_backwards(self, info):
        singles, pairs, weights = {}, {}, set()
        for r, ops in enumerate(self.schedule.ops):
            if self.local_ranks is not None and r not in self.local_ranks:
                continue
            for op in ops:
                if isinstance(op, OverlapFB):
                    pairs.setdefault((op.forward.stage, op.backward.stage, op.backward.kind), None)
                elif op.kind == BACKWARD_WEIGHT:
                    weights.add(op.stage)
                elif op.kind != FORWARD:
                    singles.setdefault((op.stage, op.kind), None)
        jobs = []
        for s, kind in singles:
            i = info[s]
            prog, args = i.prog, (i.sp, i.x_arg, i.res, i.gy)
            if kind == FULL_BACKWARD:
                jobs.append(((prog.key, "B"), prog.B, (i.sp, *args)))
            else:
                jobs.append(((prog.key, "I"), prog.I, args))
        for fs, bs, kind in pairs:
            f, bk = info[fs], info[bs]
            pair = st.pair_program(f.prog, bk.prog, kind)
            bargs = (bk.sp, bk.x_arg, bk.res, bk.gy)
            if kind == FULL_BACKWARD:
                bargs = (bk.sp,) + bargs
            jobs.append(((pair.key, "FB"), pair.fn, (f.sp, f.x, f.tok, *bargs)))
        compiled = compile_all(jobs)
        for (s, kind), c in zip(singles, compiled[:len(singles)]):
            setattr(info[s], kind, c)
            if kind == BACKWARD_INPUT:
                self._set_carry(info[s], c.output_shardings[1])
            else:
                _check_acc(info[s], c.output_shardings[0])
        # a pair's outputs must land in the shardings the consumers were compiled for (the
        # standalone F's residuals, the stage's first I's carry); ``reshard`` marks those that don't
        for (fs, bs, kind), c in zip(pairs, compiled[len(singles):]):
            f_sh, b_sh = c.output_shardings
            reshard = not _equivalent(f_sh, info[fs].F.output_shardings)
            if kind == BACKWARD_INPUT:
                self._set_carry(info[bs], b_sh[1])
                reshard = reshard or not _equivalent(b_sh[1], [a.sharding for a in info[bs].carry])
            else:
                _check_acc(info[bs], b_sh[0])
            info[fs].pairs[(bs, kind)] = (c, reshard)
        jobs = [((info[s].prog.key, "W"), info[s].prog.W,
                 (info[s].sp, info[s].sp, info[s].kept, info[s].carry)) for s in sorted(weights)]
        for s, c in zip(sorted(weights), compile_all(jobs)):
            info[s].W = c
            _check_acc(info[s], c.output_shardings)

    def _here(self, s: int) -> bool:
        """Whether stage ``s`` runs in this process (all do, unless ``local_ranks`` is set)."""
        return self.local_ranks is None or self.schedule.layout.stage_rank[s] in self.local_ranks

    def _set_carry(self, i, shardings):
        """The canonical specs of a stage's I-to-W carry and of what an I keeps for its W."""
        if i.carry is not None:
            return
        prog = i.prog
        _, carry_shapes = jax.eval_shape(prog.I, i.sp, i.x_arg, i.res, i.gy)
        i.carry = [self._spec(a.shape, a.dtype, sh) for a, sh in zip(carry_shapes, shardings)]
        values = [i.x, *i.res, i.gy]
        i.kept = [values[j] for j in prog.w_keep]

    def layer_split(self) -> list[int]:
        """Transformer layers per model chunk (per stage position in a pipeline)."""
        return [c.stop - c.start for c in self.chunks]

    def __repr__(self) -> str:
        return (f"Executor({self.schedule}, layers per stage {self.layer_split()}, "
                f"{self.devices_per_rank} device(s) per rank)")

    # ---- one step ------------------------------------------------------------------------------
    def step(self, params, tokens):
        """One training step: ``(loss, grads)`` equal to ``jax.value_and_grad`` of the unsplit
        model's mean next-token loss over ``tokens`` [B,T] (split into the schedule's
        micro-batches in order), grads placed like ``params``. The batch is checked first (on
        the host: nothing is traced or compiled for a bad one), then the params."""
        tokens = self.check_batch(tokens)
        self.check_params(params)
        loss, stage_grads = self._run(self.place(params), tokens)
        if self.spanning is not None:     # this process's part, then summed over the processes
            lead = jax.sharding.SingleDeviceSharding(self.spanning.lead)
            like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=lead), params)
            return self.spanning.combine(loss, self.gather_grads(stage_grads, like))
        return loss, self.gather_grads(stage_grads, params)

    @property
    def replicated(self):
        """Where a step's loss and grads live when the ranks span processes (one device per
        process, replicated; give params there to keep a training loop on it); None otherwise."""
        return None if self.spanning is None else self.spanning.replicated

    def run(self, staged, tokens):
        """A step on stage-resident params (:meth:`place`): ``(loss, per-stage grads)``."""
        return self._run(staged, self.check_batch(tokens))

    def _run(self, staged, tokens):
        run = self._step(staged, tokens)
        if self.spanning is None:
            out = run.go()
        else:
            out = self.spanning.run(run)
        if self.measure:           # the step's measurements (None when not measuring)
            self.stage_memory = {k: v.copy() for k, v in run.stage_memory.items()}
            self.last_memory, self.last_timeline = run.peak.copy(), run.timeline()
        else:
            self.last_memory = self.last_timeline = None
        return out

    def _step(self, staged, tokens, isolated: bool = False) -> StepRun:
        """A step ready to go (compiled, inputs split into micro-batches)."""
        info = self.compile(staged, tokens.shape)
        m = self.schedule.num_microbatches
        b = tokens.shape[0] // m
        mbs = [tokens[i * b:(i + 1) * b] for i in range(m)]
        if self.spanning is None:
            return StepRun(self, info, staged, mbs, isolated)
        run = StepRun(self, info, staged, mbs, isolated, ranks=sorted(self.local_ranks))
        run.remote = self.spanning.link_for(run)
        return run

    # ---- measurement -----------------------------------------------------------------------------
    def measure_ops(self, params, tokens, repeats: int = 3):
        """Per-op durations measured in isolation: the schedule is run ``repeats`` times with
        one op at a time across all ranks (a global lock; ranks in several processes: a lock
        of the machine, :class:`pdjax.cluster.lock.MachineLock`), each op's inputs ready before
        its clock starts and its outputs ready when it stops. Returns
        :class:`pdjax.schedules.measured.OpCosts` (medians per op kind and stage, in ms, and
        the dispatch overhead: the time a compiled call takes to return)."""
        from pdjax.schedules.measured import OpCosts

        repeats = check_int("repeats", repeats)
        self.check_params(params)
        tokens = self.check_batch(tokens)
        staged = self.place(params)
        lock = True if self.spanning is None else self.spanning.machine_lock()
        measure, self.measure = self.measure, True
        try:       # the isolated runs are not steps: the last step's measurements stay
            samples, dispatch = {}, []
            for _ in range(repeats):
                run = self._step(staged, tokens, isolated=lock)
                if self.spanning is None:
                    run.go()
                else:
                    self.spanning.run(run)
                for r, ops in enumerate(self.schedule.ops):
                    for op, s, e, d in zip(ops, run.starts[r], run.ends[r], run.dispatch[r]):
                        samples.setdefault(OpCosts.key(op), []).append(e - s)
                        dispatch.append(d)
        finally:
            self.measure = measure
        return OpCosts(self.schedule.num_stages, {k: float(np.median(v)) for k, v in samples.items()},
                       float(np.median(dispatch)))
