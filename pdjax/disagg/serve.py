"""PD and AF serving across processes: the entry point of one role (``pdjax serve --role
prefill|decode|ffn``; ffn: the routed experts of AF disaggregation, :mod:`pdjax.disagg.afd_process`).

Each role is a process on its own devices with the same params ``(preset, seed)``; the latent
KV moves layer by layer with ``jax.experimental.transfer``. The roles:
:class:`~pdjax.disagg.prefill_server.PrefillServer` and
:class:`~pdjax.disagg.decode_server.DecodeServer`; the client and launcher that start them
(one prefill and one or more decode processes), ``PDCluster`` / ``launch_pd``:
:mod:`pdjax.disagg.launcher`.

Every option is checked (type, range, finiteness, the mesh's axis names, an option of another
role) before the params are built: a bad one is a one-line error naming the option and its
value, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import socket

import jax

from pdjax.arguments import check_int, check_positive
from pdjax.configs import preset as config_preset
from pdjax.cluster.supervisor import exit_when_orphaned
from pdjax.cluster.transfer import LOOPBACK
from pdjax.model.transformer import init_params

__all__ = ["build_parser", "check_options", "main", "resolve_mesh"]

# the options of one role only (None when not given: another role's option is an error)
ROLE_OPTIONS = {
    "prefill": ("block_size", "prefix_cache"),
    "decode": ("block_size", "slots", "max_context", "num_blocks", "handoff_timeout", "max_prefill_attempts",
               "pull_timeout"),
    "ffn": ("pull_timeout",),
}
DEFAULTS = {"block_size": 16, "handoff_timeout": 30.0, "max_prefill_attempts": 3, "pull_timeout": 60.0}
MESH_AXES = {"prefill": ("data", "expert"), "decode": ("data", "expert"), "ffn": ("expert",)}
DEFAULT_SLOTS = 4             # rounded up to a multiple of the decode ranks
PREFIX_BLOCKS = ("device_blocks", "host_blocks", "disk_blocks")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdjax serve", description="One role of PD or AF serving across processes.")
    p.add_argument("--role", choices=("prefill", "decode", "ffn"), required=True)
    p.add_argument("--preset", default="tiny", help="config preset (pdjax.configs)")
    p.add_argument("--seed", type=int, default=0, help="params = init_params(cfg, key(seed)); 0..2**32-1")
    p.add_argument("--mesh", default=None, help='mesh axes as JSON, e.g. \'{"data": 2, "expert": 2}\' '
                                                "(axes: data, expert; ffn: expert; default: expert over all "
                                                "local devices)")
    p.add_argument("--block-size", type=int, default=None,
                   help="prefill, decode: tokens per KV block (paged cache, prefix store; default 16)")
    p.add_argument("--slots", type=int, default=None,
                   help="decode: decode slots (max running requests), a multiple of the mesh's devices "
                        "(default: 4 rounded up to one)")
    p.add_argument("--max-context", type=int, default=None,
                   help="decode: the longest request in tokens (default: the preset's max_position_embeddings)")
    p.add_argument("--num-blocks", type=int, default=None, help="decode: KV blocks per decode rank (>= 2)")
    p.add_argument("--prefix-cache", default=None, metavar="SPEC",
                   help="prefill: keep a prefix KV store; SPEC = host blocks (e.g. 256; 0 = off) or a JSON object "
                        "of PrefixStore options, e.g. '{\"device_blocks\": 4, \"host_blocks\": 64}'")
    p.add_argument("--handoff-timeout", type=float, default=None, metavar="SECONDS",
                   help="decode: abandon a prefill attempt without progress for this long and re-prefill (default 30)")
    p.add_argument("--max-prefill-attempts", type=int, default=None,
                   help="decode: prefill attempts (failed or timed out) before a request fails (default 3)")
    p.add_argument("--pull-timeout", type=float, default=None, metavar="SECONDS",
                   help="decode: the deadline of each KV pull (then the attempt fails and is prefilled again); "
                        "ffn: of each pull of a micro-batch's hidden states (default 60)")
    p.add_argument("--host", default=LOOPBACK,
                   help="the address the control listener and the transfer server bind to (default loopback)")
    return p


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_options(args: argparse.Namespace):
    """Check every option of parsed ``args`` and fill in the defaults of its role's options
    (``mesh`` and ``prefix_cache`` parsed); returns the preset's config. ValueError naming the
    option and its value. Pure: nothing is started, no device is touched."""
    for dest in sorted({d for opts in ROLE_OPTIONS.values() for d in opts} - set(ROLE_OPTIONS[args.role])):
        if getattr(args, dest) is not None:
            roles = " and ".join(r for r, opts in ROLE_OPTIONS.items() if dest in opts)
            raise ValueError(f"{_flag(dest)} is an option of the {roles} role, not of {args.role} "
                             f"(got {_flag(dest)} {getattr(args, dest)!r})")
    for dest, value in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    try:
        cfg = config_preset(args.preset)
    except ValueError as e:
        raise ValueError(f"--preset: {e}") from None
    check_int("--seed", args.seed, 0, 2**32 - 1)
    check_int("--block-size", args.block_size)
    check_int("--max-prefill-attempts", args.max_prefill_attempts)
    check_positive("--handoff-timeout", args.handoff_timeout)
    check_positive("--pull-timeout", args.pull_timeout)
    if args.slots is not None:
        check_int("--slots", args.slots)
    if args.max_context is None:
        args.max_context = cfg.max_position_embeddings
    check_int(f"--max-context (at most the {args.preset} preset's max_position_embeddings)", args.max_context,
              1, cfg.max_position_embeddings)
    if args.num_blocks is not None:
        check_int("--num-blocks (block 0 of each rank is reserved)", args.num_blocks, 2)
    args.mesh = _mesh(args.mesh, args.role, cfg) if args.mesh is not None else None
    args.prefix_cache = _prefix_options(args.prefix_cache)
    _check_host(args.host)
    return cfg


def _mesh(spec: str, role: str, cfg) -> dict:
    """``--mesh``: a non-empty JSON object of the role's axes, each a positive integer size."""
    try:
        mesh = json.loads(spec)
    except json.JSONDecodeError:
        mesh = None
    if not isinstance(mesh, dict) or not mesh:
        raise ValueError(f"--mesh must be a JSON object of axis sizes, e.g. '{{\"expert\": 4}}', got {spec!r}")
    for name, size in mesh.items():
        if name not in MESH_AXES[role]:
            raise ValueError(f"--mesh: {name!r} is not a mesh axis of the {role} role "
                             f"(axes: {', '.join(MESH_AXES[role])}), got {spec!r}")
        check_int(f"--mesh axis {name!r}", size)
    return mesh


