"""Helpers of jax child processes (the two-process PD server's roles, the pipeline's rank
processes): the environment a child starts with, the ready line it prints, the watchdog
that ends it with its parent, and reading its log."""

from __future__ import annotations

import json
import os
import sys
import threading

READY = "PDJAX_SERVE_READY"


def announce_ready(role: str, listener, transfer_address: str) -> None:
    """Child side: the ready line the launcher waits for (the ports the OS picked)."""
    host, port = listener.getsockname()[:2]
    print(f"{READY} " + json.dumps({"role": role, "control": f"{host}:{port}", "transfer": transfer_address,
                                    "pid": os.getpid()}), flush=True)


def child_env(device_count: int, extra: dict | None = None, platform: str = "cpu") -> dict:
    """The environment of a child jax process: this one's, on ``platform`` (on "cpu" with
    ``device_count`` host devices; other platforms: set the visible devices in ``extra``,
    e.g. ``CUDA_VISIBLE_DEVICES``), the pdjax this process runs importable (a checkout
    that is not installed), then ``extra``."""
    env = dict(os.environ)
    if platform == "cpu":
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={device_count}"])
    env["JAX_PLATFORMS"] = platform
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
