"""The client and launcher of the two-process PD server (:mod:`pdjax.disagg.serve`).

:class:`TwoProcessServer` (``launch_two_process``) starts the prefill and the decode role as
subprocesses (``python -m pdjax serve --role ...``, random free loopback ports reported on a
``PDJAX_SERVE_READY`` line), sends requests to decode and collects tokens. If the decode
process dies, it is restarted and the unfinished requests are re-issued (tokens already
streamed are not streamed again). If the prefill process dies, decode fails its attempts in
flight and says so (``prefill_lost``); the launcher restarts it and gives decode its
address, and decode prefills those requests again. Children are killed with SIGKILL (jax
catches SIGTERM) and exit by themselves when the launcher's stdin pipe closes.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from pdjax.disagg.children import READY, child_env, file_tail
from pdjax.disagg.request import RequestError, SamplingParams
from pdjax.cluster.transfer import Control


def _per_request(value, n: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


class TwoProcessServer:
    """Starts a prefill and a decode process (``pdjax serve``), each with ``*_devices`` CPU
    devices, and serves requests through them. ``generate`` has the PDEngine interface
    (token lists in request order, a :class:`RequestError` in place of a bad request).

    ``prefix_cache``: False (default), True or a dict of :class:`~pdjax.disagg.prefix_store.
    PrefixStore` options (``device_blocks``, ``host_blocks``, ``disk_blocks``, ``disk_dir``,
    ``retention``; defaults 0 device and 256 host blocks, as ``PDEngine(prefix_cache=...)``):
    a prefix KV store in the prefill process, blocks of ``block_size`` tokens.
    ``handoff_timeout_s``: decode's deadline for a prefill attempt without progress; the
    reservation is then cancelled and the request re-prefilled (``max_prefill_attempts``).
    ``env``: extra environment for both children (e.g. ``JAX_DEFAULT_MATMUL_PRECISION``).
    ``serve_command``: the command that starts a role, followed by ``--role ROLE`` and its
    options (default ``python -m pdjax serve``; the fault tests start their own entry point).

    ``stats`` after ``generate``: per request (ttft seconds as seen by the client, kv_bytes
    received by decode, prefill_attempts, handoff_timeouts, prefix_hit_tokens,
    prefix_errors, reissued), totals ``kv_bytes_received``, ``decode_restarts``,
    ``prefill_restarts`` and the decode process's counters since it started (``link``:
    bytes, pulls, seconds spent in pulls, link_throughput_Bps = bytes / pull seconds,
    handoff_timeouts, stale_messages, corrupt_payloads)."""

    def __init__(self, preset: str = "tiny", seed: int = 0, *, prefill_mesh: dict | None = None,
                 decode_mesh: dict | None = None, prefill_devices: int = 4, decode_devices: int = 4,
                 block_size: int = 16, max_decode_slots: int = 4, max_context: int | None = None,
                 num_blocks: int | None = None, prefix_cache: bool | dict = False,
                 handoff_timeout_s: float = 30.0, max_prefill_attempts: int = 3,
                 env: dict | None = None, startup_timeout: float = 120.0, serve_command=None):
        self.startup_timeout = startup_timeout
        self._log_dir = tempfile.mkdtemp(prefix="pdjax-serve-")
        common = ["--preset", preset, "--seed", str(seed), "--block-size", str(block_size)]
        store = {} if prefix_cache is True else prefix_cache
        self._argv = {
            "prefill": common + ["--mesh", json.dumps(prefill_mesh or {"expert": prefill_devices})]
            + (["--prefix-cache", json.dumps(store)] if store is not False and store is not None else []),
            "decode": common + ["--mesh", json.dumps(decode_mesh or {"expert": decode_devices}),
                                "--slots", str(max_decode_slots), "--handoff-timeout", str(handoff_timeout_s),
                                "--max-prefill-attempts", str(max_prefill_attempts)]
            + (["--max-context", str(max_context)] if max_context else [])
            + (["--num-blocks", str(num_blocks)] if num_blocks else []),
        }
        self._devices = {"prefill": prefill_devices, "decode": decode_devices}
        self._env = dict(env or {})
        self._serve = list(serve_command or [sys.executable, "-m", "pdjax", "serve"])
        self.procs: dict = {}
        self._decode_ctl: Control | None = None
        self._events: queue.Queue = queue.Queue()
        self._generation = 0
        self._next_id = 0
        self.decode_restarts = self.prefill_restarts = 0
        self.stats: dict = {}
        try:
            self._spawn("prefill")
            self._spawn("decode")                     # both start (import, params, pools) at once
            self.prefill_info = self._wait_ready("prefill")
            self._connect_decode()
        except BaseException:
            self.close()
            raise

    # ---- processes -----------------------------------------------------------------------
    def _spawn(self, role: str) -> None:
        env = child_env(self._devices[role], self._env)
        log = open(os.path.join(self._log_dir, f"{role}.log"), "ab")
        proc = subprocess.Popen([*self._serve, "--role", role, *self._argv[role]],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        log.close()
        lines: queue.Queue = queue.Queue()

        def read_stdout():
            for line in proc.stdout:
                lines.put(line.decode(errors="replace"))
            lines.put(None)
        threading.Thread(target=read_stdout, daemon=True).start()
        self.procs[role] = (proc, lines)

    def _wait_ready(self, role: str) -> dict:
        proc, lines = self.procs[role]
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self._kill(role)
                raise RuntimeError(f"the {role} process did not start (exit code {proc.poll()}); "
                                   f"log tail:\n{self.log_tail(role)}")
            if line.startswith(READY):
                return json.loads(line[len(READY):])

    def _connect_decode(self) -> None:
        info = self._wait_ready("decode")
        ctl = Control.connect(info["control"])
        ctl.send({"op": "hello", "prefill": self.prefill_info["control"]})
        self._generation += 1
        self._decode_ctl = ctl

        def read(gen=self._generation):
            try:
                while (msg := ctl.recv()) is not None:
                    self._events.put((gen, msg))
            except (OSError, ValueError):
                pass
            self._events.put((gen, None))
        threading.Thread(target=read, daemon=True).start()

    def _kill(self, role: str) -> None:
        proc, _ = self.procs.get(role, (None, None))
        if proc is not None and proc.poll() is None:
            proc.kill()                               # SIGKILL: jax catches SIGTERM
            proc.wait(timeout=30)

    def log_tail(self, role: str, chars: int = 4000) -> str:
        return file_tail(os.path.join(self._log_dir, f"{role}.log"), chars)

    def _restart_decode(self) -> None:
        if self._decode_ctl is not None:
            self._decode_ctl.close()
        self._kill("decode")
        self.decode_restarts += 1
        self._spawn("decode")
        self._connect_decode()

    def _restart_prefill(self) -> None:
        """A new prefill process (the old one killed if it lingers); decode connects to it."""
        self._kill("prefill")
        self.prefill_restarts += 1
        self._spawn("prefill")
        self.prefill_info = self._wait_ready("prefill")
        self._decode_ctl.send({"op": "prefill", "address": self.prefill_info["control"]})

    # ---- requests ------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens=16, *, sampling: SamplingParams | list | None = None,
                 stop_tokens=(), on_token=None, timeout: float = 300.0, max_restarts: int = 3,
                 handoff_timeout_s: float | list | None = None, use_prefix_cache: bool = True,
                 retention: str = "chat"):
        """Serve ``prompts`` through the two processes; ``on_token(request_index, token)``
        streams (each token once, also across a decode restart). A process that dies is
        restarted (each role at most ``max_restarts`` times per call): a new decode process
        gets the unfinished requests again, a new prefill process the attempts decode lost
        with the old one. No result within ``timeout`` seconds raises.

        ``max_new_tokens``, ``sampling`` and ``handoff_timeout_s`` may be per-request lists;
        ``handoff_timeout_s`` None = the decode process's ``--handoff-timeout``.
        ``use_prefix_cache=False``: these requests neither read nor fill the prefix store;
        ``retention``: the retention class their prefix blocks are stored under."""
        t0 = time.perf_counter()
        reqs = self._messages(prompts, max_new_tokens, sampling, stop_tokens, handoff_timeout_s,
                              use_prefix_cache, retention)
        for r in reqs.values():
            self._decode_ctl.send(r["msg"])
        results: list = [None] * len(prompts)
        left = set(reqs)
        restarts = {"decode": 0, "prefill": 0}
        deadline = time.monotonic() + timeout
        while left:
            try:
                gen, msg = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{len(left)} requests unfinished after {timeout} s; decode log:\n"
                                   f"{self.log_tail('decode')}") from None
            if gen != self._generation:
                continue                              # from a decode process already replaced
            if msg is None or msg["op"] == "prefill_lost":
                role = "decode" if msg is None else "prefill"
                restarts[role] += 1
                if restarts[role] > max_restarts:
                    raise RuntimeError(f"the {role} process died {restarts[role]} times in one generate; "
                                       f"its log:\n{self.log_tail(role)}")
                self._recover(role, reqs, left)
                continue
            r = reqs.get(msg.get("request"))
            if r is not None:
                self._on_result(r, msg, results, left, on_token, t0)
        self._record_stats(reqs, time.perf_counter() - t0)
        return results

    def _messages(self, prompts, max_new_tokens, sampling, stop_tokens, handoff_timeout_s, use_prefix_cache,
                  retention) -> dict:
        """request id -> {index, its generate message, what came back so far}."""
        n = len(prompts)
        samplings = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * n
        mnt, deadlines = _per_request(max_new_tokens, n), _per_request(handoff_timeout_s, n)
        reqs = {}
        for i, p in enumerate(prompts):
            s = samplings[i]
            rid, self._next_id = self._next_id, self._next_id + 1
            msg = {"op": "generate", "request": rid, "prompt": [int(t) for t in p], "max_new_tokens": mnt[i],
                   "sampling": {"temperature": s.temperature, "top_p": s.top_p, "seed": s.seed},
                   "stop_tokens": [int(t) for t in stop_tokens], "prefix_cache": bool(use_prefix_cache),
                   "retention": str(retention)}
            if deadlines[i] is not None:
                msg["handoff_timeout_s"] = float(deadlines[i])
            reqs[rid] = {"index": i, "streamed": 0, "tokens": [], "ttft": None, "reissued": 0, "msg": msg}
        return reqs

    def _recover(self, role: str, reqs: dict, left: set) -> None:
        """A role died: restart it; a new decode gets the unfinished requests again."""
        if role == "prefill" or self.procs["prefill"][0].poll() is not None:
            self._restart_prefill()
        if role == "decode":
            self._restart_decode()
            for rid in left:
                reqs[rid]["tokens"], reqs[rid]["reissued"] = [], reqs[rid]["reissued"] + 1
                self._decode_ctl.send(reqs[rid]["msg"])

    def _on_result(self, r: dict, msg: dict, results: list, left: set, on_token, t0: float) -> None:
        if msg["op"] == "token":
            r["tokens"].append(msg["token"])
            if r["ttft"] is None:
                r["ttft"] = time.perf_counter() - t0
            if len(r["tokens"]) > r["streamed"]:      # not streamed before a decode restart
                r["streamed"] += 1
                if on_token is not None:
                    on_token(r["index"], msg["token"])
        elif msg["op"] == "done":
            results[r["index"]] = RequestError(msg["error"]) if "error" in msg else list(msg["tokens"])
            r["done"] = msg
            left.discard(msg["request"])
    def _record_stats(self, reqs, elapsed) -> None:
        self._decode_ctl.send({"op": "stats"})
        link = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                gen, msg = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if gen == self._generation and msg is not None and msg["op"] == "stats":
                link = {k: v for k, v in msg.items() if k != "op"}
                break
        per = []
        for r in sorted(reqs.values(), key=lambda r: r["index"]):
            d = r.get("done", {})
            per.append({"index": r["index"], "ttft": r["ttft"], "kv_bytes_received": d.get("kv_bytes", 0),
                        "prefill_attempts": d.get("prefill_attempts", 0),
                        "handoff_timeouts": d.get("handoff_timeouts", 0),
                        "prefix_hit_tokens": d.get("prefix_hit_tokens", 0),
                        "prefix_errors": list(d.get("prefix_errors", [])), "reissued": r["reissued"]})
        self.stats = {"requests": per, "kv_bytes_received": sum(d["kv_bytes_received"] for d in per),
                      "elapsed_s": elapsed, "decode_restarts": self.decode_restarts,
                      "prefill_restarts": self.prefill_restarts, "link": link}

    def close(self) -> None:
        """Shut both processes down (SIGKILL after a short grace) and remove the logs."""
        try:
            if self._decode_ctl is not None:
                self._decode_ctl.send({"op": "shutdown"})
        except OSError:
            pass
        for role, (proc, _) in list(self.procs.items()):
            try:
                proc.stdin.close()                    # the child's watchdog exits on EOF
            except OSError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._kill(role)
        if self._decode_ctl is not None:
            self._decode_ctl.close()
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def launch_two_process(preset: str = "tiny", seed: int = 0, **kwargs) -> TwoProcessServer:
    """Start the prefill and decode processes; see :class:`TwoProcessServer`."""
    return TwoProcessServer(preset, seed, **kwargs)