def _prefix_options(spec: str | None) -> dict | None:
    """``--prefix-cache``: host blocks (an int; 0 = off) or a JSON object of PrefixStore options."""
    if spec is None:
        return None
    try:
        opts = json.loads(spec)
    except json.JSONDecodeError:
        opts = None
    if type(opts) is int:
        return {"host_blocks": check_int("--prefix-cache", opts, 0)} if opts else None
    if not isinstance(opts, dict):
        raise ValueError(f"--prefix-cache must be a block count or a JSON object of PrefixStore options, got {spec!r}")
    known = (*PREFIX_BLOCKS, "disk_dir", "retention")
    for key, value in opts.items():
        if key not in known:
            raise ValueError(f"--prefix-cache: unknown option {key!r} (known: {', '.join(known)}), got {spec!r}")
        if key in PREFIX_BLOCKS:
            check_int(f"--prefix-cache {key}", value, 0)
    if "disk_dir" in opts and not (isinstance(opts["disk_dir"], str) and opts["disk_dir"]):
        raise ValueError(f"--prefix-cache: disk_dir must be a directory path, got {spec!r}")
    if opts.get("disk_blocks") and "disk_dir" not in opts:
        raise ValueError(f"--prefix-cache: disk_blocks needs disk_dir, got {spec!r}")
    if "retention" in opts:
        if not isinstance(opts["retention"], dict) or not opts["retention"]:
            raise ValueError(f"--prefix-cache: retention must be a non-empty object of class -> seconds, got {spec!r}")
        for name, ttl in opts["retention"].items():
            check_positive(f"--prefix-cache retention {name!r}", ttl)
    return opts


def _check_host(host: str) -> None:
    if not host:
        raise ValueError(f"--host must be an address of this machine, got {host!r}")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError as e:
        raise ValueError(f"--host {host!r}: cannot bind to it ({e})") from None


def resolve_mesh(args: argparse.Namespace, cfg, devices: int) -> dict:
    """The mesh over this process's ``devices`` (``--mesh``, default ``{"expert": devices}``)
    and, for decode, ``args.slots`` (default: 4 rounded up to a multiple of the mesh's ranks).
    ValueError naming the option."""
    mesh = args.mesh or {"expert": devices}
    given = f"--mesh {json.dumps(mesh)}" if args.mesh else f"the default mesh {json.dumps(mesh)}"
    need = math.prod(mesh.values())
    if need > devices:
        raise ValueError(f"{given} needs {need} devices, this process has {devices}")
    if cfg.n_routed_experts % mesh.get("expert", 1):
        raise ValueError(f"{given}: the expert axis must divide the {args.preset} preset's "
                         f"{cfg.n_routed_experts} routed experts")
    if args.role == "decode":
        if args.slots is None:
            args.slots = need * -(-DEFAULT_SLOTS // need)
        elif args.slots % need:
            raise ValueError(f"--slots must be a multiple of the {need} decode ranks of {given}, got {args.slots}")
    return mesh


def main(argv=None, *, link_wrapper=None) -> int:
    """Run one role. ``link_wrapper``: a callable ``factory(link, server) -> link`` for the
    prefill role (Python API only: no server flag loads code). A bad option: SystemExit(2)
    with its message (``argparse``), before the params are built."""
    exit_when_orphaned()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = check_options(args)
        mesh = resolve_mesh(args, cfg, len(jax.local_devices()))
    except ValueError as e:
        parser.error(str(e))
    params = init_params(cfg, jax.random.key(args.seed))
    if args.role == "prefill":
        from pdjax.disagg.prefill_server import PrefillServer
        PrefillServer(params, cfg, mesh, block_size=args.block_size, prefix_cache=args.prefix_cache,
                      link_wrapper=link_wrapper, host=args.host).serve_forever()
    elif args.role == "ffn":
        from pdjax.disagg.afd_process import FFNServer
        from pdjax.disagg.prefill_server import mesh_devices
        FFNServer(params, cfg, mesh_devices(mesh), host=args.host, pull_timeout_s=args.pull_timeout).serve_forever()
    else:
        from pdjax.disagg.decode_server import DecodeServer
        DecodeServer(params, cfg, mesh, slots=args.slots, block_size=args.block_size,
                     max_context=args.max_context, num_blocks=args.num_blocks,
                     max_prefill_attempts=args.max_prefill_attempts,
                     handoff_timeout_s=args.handoff_timeout, pull_timeout_s=args.pull_timeout,
                     host=args.host).serve_forever()
    return 0
