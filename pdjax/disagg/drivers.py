"""The drivers of one in-process engine ``generate`` (:class:`EngineRun`): prefill worker
threads, the decode loop on the calling thread, and the DOPD signals."""

from __future__ import annotations

import functools
import queue
import threading

from pdjax.disagg.loop import DecodeLoop
from pdjax.disagg.scheduler import Admitted, CancelPrefill, DecodeScheduler, Failed, LayerArrived, StartPrefill, Token
from pdjax.disagg.signals import Signals
from pdjax.disagg.worker import PrefillJob, PrefillWorker


class EngineRun:
    """The drivers of one ``generate``: a prefill worker thread per prefill pool (each
    attempt to the worker predicted to finish it first), the decode loop on the calling
    thread, and the DOPD signals. A worker that dies (a BaseException escaping its run) fails
    its attempt and is started again; the request is prefilled again like any failure. An
    attempt cancelled while its thread runs it (a send that stalls, or never returns) gets
    the worker a fresh thread for the next jobs; the old one ends when its call returns."""

    def __init__(self, eng, sched: DecodeScheduler, clock, on_token):
        self.eng, self.sched, self.clock, self.on_token = eng, sched, clock, on_token
        self.jobs = [queue.Queue() for _ in eng.prefills]
        self.workers = [PrefillWorker(pool, eng.link, clock, store=eng.store, chunk=eng._chunker(pool),
                                      step_lock=eng._pool_lock, timeline=eng.timeline) for pool in eng.prefills]
        self.signals = Signals(eng.link_bandwidth_Bps, lambda: sum(q.qsize() for q in self.jobs) + len(sched.waiting),
                               clock)
        self.loop = DecodeLoop(sched, eng.decode, clock, self.carry, step_lock=eng._pool_lock,
                               on_event=self._observe, on_turn=self.signals.sample)
        self.free_at = [0.0] * len(self.jobs)
        self.assigned: dict = {}                  # (request, attempt) -> worker
        self.restarts = 0
        self._stop = threading.Event()
        self.generation = [0] * len(self.workers)  # a worker's current thread; older ones end
        self.running: list = [None] * len(self.workers)   # (request, attempt) its thread runs
        self.threads = [self._start(w) for w in range(len(self.workers))]

    def _start(self, w: int) -> threading.Thread:
        self.generation[w] += 1
        self.running[w] = None
        t = threading.Thread(target=self._work, args=(w, self.generation[w]), daemon=True)
        t.start()
        return t

    def _work(self, w: int, generation: int) -> None:
        worker, jobs = self.workers[w], self.jobs[w]
        while not self._stop.is_set() and self.generation[w] == generation:
            try:
                job = jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            self.running[w] = (job.request, job.attempt)
            try:
                worker.run(job, self.loop.post)
            except BaseException as e:  # noqa: BLE001 - the worker died: the loop restarts it
                self.loop.post(functools.partial(self._died, w, generation, job, e))
                return
            finally:
                if self.generation[w] == generation:
                    self.running[w] = None

    def _died(self, w: int, generation: int, job: PrefillJob, error: BaseException, loop: DecodeLoop) -> None:
        if generation == self.generation[w]:      # (an abandoned thread was replaced already)
            self.restarts += 1
            self.threads[w] = self._start(w)
        loop.handle(Failed(job.request, job.attempt, f"the prefill worker died: {type(error).__name__}: {error}",
                           self.clock.now()))

    def carry(self, actions) -> None:
        for a in actions:
            if isinstance(a, StartPrefill):
                w = self.eng._pick_worker(a.attempt.request, self.free_at, self.clock.now())
                self.assigned[(a.attempt.request.index, a.attempt.number)] = w
                self.jobs[w].put(PrefillJob.of(a.attempt))
            elif isinstance(a, CancelPrefill):
                w = self.assigned.pop((a.request, a.attempt))
                self.workers[w].cancel(a.request, a.attempt)
                if self.running[w] == (a.request, a.attempt):   # its thread may be held in a send
                    self.threads[w] = self._start(w)
            elif isinstance(a, Admitted):
                self.signals.kv_waits.append(a.request.kv_wait_s)
            elif isinstance(a, Token) and self.on_token is not None:
                self.on_token(a.request.index, a.token)

    def _observe(self, event) -> None:
        if isinstance(event, LayerArrived):
            self.signals.bytes += event.nbytes

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=60)
