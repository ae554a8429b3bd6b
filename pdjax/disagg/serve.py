"""Two-process PD serving: a prefill process and a decode process on one host, the latent KV
moved layer by layer with ``jax.experimental.transfer`` (:mod:`pdjax.disagg.transfer`).

Roles (``pdjax serve --role prefill|decode``), each on its own CPU devices, both building the
same params from ``(preset, seed)``:

- **prefill** owns a :class:`~pdjax.disagg.prefill.PrefillPool`; it accepts decode processes
  on a control socket and, for each ``prefill`` message, runs the prompt layer by layer,
  offering layer l's rows ``[T, C+R]`` (``await_pull``) and announcing them the moment layer l
  is dispatched, so the pull of layer l overlaps the compute of layer l+1; then ``ready`` with
  the first token.
- **decode** owns a :class:`~pdjax.disagg.decode.DecodePool` and the continuous-batching loop;
  it is the router: a client's ``generate`` is validated, its blocks pre-allocated
  (``reserve``, back-pressure when full), then sent to prefill; arriving layers are pulled
  onto the owning rank's device and written into the paged cache; on ``ready`` the request
  joins the batch. Tokens stream back to the client (``token``), then ``done``.

:class:`TwoProcessServer` (``launch_two_process``) is the client and launcher: it starts both
roles as subprocesses (random free loopback ports, reported on a ready line), sends requests
and collects tokens. If the decode process dies, it is restarted and the unfinished requests
are re-issued (tokens already streamed are not streamed again). Children are killed with
SIGKILL (jax catches SIGTERM) and exit by themselves when the launcher's stdin pipe closes.

Control messages (JSON, :class:`~pdjax.disagg.transfer.Control`):
client->decode ``hello{prefill}``, ``generate{request, prompt, max_new_tokens, sampling,
stop_tokens}``, ``stats``, ``shutdown``; decode->prefill ``prefill{request, prompt,
sampling}``; prefill->decode ``hello{transfer_address}``, ``layer{request, layer, uuid, shape,
dtype, nbytes}``, ``ready{request, first_token}``, ``failed{request, error}``; decode->client
``token{request, token}``, ``done{request, tokens | error, kv_bytes, prefill_attempts}``,
``stats{...}``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import jax

from pdjax.configs import preset as config_preset
from pdjax.disagg.decode import DecodePool
from pdjax.disagg.prefill import PrefillPool
from pdjax.disagg.request import Request, RequestError, SamplingParams, validate_request
from pdjax.disagg.transfer import Control, KVReceiver, KVSender, listen, start_transfer_server
from pdjax.model.transformer import init_params

READY = "PDJAX_SERVE_READY"


def _mesh_devices(mesh_axes: dict):
    n = math.prod(mesh_axes.values())
    devices = jax.local_devices()
    if n > len(devices):
        raise ValueError(f"mesh {mesh_axes} needs {n} devices, this process has {len(devices)}")
    return devices[:n]


def _announce(role: str, listener, transfer_address: str) -> None:
    host, port = listener.getsockname()[:2]
    print(f"{READY} " + json.dumps({"role": role, "control": f"{host}:{port}", "transfer": transfer_address,
                                    "pid": os.getpid()}), flush=True)


def _exit_when_orphaned() -> None:
    """Exit at once when the launcher's stdin pipe closes (the launcher is gone)."""
    def watch():
        try:
            while sys.stdin.buffer.read(1 << 16):
                pass
        finally:
            os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


