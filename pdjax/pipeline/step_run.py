"""The runtime of one executed pipeline step (see :mod:`pdjax.pipeline.executor`): one host
thread per rank, the stage links values cross ranks on (:mod:`pdjax.pipeline.links`),
per-micro-batch held values and their bytes, measured op times."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.pipeline.links import Aborted, LocalLink, source_stage
from pdjax.schedules.ops import BACKWARD_INPUT, FORWARD, FULL_BACKWARD, OverlapFB
from pdjax.schedules.simulate import measured_timeline


def _nbytes(a) -> int:
    """Bytes an array occupies over its devices (replicas counted on every device)."""
    if a is None:
        return 0
    return sum(s.data.nbytes for s in a.addressable_shards)


def _tree_bytes(tree) -> int:
    return sum(_nbytes(a) for a in jax.tree.leaves(tree))


class StepRun:
    """The state of one executed step: per-rank threads, the stage links, per-micro-batch held
    values and their bytes, the measured op times."""

    def __init__(self, ex, info, staged, token_mbs, isolated=False, *, ranks=None, remote=None):
        """``isolated``: run one op at a time (True: a lock of this process; or any object with
        ``acquire``/``release``, e.g. a lock shared by processes). ``ranks``: the ranks this
        process runs (default all); values between them cross a :class:`LocalLink`, values
        to and from the ranks of other processes ``remote`` (a
        :class:`~pdjax.pipeline.links.ProcessLink`, set before :meth:`drive`)."""
        self.ex, self.info, self.staged = ex, info, staged
        self.isolated = threading.Lock() if isolated is True else (isolated or None)
        sched = ex.schedule
        self.layout = sched.layout
        self.ranks = tuple(range(sched.num_ranks)) if ranks is None else tuple(ranks)
        local = set(self.ranks)
        self.local_stage = [r in local for r in self.layout.stage_rank]
        self.local = LocalLink(ex.timeout_s)
        self.remote = remote
        self.failed: BaseException | None = None
        # token micro-batches, placed where their first and last stages need them
        self.tokens_in: dict = {}
        self.tokens_out: dict = {}
        for pipe in self.layout.pipelines:
            first, last = pipe.stages[0], pipe.stages[-1]
            for m in pipe.microbatches:
                if self.local_stage[first]:
                    self.tokens_in[m] = jax.device_put(token_mbs[m], info[first].x.sharding)
                if self.local_stage[last]:
                    self.tokens_out[m] = jax.device_put(token_mbs[m], info[last].tok.sharding)
        self.acc = [i.zeros(sp) if here else None for i, sp, here in zip(info, staged, self.local_stage)]
        self.one = {s: jax.device_put(jnp.ones((), i.gy.dtype), i.gy.sharding)
                    for s, i in enumerate(info) if i.chunk.last and self.local_stage[s]}
        self.losses: dict = {}
        self._local = threading.local()
        self.held: dict = {}        # (stage, mb) -> held values
        self.held_bytes: dict = {}  # (stage, mb) -> bytes (counted only when measuring)
        n = sched.num_ranks
        self.starts = [np.zeros(len(ops)) for ops in sched.ops]
        self.ends = [np.zeros(len(ops)) for ops in sched.ops]
        self.dispatch = [np.zeros(len(ops)) for ops in sched.ops]
        self.peak = np.zeros(n)
        self.stage_memory = {"F": np.zeros(sched.num_stages), "I": np.zeros(sched.num_stages),
                             "I_free": np.zeros(sched.num_stages)}

    # ---- driving -------------------------------------------------------------------------------
    def go(self):
        self.drive()
        return self.finish()

    def drive(self):
        """Run this process's ranks to the end of the step (raises if one failed)."""
        ex = self.ex
        threads = [threading.Thread(target=self._rank_main, args=(r,), name=f"pdjax-pp-rank{r}", daemon=True)
                   for r in self.ranks]
        if ex.measure:   # the step's inputs are in place before its clock starts
            jax.block_until_ready((self.tokens_in, self.tokens_out, self.acc, self.one))
        self.t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:     # a rank stuck past the timeout (e.g. in a device wait) fails the step
            t.join(ex.timeout_s)
            if t.is_alive():
                self._fail(TimeoutError(f"{t.name} did not finish within {ex.timeout_s:.0f} s"))
                break
        if self.failed is not None:
            raise RuntimeError(f"pipeline step failed: {self.failed}") from self.failed

    def _fail(self, exc: BaseException) -> None:
        """The first failure of the step; every rank waiting on a link stops."""
        if self.failed is None:
            self.failed = exc
        self.local.fail()

    def finish(self):
        """``(loss, per-stage grads)`` of a step whose ranks all ran here (its measurements
        stay on this run: ``timeline()``, ``peak``, ``stage_memory``)."""
        loss = None
        dev = self.info[self.layout.pipelines[0].stages[-1]].gy.sharding
        for m in sorted(self.losses):
            val = jax.device_put(self.losses[m], dev)
            loss = val if loss is None else loss + val
        return loss, self.acc

    def _rank_main(self, r: int):
        try:
            live = 0.0
            self._local.outbox = []
            for idx, op in enumerate(self.ex.schedule.ops[r]):
                outs, alloc, free = self._run_op(op)
                if self.ex.measure:
                    jax.block_until_ready(outs)
                t_end = time.perf_counter()
                if self.isolated is not None:
                    self._local.holds = False
                    self.isolated.release()
                    self.dispatch[r][idx] = (self._local.dispatched - self._local.start) * 1e3
                self._flush()
                self.starts[r][idx] = (self._local.start - self.t0) * 1e3
                self.ends[r][idx] = (t_end - self.t0) * 1e3
                self.peak[r] = max(self.peak[r], live + alloc)
                live += alloc - free
        except Aborted:
            return
        except BaseException as exc:  # noqa: BLE001 - reported by go()
            self._fail(exc)
        finally:
            if getattr(self._local, "holds", False):
                self._local.holds = False
                self.isolated.release()

    # ---- ops -------------------------------------------------------------------------------
    def _received(self, key):
        """A value from another stage, from the link its producer is on; when measuring, wait
        until it has landed (its transfer shows as idle time before the op, not inside it)."""
        link = self.local if self.local_stage[source_stage(self.layout, key)] else self.remote
        value = link.expect(key, lambda: self.failed is not None)
        if self.ex.measure:
            jax.block_until_ready(value)
        return value

    def _mark(self, *args):
        """The op's inputs are here: it starts now (alone, when measuring ops in isolation).
        Returns ``args``."""
        if self.isolated is not None:
            self.isolated.acquire()
            self._local.holds = True
        self._local.start = time.perf_counter()
        return args

    def _dispatched(self):
        """The op's program call has returned (dispatch done, the work may still run)."""
        self._local.dispatched = time.perf_counter()

    def _input(self, s: int, m: int):
        if self.info[s].chunk.first:
            return self.tokens_in[m]
        return self._received(("act", s, m))

    def _grad_in(self, s: int, m: int):
        if self.info[s].chunk.last:
            return self.one[s]
        return self._received(("grad", s, m))

    def _send_forward(self, s: int, m: int, y):
        if self.info[s].chunk.last:
            self.losses[m] = y
            return
        nxt = self.layout.next_stage[s]
        self._post(("act", nxt, m), y, self.info[nxt].x.sharding if self.local_stage[nxt] else None)

    def _send_backward(self, s: int, m: int, gx):
        if self.info[s].chunk.first:
            return
        prv = self.layout.prev_stage[s]
        self._post(("grad", prv, m), gx, self.info[prv].gy.sharding if self.local_stage[prv] else None)

    def _post(self, key, value, sharding):
        """Offer ``value`` on the consumer's link (``sharding``: the consumer's, None for a
        stage of another process). When measuring, it is announced once the op's end has been
        recorded, so a consumer never starts before its producer ended."""
        link = self.remote if sharding is None else self.local
        handle = link.offer(key, value, sharding)
        if self.ex.measure:
            self._local.outbox.append((link, handle))
        else:
            link.announce(handle)

    def _flush(self):
        for link, handle in self._local.outbox:
            link.announce(handle)
        self._local.outbox = []

    def _forward_args(self, s, m):
        i = self.info[s]
        return (self.staged[s], self._input(s, m), self.tokens_out[m] if i.chunk.last else None)

    def _size(self, tree) -> int:
        """Bytes of held arrays, counted only when measuring (the training loop does no
        per-op bookkeeping)."""
        return _tree_bytes(tree) if self.ex.measure else 0

    def _after_forward(self, s, m, x, y, res):
        """Hold what the backward needs; returns the bytes allocated."""
        keep_x = x if self.info[s].prog.keeps_input else None
        self.held[(s, m)] = (keep_x, res)
        nbytes = self._size(keep_x) + self._size(res)
        self.held_bytes[(s, m)] = nbytes
        self.stage_memory["F"][s] = nbytes
        self._send_forward(s, m, y)
        return nbytes

    def _backward_args(self, s, m):
        x, res = self.held[(s, m)]
        return x, res, self._grad_in(s, m)

    def _after_input(self, s, m, x, res, gy, gx, carry):
        """Keep what W reads, drop the rest; returns (allocated, freed) bytes."""
        i = self.info[s]
        values = [x, *res, gy]
        keep = set(i.prog.w_keep)
        kept = [values[j] for j in i.prog.w_keep]
        alloc = self._size(carry) + (self._size(gy) if len(values) - 1 in keep else 0)
        freed = sum(self._size(v) for j, v in enumerate(values[:-1]) if j not in keep)
        self.held[(s, m)] = (kept, carry)
        self.held_bytes[(s, m)] += alloc - freed
        self.stage_memory["I"][s], self.stage_memory["I_free"][s] = alloc, freed
        self._send_backward(s, m, gx)
        return alloc, freed

    def _settle_acc(self, s: int) -> None:
        """Keep a stage's gradient accumulator where its next B/W was compiled to find it."""
        if self.info[s].acc_reshard:
            self.acc[s] = jax.device_put(self.acc[s], jax.tree.map(lambda a: a.sharding, self.info[s].sp))

    def _run_op(self, op):
        """Dispatch one op; returns (its outputs, bytes allocated, bytes freed)."""
        if isinstance(op, OverlapFB):
            return self._run_pair(op)
        s, m, i = op.stage, op.microbatch, self.info[op.stage]
        sp = self.staged[s]
        if op.kind == FORWARD:
            args = self._mark(*self._forward_args(s, m))
            y, res = i.F(*args)
            self._dispatched()
            return (y, res), self._after_forward(s, m, args[1], y, res), 0
        if op.kind == FULL_BACKWARD:
            x, res, gy = self._mark(*self._backward_args(s, m))
            self.acc[s], gx = i.B(self.acc[s], sp, x, res, gy)
            self._dispatched()
            self._settle_acc(s)
            del self.held[(s, m)]
            self._send_backward(s, m, gx)
            return (self.acc[s], gx), 0, self.held_bytes.pop((s, m))
        if op.kind == BACKWARD_INPUT:
            x, res, gy = self._mark(*self._backward_args(s, m))
            gx, carry = i.I(sp, x, res, gy)
            self._dispatched()
            alloc, freed = self._after_input(s, m, x, res, gy, gx, carry)
            return (gx, carry), alloc, freed
        kept, carry = self.held.pop((s, m))
        self._mark()
        self.acc[s] = i.W(self.acc[s], sp, kept, carry)
        self._dispatched()
        self._settle_acc(s)
        return self.acc[s], 0, self.held_bytes.pop((s, m))

    def _run_pair(self, op):
        f, bk = op.forward, op.backward
        fi, bi = self.info[f.stage], self.info[bk.stage]
        compiled, reshard = fi.pairs[(bk.stage, bk.kind)]
        fargs = self._forward_args(f.stage, f.microbatch)
        bargs = self._backward_args(bk.stage, bk.microbatch)
        sb = self.staged[bk.stage]
        args = self._mark(*fargs, *bargs)
        fargs, (x, res, gy) = args[:3], args[3:]
        if bk.kind == FULL_BACKWARD:
            (y, fres), (self.acc[bk.stage], gx) = compiled(*fargs, self.acc[bk.stage], sb, x, res, gy)
            self._settle_acc(bk.stage)
            carry = None
        else:
            (y, fres), (gx, carry) = compiled(*fargs, sb, x, res, gy)
        self._dispatched()
        if reshard:
            fres = [jax.device_put(a, sp.sharding) for a, sp in zip(fres, fi.res)]
            if carry is not None:
                carry = [jax.device_put(a, sp.sharding) for a, sp in zip(carry, bi.carry)]
        alloc = self._after_forward(f.stage, f.microbatch, fargs[1], y, fres)
        if bk.kind == FULL_BACKWARD:
            del self.held[(bk.stage, bk.microbatch)]
            self._send_backward(bk.stage, bk.microbatch, gx)
            return (y, fres, gx), alloc, self.held_bytes.pop((bk.stage, bk.microbatch))
        a2, freed = self._after_input(bk.stage, bk.microbatch, x, res, gy, gx, carry)
        return (y, fres, gx, carry), alloc + a2, freed

    # ---- the measured timeline --------------------------------------------------------------
    def timeline(self):
        """The measured timeline of this run (the type :func:`pdjax.schedules.simulate`
        returns), times from the first op's start."""
        starts = [s.copy() for s in self.starts]
        ends = [e.copy() for e in self.ends]
        t0 = min((float(s.min()) for s in starts if s.size), default=0.0)
        return measured_timeline(self.ex.schedule, [s - t0 for s in starts], [e - t0 for e in ends],
                                 memory={k: v.copy() for k, v in self.stage_memory.items()})
