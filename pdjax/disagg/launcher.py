"""The client and launcher of PD serving across processes (:mod:`pdjax.disagg.serve`): one
prefill process and one or more decode processes behind one router.

:class:`PDCluster` (``launch_pd``; one decode instance by default) starts the roles as
subprocesses (``python -m pdjax serve --role ...``) on
one :class:`~pdjax.cluster.supervisor.Supervisor`, each reporting its control and transfer
addresses on a ready line. The client connects to every decode instance and sends each
request to one of them (:mod:`pdjax.disagg.router`: least loaded by default); every decode
instance pulls its requests' KV from the prefill process over ``jax.experimental.transfer``.

Failures: a decode instance that dies (its control connection ends) is restarted in the
background, and its unfinished requests are re-issued at once to the live instance the
router picks (with one instance: to its restart); tokens already streamed are not streamed
again. If the prefill process dies, each decode instance fails its attempts in flight and
says so (``prefill_lost``); the client restarts the prefill process once and gives every
decode instance its address, and they prefill those requests again. Processes are killed
with SIGKILL (jax catches SIGTERM) and exit by themselves when the client's process ends.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time

from pdjax.arguments import check_int
from pdjax.cluster.supervisor import LaunchError, Supervisor, device_environ
from pdjax.cluster.messages import Channel
from pdjax.cluster.transfer import LOOPBACK
from pdjax.disagg.request import RequestError, SamplingParams
from pdjax.disagg.router import Router, Tracked, least_loaded
from pdjax.disagg.wire import CLIENT_DECODE

PREFILL = 0                     # the prefill process's index on the supervisor; decode k is k + 1


def _per_request(value, n: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


class PDCluster:
    """Starts a prefill process and ``num_decode`` decode processes (``pdjax serve``), with
    ``prefill_devices`` and ``decode_devices`` CPU devices each, and serves requests through
    them. ``generate`` has the PDEngine interface (token lists in request order, a
    :class:`RequestError` in place of a bad request).

    ``prefix_cache``: False (default), True or a dict of :class:`~pdjax.disagg.prefix_store.
    PrefixStore` options (defaults 0 device and 256 host blocks, as ``PDEngine``): a prefix
    KV store in the prefill process, blocks of ``block_size`` tokens. ``handoff_timeout_s``:
    a decode instance's deadline for a prefill attempt without progress (then re-prefilled,
    ``max_prefill_attempts``); ``pull_timeout_s``: its deadline on each KV pull. ``host``:
    the address every role's control listener and transfer server bind to (default
    loopback). ``router``: the routing policy ``policy(loads) -> instance``
    (:func:`~pdjax.disagg.router.least_loaded`). ``env``: extra environment for every
    process; ``serve_command``: the command that starts a role, followed by ``--role ROLE``
    and its options (default ``python -m pdjax serve``); ``stream``: where the processes'
    output goes, prefixed with their names (None: kept for ``log_tail`` only).

    Process names: ``"prefill"``, ``"decode0"``, ``"decode1"``, ... (``"decode"`` =
    ``"decode0"``): ``pid(name)``, ``kill(name)`` (SIGKILL; the cluster recovers as from a
    crash), ``log_tail(name)``. ``stats`` of the last ``generate`` (every count is that call's,
    as in the engines): per request (index, instance
    that finished it, ttft seconds as seen by the client, kv_bytes_received, prefill_attempts,
    handoff_timeouts, prefix_hit_tokens, prefix_errors, reissued), totals
    ``kv_bytes_received``, ``served`` (requests finished per instance), ``decode_restarts``,
    ``prefill_restarts``, ``link`` (the decode instances' counters in this call,
    summed: bytes, pulls, seconds in pulls, link_throughput_Bps, handoff_timeouts,
    stale_messages, corrupt_payloads, malformed_payloads) and ``instances`` (each one's
    counters, with what its pool holds once the batch is done: ``free_blocks`` per rank,
    ``reservations``, ``running``, ``attempts``; see ``DecodeServer.held``)."""

    def __init__(self, preset: str = "tiny", seed: int = 0, *, num_decode: int = 1,
                 prefill_mesh: dict | None = None, decode_mesh: dict | None = None, prefill_devices: int = 4,
                 decode_devices: int = 4, block_size: int = 16, max_decode_slots: int = 4,
                 max_context: int | None = None, num_blocks: int | None = None, prefix_cache: bool | dict = False,
                 handoff_timeout_s: float = 30.0, max_prefill_attempts: int = 3, pull_timeout_s: float = 60.0,
                 host: str = LOOPBACK, router=least_loaded, env: dict | None = None,
                 startup_timeout: float = 120.0, serve_command=None, stream=None):
        self.num_decode = check_int("num_decode", num_decode)
        self.startup_timeout = startup_timeout
        self.names = ["prefill"] + [f"decode{k}" for k in range(num_decode)]
        common = ["--preset", preset, "--seed", str(seed), "--block-size", str(block_size), "--host", host]
        store = {} if prefix_cache is True else prefix_cache
        prefill = common + ["--mesh", json.dumps(prefill_mesh or {"expert": prefill_devices})] + (
            ["--prefix-cache", json.dumps(store)] if store is not False and store is not None else [])
        decode = common + ["--mesh", json.dumps(decode_mesh or {"expert": decode_devices}),
                           "--slots", str(max_decode_slots), "--handoff-timeout", str(handoff_timeout_s),
                           "--max-prefill-attempts", str(max_prefill_attempts), "--pull-timeout", str(pull_timeout_s)]
        decode += (["--max-context", str(max_context)] if max_context else []) + (
            ["--num-blocks", str(num_blocks)] if num_blocks else [])
        serve = list(serve_command or [sys.executable, "-m", "pdjax", "serve"])
        self.procs = Supervisor(stream=stream, tail_lines=400)
        self.router = Router(num_decode, router)
        self._ctl: list = [None] * num_decode
        self._gen = [0] * num_decode
        self._events: queue.Queue = queue.Queue()
        self.decode_restarts = self.prefill_restarts = 0
        self._seen: dict = {}                 # instance -> (generation, its counters at the last call's end)
        self.stats: dict = {}
        try:
            for name in self.names:                       # every role starts (imports, params, pools) at once
                role, devices = ("prefill", prefill_devices) if name == "prefill" else ("decode", decode_devices)
                self.procs.start([*serve, "--role", role, *(prefill if role == "prefill" else decode)],
                                 device_environ(devices, env), name=name, prefix=f"[{name}]", orphan_pipe=True)
            self.prefill_info = self.procs.wait_ready(PREFILL, startup_timeout)
            for k in range(num_decode):
                self._connect(k, self.procs.wait_ready(k + 1, startup_timeout))
        except BaseException:
            self.close()
            raise

    # ---- processes -----------------------------------------------------------------------
    def _index(self, name: str) -> int:
        name = "decode0" if name == "decode" else name
        if name not in self.names:
            raise ValueError(f"no process {name!r}; the processes are {self.names}")
        return self.names.index(name)

    def pid(self, name: str) -> int:
        return self.procs.pid(self._index(name))

    def kill(self, name: str) -> None:
        """SIGKILL process ``name`` (a test's crash); the cluster recovers as from any death."""
        self.procs.kill(self._index(name), wait=False)

    def log_tail(self, name: str, lines: int = 60) -> str:
        return self.procs.tail(self._index(name), lines)

    def wait_up(self, timeout: float = 120.0) -> None:
        """Wait until every decode instance takes requests (one restarting after a death is
        connected when ready); TimeoutError past ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not all(self.router.live):
            got = self._next(deadline)
            if got is None:
                down = [f"decode{k}" for k, up in enumerate(self.router.live) if not up]
                raise TimeoutError(f"{down} not up after {timeout} s")
            self._recover_between_calls(*got)

    def _recover_between_calls(self, k: int, msg: dict | None) -> bool:
        """Recover from a death (``msg`` None: decode instance ``k``; ``prefill_lost``: the
        prefill process) seen outside a generate's loop; whether ``msg`` was one."""
        if msg is not None and msg["op"] != "prefill_lost":
            return False
        self._recover(k, msg, {"decode": 0, "prefill": 0}, max_restarts=3)
        return True

    def _connect(self, k: int, info: dict) -> None:
        """Connect to decode instance ``k`` (ready with ``info``) and route requests to it."""
        ctl = Channel.connect(info["control"], CLIENT_DECODE, "client")
        ctl.send({"op": "hello", "prefill": self.prefill_info["control"]})
        self._gen[k] += 1
        self._ctl[k] = ctl

        def read(gen=self._gen[k]):
            try:
                while (msg := ctl.recv()) is not None:
                    self._events.put(("decode", k, gen, msg))
            except (OSError, ValueError):
                pass
            self._events.put(("decode", k, gen, None))
        threading.Thread(target=read, daemon=True, name=f"pdjax-client-decode{k}").start()
        self.router.up(k)

    def _restart_decode(self, k: int) -> None:
        """Start decode instance ``k`` again; it is connected when ready (an ``up`` event)."""
        if self._ctl[k] is not None:
            self._ctl[k].close()
            self._ctl[k] = None
        self.decode_restarts += 1
        self.procs.restart(k + 1)

        def wait():
            try:
                self._events.put(("up", k, self.procs.wait_ready(k + 1, self.startup_timeout)))
            except LaunchError as e:
                self._events.put(("start_failed", k, e))
        threading.Thread(target=wait, daemon=True, name=f"pdjax-client-start{k}").start()

    def _restart_prefill(self) -> None:
        """A new prefill process (the old one killed if it lingers); every decode instance
        connected now is given its address (one connecting later gets it in its hello)."""
        self.procs.restart(PREFILL)
        self.prefill_restarts += 1
        self.prefill_info = self.procs.wait_ready(PREFILL, self.startup_timeout)
        self._broadcast({"op": "prefill", "address": self.prefill_info["control"]})

    def _broadcast(self, msg: dict) -> list[int]:
        sent = []
        for k, ctl in enumerate(self._ctl):
            if ctl is not None and self.router.live[k]:
                try:
                    ctl.send(msg)
                    sent.append(k)
                except OSError:                           # it just died: its reader reports it
                    pass
        return sent

    def _send(self, assignments) -> None:
        for k, msg in assignments:
            try:
                self._ctl[k].send(msg)
            except OSError:                               # it just died: re-issued when its reader says so
                pass

    def _next(self, deadline: float):
        """The next message of a decode instance as ``(k, msg)`` (msg None: it died; ``{"op":
        "up"}``: it was restarted and is connected now, queued requests routed), or None at
        ``deadline``."""
        while True:
            try:
                kind, k, *rest = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if kind == "up":
                self._connect(k, rest[0])
                self._send(self.router.assign())
                return k, {"op": "up"}
            elif kind == "start_failed":
                raise RuntimeError(f"decode instance {k} did not restart: {rest[0]}")
            elif rest[0] == self._gen[k]:                 # not from an instance already replaced
                return k, rest[1]

    # ---- requests ------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens=16, *, sampling: SamplingParams | list | None = None,
                 stop_tokens=(), on_token=None, timeout: float = 300.0, max_restarts: int = 3,
                 handoff_timeout_s: float | list | None = None, use_prefix_cache: bool = True,
                 retention: str = "chat"):
        """Serve ``prompts``; ``on_token(request_index, token)`` streams (each token once, also
        across a re-issue). A process that dies is restarted (each role at most
        ``max_restarts`` times per call): a dead decode instance's unfinished requests go to
        another instance (or its restart), a new prefill process gets the attempts the decode
        instances lost with the old one. No result within ``timeout`` seconds raises.

        ``max_new_tokens``, ``sampling`` and ``handoff_timeout_s`` may be per-request lists;
        ``handoff_timeout_s`` None = the decode processes' ``--handoff-timeout``.
        ``use_prefix_cache=False``: these requests neither read nor fill the prefix store;
        ``retention``: the retention class their prefix blocks are stored under."""
        t0 = time.perf_counter()
        reqs = self._requests(prompts, max_new_tokens, sampling, stop_tokens, handoff_timeout_s,
                              use_prefix_cache, retention)
        before = (list(self.router.served), self.decode_restarts, self.prefill_restarts)
        self.router.submit(reqs)
        self._send(self.router.assign())
        deaths = {"decode": 0, "prefill": 0}
        deadline = time.monotonic() + timeout
        while any(r.done is None for r in reqs):
            got = self._next(deadline)
            if got is None:
                left = sum(r.done is None for r in reqs)
                raise TimeoutError(f"{left} requests unfinished after {timeout} s; the processes' last lines:\n"
                                   + "\n".join(f"[{n}] {self.log_tail(n, 10)}" for n in self.names))
            k, msg = got
            if msg is None or msg["op"] == "prefill_lost":
                self._recover(k, msg, deaths, max_restarts)
            elif (r := self.router.get(msg.get("request"))) is not None:
                self._on_result(r, msg, on_token, t0)
        self.router.forget(reqs)
        self._record_stats(reqs, time.perf_counter() - t0, before)
        return [RequestError(r.done["error"]) if "error" in r.done else list(r.done["tokens"]) for r in reqs]

    def _requests(self, prompts, max_new_tokens, sampling, stop_tokens, handoff_timeout_s, use_prefix_cache,
                  retention) -> list[Tracked]:
        n = len(prompts)
        samplings = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * n
        mnt, deadlines = _per_request(max_new_tokens, n), _per_request(handoff_timeout_s, n)
        out = []
        for i, p in enumerate(prompts):
            s = samplings[i]
            msg = {"op": "generate", "prompt": [int(t) for t in p], "max_new_tokens": mnt[i],
                   "sampling": {"temperature": s.temperature, "top_p": s.top_p, "seed": s.seed},
                   "stop_tokens": [int(t) for t in stop_tokens], "prefix_cache": bool(use_prefix_cache),
                   "retention": str(retention)}
            if deadlines[i] is not None:
                msg["handoff_timeout_s"] = float(deadlines[i])
            out.append(Tracked(i, msg))
        return out

    def _recover(self, k: int, msg: dict | None, deaths: dict, max_restarts: int) -> None:
        """Decode instance ``k`` died (``msg`` None) or lost the prefill process."""
        role = "decode" if msg is None else "prefill"
        if role == "prefill" and msg.get("address", self.prefill_info["control"]) != self.prefill_info["control"]:
            return                                        # a prefill process already replaced
        deaths[role] += 1
        if deaths[role] > max_restarts:
            name = f"decode{k}" if role == "decode" else "prefill"
            raise RuntimeError(f"the {role} processes died {deaths[role]} times in one generate; {name}'s last "
                               f"output lines:\n{self.log_tail(name)}")
        if role == "decode":
            self.router.lost(k)                           # re-issued below, or when an instance is up
            if self.procs.poll()[PREFILL] is not None:
                self._restart_prefill()
            self._restart_decode(k)
            self._send(self.router.assign())
        else:
            self._restart_prefill()

    def _on_result(self, r: Tracked, msg: dict, on_token, t0: float) -> None:
        if msg["op"] == "token":
            if self.router.token(r, msg["token"], time.perf_counter() - t0) and on_token is not None:
                on_token(r.index, msg["token"])
        elif msg["op"] == "done":
            self.router.finish(r, msg)

    def _record_stats(self, reqs: list[Tracked], elapsed: float, before: tuple) -> None:
        """``self.stats`` of this call: every count is this call's (the decode processes'
        counters minus what they had at the last call's end, unless restarted since)."""
        asked = set(self._broadcast({"op": "stats"}))
        counters: dict = {}
        deadline = time.monotonic() + 30
        while asked - set(counters):
            got = self._next(deadline)
            if got is None:
                break
            k, msg = got
            if msg is None:
                asked.discard(k)
            if self._recover_between_calls(k, msg):   # a death after the last result: recovered, not lost
                continue
            if msg["op"] == "stats":
                counters[k] = self._this_call(k, msg["counters"])
        per = []
        for r in reqs:
            d = r.done
            per.append({"index": r.index, "instance": r.instance, "ttft": r.ttft,
                        "kv_bytes_received": d.get("kv_bytes", 0), "prefill_attempts": d.get("prefill_attempts", 0),
                        "handoff_timeouts": d.get("handoff_timeouts", 0),
                        "prefix_hit_tokens": d.get("prefix_hit_tokens", 0),
                        "prefix_errors": list(d.get("prefix_errors", [])), "reissued": r.reissued})
        self.stats = {"requests": per, "kv_bytes_received": sum(d["kv_bytes_received"] for d in per),
                      "elapsed_s": elapsed, "served": [b - a for a, b in zip(before[0], self.router.served)],
                      "decode_restarts": self.decode_restarts - before[1],
                      "prefill_restarts": self.prefill_restarts - before[2],
                      "link": _summed([counters[k] for k in sorted(counters)]),
                      "instances": [counters.get(k) for k in range(self.num_decode)]}

    def _this_call(self, k: int, now: dict) -> dict:
        """Decode instance ``k``'s counters less those it had at the last call's end (the same
        process); what its pool holds (:data:`HELD`) as it is now."""
        gen, last = self._seen.get(k, (None, {}))
        self._seen[k] = (self._gen[k], now)
        if gen != self._gen[k]:
            last = {}
        out = {key: (v - last.get(key, 0) if key not in HELD and _is_count(v) else v) for key, v in now.items()}
        return _with_throughput(out)

    def close(self) -> None:
        """SIGKILL every process (and wait for it)."""
        for ctl in getattr(self, "_ctl", []):
            if ctl is not None:
                ctl.close()
        self.procs.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


HELD = ("free_blocks", "reservations", "running", "attempts", "link_throughput_Bps")   # states, not counts


def _is_count(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _summed(counters: list[dict]) -> dict:
    """Numeric counters of several decode instances added up (throughput: bytes / seconds)."""
    out: dict = {}
    for c in counters:
        for key, v in c.items():
            if _is_count(v):
                out[key] = out.get(key, 0) + v
    return _with_throughput(out)


def _with_throughput(counters: dict) -> dict:
    """``counters`` with ``link_throughput_Bps`` recomputed from its bytes and pull seconds
    (a rate does not add up or subtract)."""
    if "pull_seconds" in counters:
        s = counters["pull_seconds"]
        counters["link_throughput_Bps"] = counters["kv_bytes_received"] / s if s else 0.0
    return counters


def launch_pd(preset: str = "tiny", seed: int = 0, *, num_decode: int = 1, **kwargs) -> PDCluster:
    """Start one prefill and ``num_decode`` decode processes (default one, as
    :class:`PDCluster`); see :class:`PDCluster`."""
    return PDCluster(preset, seed, num_decode=num_decode, **kwargs)