# ---- prefill role --------------------------------------------------------------------------
class PrefillServer:
    def __init__(self, params, cfg, mesh_axes: dict):
        devices = _mesh_devices(mesh_axes)
        self.pool = PrefillPool(params, cfg, devices, mesh_axes)
        self.sender = KVSender(start_transfer_server(jax.local_devices()))
        self.listener = listen()
        self.jobs: queue.Queue = queue.Queue()

    def serve_forever(self) -> None:
        _announce("prefill", self.listener, self.sender.address)
        threading.Thread(target=self._accept, daemon=True).start()
        while True:
            ctl, msg = self.jobs.get()
            if msg is None:
                return
            if not ctl.closed:
                self._prefill(ctl, msg)

    def _accept(self) -> None:
        while True:
            sock, _ = self.listener.accept()
            ctl = Control(sock)
            try:
                ctl.send({"op": "hello", "transfer_address": self.sender.address})
            except OSError:
                continue
            threading.Thread(target=self._read, args=(ctl,), daemon=True).start()

    def _read(self, ctl: Control) -> None:
        try:
            while (msg := ctl.recv()) is not None:
                self.jobs.put((ctl, None if msg["op"] == "shutdown" else msg))
        except (OSError, ValueError):
            pass
        ctl.closed = True               # its queued jobs are dropped; its offers expire

    def _prefill(self, ctl: Control, msg: dict) -> None:
        i = msg["request"]
        req = Request(i, list(msg["prompt"]), 1, SamplingParams(**msg["sampling"]))

        def push(layer, rows, start):
            ctl.send({"op": "layer", "request": i, "layer": layer, "start": start, **self.sender.offer(rows)})
        try:
            tok, _ = self.pool.run(req, push)
            ctl.send({"op": "ready", "request": i, "first_token": tok})
        except OSError:                 # the decode process went away
            ctl.closed = True
        except Exception as e:  # noqa: BLE001 - reported to decode, which retries the request
            try:
                ctl.send({"op": "failed", "request": i, "error": f"{type(e).__name__}: {e}"})
            except OSError:
                ctl.closed = True


