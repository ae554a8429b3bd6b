"""The client and launcher of the two-process PD server (:mod:`pdjax.disagg.serve`).

:class:`TwoProcessServer` (``launch_two_process``) starts the prefill and the decode role as
subprocesses (``python -m pdjax serve --role ...``, random free loopback ports reported on a
``PDJAX_SERVE_READY`` line), sends requests to decode and collects tokens. If the decode
process dies, it is restarted and the unfinished requests are re-issued (tokens already
streamed are not streamed again). Children are killed with SIGKILL (jax catches SIGTERM) and
exit by themselves when the launcher's stdin pipe closes (:func:`exit_when_orphaned`, which
a child calls, as it calls :func:`announce_ready`).
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

from pdjax.disagg.request import RequestError, SamplingParams
from pdjax.disagg.transfer import Control

READY = "PDJAX_SERVE_READY"


def announce_ready(role: str, listener, transfer_address: str) -> None:
    """Child side: the ready line the launcher waits for (the ports the OS picked)."""
    host, port = listener.getsockname()[:2]
    print(f"{READY} " + json.dumps({"role": role, "control": f"{host}:{port}", "transfer": transfer_address,
                                    "pid": os.getpid()}), flush=True)


def child_env(device_count: int, extra: dict | None = None) -> dict:
    """The environment of a child jax process: this one's, on the CPU platform with
    ``device_count`` devices, this checkout importable, then ``extra``."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={device_count}"])
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def file_tail(path: str, chars: int) -> str:
    """The last ``chars`` characters of a (log) file; "" when it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def exit_when_orphaned() -> None:
    """Child side: exit at once when the launcher's stdin pipe closes (the launcher is gone)."""
    def watch():
        try:
            while sys.stdin.buffer.read(1 << 16):
                pass
        finally:
            os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