# ---- decode role ---------------------------------------------------------------------------
class DecodeServer:
    def __init__(self, params, cfg, mesh_axes: dict, *, slots: int, block_size: int, max_context: int,
                 num_blocks: int | None = None, max_prefill_attempts: int = 3):
        self.cfg, self.max_context = cfg, max_context
        self.pool = DecodePool(params, cfg, _mesh_devices(mesh_axes), mesh_axes, slots=slots,
                               block_size=block_size, max_context=max_context, num_blocks=num_blocks)
        self.server = start_transfer_server(jax.local_devices())
        self.listener = listen()
        self.inbox: queue.Queue = queue.Queue()
        self.max_prefill_attempts = max_prefill_attempts
        self.receiver: KVReceiver | None = None
        self.handoffs: dict = {}                       # request -> Reservation (KV arriving)

    def serve_forever(self) -> None:
        _announce("decode", self.listener, self.server.address())
        sock, _ = self.listener.accept()
        client = Control(sock)
        hello = client.recv()
        if not hello or hello.get("op") != "hello":
            raise ConnectionError(f"expected hello from the client, got {hello!r}")
        prefill = Control.connect(hello["prefill"])
        self.receiver = KVReceiver(prefill.recv()["transfer_address"], self.server)
        threading.Thread(target=self._read_client, args=(client,), daemon=True).start()
        threading.Thread(target=self._read_prefill, args=(prefill,), daemon=True).start()
        self._loop(client, prefill)

    def _read_client(self, client: Control) -> None:
        try:
            while (msg := client.recv()) is not None:
                self.inbox.put(("client", msg))
        except (OSError, ValueError):
            pass
        self.inbox.put(("client", {"op": "shutdown"}))

    def _read_prefill(self, prefill: Control) -> None:
        """Prefill messages in order; a layer is pulled here (onto the owning rank's device)
        before it is queued, so it reaches the loop before its request's ``ready``."""
        try:
            while (msg := prefill.recv()) is not None:
                if msg["op"] == "layer":
                    res = self.handoffs.get(msg["request"])
                    device = self.pool.target_device(res) if res else jax.local_devices()[0]
                    msg["rows"] = self.receiver.pull(msg, device)
                self.inbox.put(("prefill", msg))
            raise ConnectionError("the prefill process closed the control connection")
        except BaseException as e:  # noqa: BLE001 - the loop re-raises it
            self.inbox.put(("crashed", e))

    def _loop(self, client: Control, prefill: Control) -> None:
        pool = self.pool
        waiting: collections.deque = collections.deque()   # validated, not yet reserved

        def finish(req):
            out = {"op": "done", "request": req.index, "kv_bytes": req.kv_bytes_sent,
                   "prefill_attempts": req.prefill_attempts}
            out.update({"error": str(req.error)} if req.error else {"tokens": req.output})
            client.send(out)

        def emit(req, tok) -> bool:
            req.output.append(int(tok))
            client.send({"op": "token", "request": req.index, "token": int(tok)})
            if len(req.output) >= req.max_new_tokens or tok in req.stop_tokens:
                finish(req)
                return True
            return False

        while True:
            idle = not pool.active
            try:
                msgs = [self.inbox.get(timeout=1.0) if idle else self.inbox.get_nowait()]
            except queue.Empty:
                msgs = []
            while True:
                try:
                    msgs.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for source, msg in msgs:
                if source == "crashed":
                    raise RuntimeError("the prefill link failed") from msg
                op = msg["op"]
                if op == "shutdown":
                    return
                if op == "stats":
                    r = self.receiver
                    client.send({"op": "stats", "kv_bytes_received": r.bytes_received, "pulls": r.pulls,
                                 "pull_seconds": r.pull_seconds, "link_throughput_Bps": r.throughput_Bps})
                elif op == "generate":
                    req = Request(msg["request"], list(msg["prompt"]), msg["max_new_tokens"],
                                  stop_tokens=tuple(msg.get("stop_tokens", ())))
                    try:
                        req.sampling = SamplingParams(**msg.get("sampling", {}))
                        validate_request(req, self.cfg.vocab_size, self.max_context)
                        waiting.append(req)
                    except RequestError as e:
                        req.error = e
                        finish(req)
                elif op == "layer":
                    res = self.handoffs.get(msg["request"])
                    if res is None:                    # a stale attempt's layer
                        continue
                    pool.receive_layer(res, msg["layer"], msg["rows"], msg.get("start", 0))
                    res.request.kv_bytes_sent += msg["nbytes"]
                elif op == "ready":
                    res = self.handoffs.pop(msg["request"], None)
                    if res is None:
                        continue
                    if emit(res.request, msg["first_token"]):
                        pool.cancel(res)
                    else:
                        pool.admit(res, msg["first_token"])
                elif op == "failed":
                    res = self.handoffs.pop(msg["request"], None)
                    if res is None:
                        continue
                    pool.cancel(res)
                    req = res.request
                    if req.prefill_attempts >= self.max_prefill_attempts:
                        req.error = RequestError(f"request {req.index}: prefill failed "
                                                 f"{req.prefill_attempts} times: {msg['error']}")
                        finish(req)
                    else:
                        req.kv_bytes_sent = 0
                        waiting.appendleft(req)
            while waiting:                             # pre-allocate, then ask for the prefill
                res = pool.reserve(waiting[0])
                if res is None:                        # full: back-pressure until a release
                    break
                req = waiting.popleft()
                req.prefill_attempts += 1
                self.handoffs[req.index] = res
                prefill.send({"op": "prefill", "request": req.index, "prompt": req.prompt,
                              "sampling": {"temperature": req.sampling.temperature,
                                           "top_p": req.sampling.top_p, "seed": req.sampling.seed}})
            if pool.active:
                for slot, tok in pool.step().items():
                    if emit(pool.slot_req[slot].request, tok):
                        pool.release(slot)


# ---- entry point of one role ---------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdjax serve", description="One role of the two-process PD server.")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--preset", default="tiny", help="config preset (pdjax.configs)")
    p.add_argument("--seed", type=int, default=0, help="params = init_params(cfg, key(seed))")
    p.add_argument("--mesh", default=None, help='mesh axes as JSON, e.g. \'{"data": 2, "expert": 2}\' '
                                                "(default: expert over all local devices)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--slots", type=int, default=4, help="decode slots (max running requests)")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _exit_when_orphaned()
    cfg = config_preset(args.preset)
    params = init_params(cfg, jax.random.key(args.seed))
    mesh = json.loads(args.mesh) if args.mesh else {"expert": len(jax.local_devices())}
    if args.role == "prefill":
        PrefillServer(params, cfg, mesh).serve_forever()
    else:
        DecodeServer(params, cfg, mesh, slots=args.slots, block_size=args.block_size,
                     max_context=args.max_context or cfg.max_position_embeddings,
                     num_blocks=args.num_blocks).serve_forever()
    return 0