class PrefillFaults:
    """Test-only fault hooks of the prefill role, armed by a ``fault`` control message
    (:meth:`TwoProcessServer.inject_prefill_fault`): ``arm`` answers it; ``take_stall(prompt)``
    gives ``(layer, seconds, event)`` for the next armed run of that prompt, or None: the
    prefill waits on ``event`` up to ``seconds`` before announcing that layer, and ``notice``
    (each ``prefill`` message received) sets it when the same prompt is sent again, i.e. once
    the decode side has given up on the stalled attempt."""

    def __init__(self):
        self._stalls: dict = {}                 # prompt -> [layer, seconds, runs left]
        self._active: dict = {}                 # prompt -> event of the stalled run
        self._lock = threading.Lock()

    def arm(self, msg: dict, store) -> dict:
        try:
            if "corrupt_prefix" in msg:         # flip a byte of the prompt's first cached block
                return {"op": "fault", "ok": True, "tier": store._corrupt(store.hashes(msg["corrupt_prefix"])[0])}
            with self._lock:
                self._stalls[tuple(msg["prompt"])] = [int(msg["stall_layer"]), float(msg["seconds"]),
                                                      int(msg.get("count", 1))]
            return {"op": "fault", "ok": True}
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
            return {"op": "fault", "ok": False, "error": f"{type(e).__name__}: {e}"}

    def take_stall(self, prompt) -> tuple | None:
        key = tuple(prompt)
        with self._lock:
            s = self._stalls.get(key)
            if s is None or s[2] <= 0:
                return None
            s[2] -= 1
            event = self._active[key] = threading.Event()
            return s[0], s[1], event

    def notice(self, prompt) -> None:
        with self._lock:
            event = self._active.pop(tuple(prompt), None)
        if event is not None:
            event.set()


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

    ``stats`` after ``generate``: per request (ttft seconds as seen by the client, kv_bytes
    received by decode, prefill_attempts, handoff_timeouts, prefix_hit_tokens,
    prefix_errors, reissued), totals ``kv_bytes_received``, ``decode_restarts`` and the
    decode process's counters since it started (``link``: bytes, pulls, seconds spent in
    pulls, link_throughput_Bps = bytes / pull seconds, handoff_timeouts, stale_messages)."""

    def __init__(self, preset: str = "tiny", seed: int = 0, *, prefill_mesh: dict | None = None,
                 decode_mesh: dict | None = None, prefill_devices: int = 4, decode_devices: int = 4,
                 block_size: int = 16, max_decode_slots: int = 4, max_context: int | None = None,
                 num_blocks: int | None = None, prefix_cache: bool | dict = False,
                 handoff_timeout_s: float = 30.0, max_prefill_attempts: int = 3,
                 env: dict | None = None, startup_timeout: float = 120.0):
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
        self.procs: dict = {}
        self._decode_ctl: Control | None = None
        self._events: queue.Queue = queue.Queue()
        self._generation = 0
        self._next_id = 0
        self.decode_restarts = 0
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
        proc = subprocess.Popen([sys.executable, "-m", "pdjax", "serve", "--role", role, *self._argv[role]],
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

    def kill_decode(self) -> None:
        """SIGKILL the decode process (a fault; ``generate`` restarts it and re-issues)."""
        self.procs["decode"][0].kill()

    def inject_prefill_fault(self, **fault) -> dict:
        """Test hook: arm a fault in the prefill process (a ``fault`` control message on a
        connection of its own); returns its reply, raises if it refused. ``prompt=[...],
        stall_layer=l, seconds=s[, count=1]``: the next ``count`` prefill runs of that prompt
        stall before announcing layer l (the prefill process stalls) until the prompt is sent
        to prefill again (decode gave up on the attempt), at most ``s`` seconds;
        ``corrupt_prefix=[...]``: flip a byte of that prompt's first cached prefix block."""
        fault = {k: [int(t) for t in v] if k in ("prompt", "corrupt_prefix") else v for k, v in fault.items()}
        ctl = Control.connect(self.prefill_info["control"])
        try:
            hello = ctl.recv()
            if not hello or hello.get("op") != "hello":
                raise ConnectionError(f"expected hello from the prefill process, got {hello!r}")
            ctl.send({"op": "fault", **fault})
            reply = ctl.recv()
        finally:
            ctl.close()
        if not reply or not reply.get("ok"):
            raise RuntimeError(f"the prefill process refused the fault {fault}: {reply!r}")
        return reply

    def log_tail(self, role: str, chars: int = 4000) -> str:
        return file_tail(os.path.join(self._log_dir, f"{role}.log"), chars)

    def _restart_decode(self) -> None:
        if self._decode_ctl is not None:
            self._decode_ctl.close()
        self._kill("decode")
        self.decode_restarts += 1
        self._spawn("decode")
        self._connect_decode()

    # ---- requests ------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens=16, *, sampling: SamplingParams | list | None = None,
                 stop_tokens=(), on_token=None, timeout: float = 300.0, max_restarts: int = 3,
                 handoff_timeout_s: float | list | None = None, use_prefix_cache: bool = True,
                 retention: str = "chat"):
        """Serve ``prompts`` through the two processes; ``on_token(request_index, token)``
        streams (each token once, also across a decode restart). A decode process that dies
        is restarted (at most ``max_restarts`` times) and the unfinished requests re-issued;
        a dead prefill process, or no result within ``timeout`` seconds, raises.

        ``max_new_tokens``, ``sampling`` and ``handoff_timeout_s`` may be per-request lists;
        ``handoff_timeout_s`` None = the decode process's ``--handoff-timeout``.
        ``use_prefix_cache=False``: these requests neither read nor fill the prefix store;
        ``retention``: the retention class their prefix blocks are stored under."""
        n = len(prompts)
        samplings = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * n
        mnt = _per_request(max_new_tokens, n)
        deadlines = _per_request(handoff_timeout_s, n)
        t0 = time.perf_counter()
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
        for r in reqs.values():
            self._decode_ctl.send(r["msg"])
        results: list = [None] * n
        left = set(reqs)
        restarts = 0
        deadline = time.monotonic() + timeout
        while left:
            try:
                gen, msg = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{len(left)} requests unfinished after {timeout} s; decode log:\n"
                                   f"{self.log_tail('decode')}") from None
            if gen != self._generation:
                continue                              # from a decode process already replaced
            if msg is None:                           # decode died: restart, re-issue the rest
                if self.procs["prefill"][0].poll() is not None:
                    raise RuntimeError(f"the prefill process died; its log:\n{self.log_tail('prefill')}")
                restarts += 1
                if restarts > max_restarts:
                    raise RuntimeError(f"the decode process died {restarts} times in one generate; "
                                       f"its log:\n{self.log_tail('decode')}")
                self._restart_decode()
                for rid in left:
                    reqs[rid]["tokens"], reqs[rid]["reissued"] = [], reqs[rid]["reissued"] + 1
                    self._decode_ctl.send(reqs[rid]["msg"])
                continue
            r = reqs.get(msg.get("request"))
            if msg["op"] == "token" and r is not None:
                r["tokens"].append(msg["token"])
                if r["ttft"] is None:
                    r["ttft"] = time.perf_counter() - t0
                if len(r["tokens"]) > r["streamed"]:
                    r["streamed"] += 1
                    if on_token is not None:
                        on_token(r["index"], msg["token"])
            elif msg["op"] == "done" and r is not None:
                results[r["index"]] = RequestError(msg["error"]) if "error" in msg else list(msg["tokens"])
                r["done"] = msg
                left.discard(msg["request"])
        self._record_stats(reqs, time.perf_counter() - t0)
        return results

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
                      "elapsed_s": elapsed, "decode_restarts": self.decode_restarts, "link": link}

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