# ---- client and launcher -------------------------------------------------------------------
class TwoProcessServer:
    """Starts a prefill and a decode process (``pdjax serve``), each with ``*_devices`` CPU
    devices, and serves requests through them. ``generate`` has the PDEngine interface
    (token lists in request order, a :class:`RequestError` in place of a bad request).

    ``env``: extra environment for both children (e.g. ``JAX_DEFAULT_MATMUL_PRECISION``).
    ``stats`` after ``generate``: per request (ttft seconds as seen by the client, kv_bytes
    received by decode, prefill_attempts, reissued), totals ``kv_bytes_received``,
    ``decode_restarts`` and the decode process's link counters (bytes, pulls, seconds spent
    in pulls, link_throughput_Bps: bytes / pull seconds)."""

    def __init__(self, preset: str = "tiny", seed: int = 0, *, prefill_mesh: dict | None = None,
                 decode_mesh: dict | None = None, prefill_devices: int = 4, decode_devices: int = 4,
                 block_size: int = 16, max_decode_slots: int = 4, max_context: int | None = None,
                 num_blocks: int | None = None, env: dict | None = None, startup_timeout: float = 120.0):
        self.startup_timeout = startup_timeout
        self._log_dir = tempfile.mkdtemp(prefix="pdjax-serve-")
        common = ["--preset", preset, "--seed", str(seed)]
        self._argv = {
            "prefill": common + ["--mesh", json.dumps(prefill_mesh or {"expert": prefill_devices})],
            "decode": common + ["--mesh", json.dumps(decode_mesh or {"expert": decode_devices}),
                                "--block-size", str(block_size), "--slots", str(max_decode_slots)]
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
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={self._devices[role]}"])
        env["JAX_PLATFORMS"] = "cpu"
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.update(self._env)
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

    def log_tail(self, role: str, chars: int = 4000) -> str:
        try:
            with open(os.path.join(self._log_dir, f"{role}.log"), errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def _restart_decode(self) -> None:
        if self._decode_ctl is not None:
            self._decode_ctl.close()
        self._kill("decode")
        self.decode_restarts += 1
        self._spawn("decode")
        self._connect_decode()

    # ---- requests ------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens=16, *, sampling: SamplingParams | list | None = None,
                 stop_tokens=(), on_token=None, timeout: float = 300.0, max_restarts: int = 3):
        """Serve ``prompts`` through the two processes; ``on_token(request_index, token)``
        streams (each token once, also across a decode restart). A decode process that dies
        is restarted (at most ``max_restarts`` times) and the unfinished requests re-issued;
        a dead prefill process, or no result within ``timeout`` seconds, raises."""
        n = len(prompts)
        samplings = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * n
        mnt = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
        t0 = time.perf_counter()
        reqs = {}
        for i, p in enumerate(prompts):
            s = samplings[i]
            rid, self._next_id = self._next_id, self._next_id + 1
            reqs[rid] = {"index": i, "streamed": 0, "tokens": [], "ttft": None, "reissued": 0, "msg": {
                "op": "generate", "request": rid, "prompt": [int(t) for t in p], "max_new_tokens": mnt[i],
                "sampling": {"temperature": s.temperature, "top_p": s.top_p, "seed": s.seed},
                "stop_tokens": [int(t) for t in stop_tokens]}}
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
                r.update(kv_bytes=msg["kv_bytes"], prefill_attempts=msg["prefill_attempts"])
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
        per = sorted(({"index": r["index"], "ttft": r["ttft"], "kv_bytes_received": r.get("kv_bytes", 0),
                       "prefill_attempts": r.get("prefill_attempts", 0), "reissued": r["reissued"]}
                      for r in reqs.values()), key=lambda d: d["index"])
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
