"""PD and AF serving across processes: the entry point of one role (``pdjax serve --role
prefill|decode|ffn``; ffn: the routed experts of AF disaggregation, :mod:`pdjax.disagg.afd_remote`).

Each role is a process on its own devices with the same params ``(preset, seed)``; the latent
KV moves layer by layer with ``jax.experimental.transfer``. The roles:
:class:`~pdjax.disagg.prefill_server.PrefillServer` and
:class:`~pdjax.disagg.decode_server.DecodeServer`; the client and launcher that start them
(one prefill and one or more decode processes), ``PDCluster`` / ``launch_pd`` /
``launch_two_process``: :mod:`pdjax.disagg.launcher`.
"""

from __future__ import annotations

import argparse
import json

import jax

from pdjax.configs import preset as config_preset
from pdjax.cluster.supervisor import exit_when_orphaned
from pdjax.cluster.transfer import LOOPBACK
from pdjax.model.transformer import init_params

__all__ = ["build_parser", "main"]


# ---- entry point of one role ---------------------------------------------------------------
def _prefix_options(spec: str) -> dict | None:
    """``--prefix-cache``: host blocks (an int; 0 = off) or a JSON object of PrefixStore options."""
    opts = json.loads(spec)
    if type(opts) is int:
        return {"host_blocks": opts} if opts > 0 else None
    if not isinstance(opts, dict):
        raise argparse.ArgumentTypeError(f"a block count or a JSON object, got {spec!r}")
    return opts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdjax serve", description="One role of the two-process PD server.")
    p.add_argument("--role", choices=("prefill", "decode", "ffn"), required=True)
    p.add_argument("--preset", default="tiny", help="config preset (pdjax.configs)")
    p.add_argument("--seed", type=int, default=0, help="params = init_params(cfg, key(seed))")
    p.add_argument("--mesh", default=None, help='mesh axes as JSON, e.g. \'{"data": 2, "expert": 2}\' '
                                                "(default: expert over all local devices)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (paged cache, prefix store)")
    p.add_argument("--slots", type=int, default=4, help="decode slots (max running requests)")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--prefix-cache", type=_prefix_options, default=None, metavar="SPEC",
                   help="prefill: keep a prefix KV store; SPEC = host blocks (e.g. 256) or a JSON object of "
                        "PrefixStore options, e.g. '{\"device_blocks\": 4, \"host_blocks\": 64}'")
    p.add_argument("--handoff-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="decode: abandon a prefill attempt without progress for this long and re-prefill")
    p.add_argument("--max-prefill-attempts", type=int, default=3,
                   help="decode: prefill attempts (failed or timed out) before a request fails")
    p.add_argument("--pull-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="decode: the deadline of each KV pull (then the attempt fails and is prefilled again); "
                        "ffn: of each pull of a micro-batch's hidden states")
    p.add_argument("--host", default=LOOPBACK,
                   help="the address the control listener and the transfer server bind to (default loopback)")
    return p


def main(argv=None, *, link_wrapper=None) -> int:
    """Run one role. ``link_wrapper``: a callable ``factory(link, server) -> link`` for the
    prefill role (Python API only: no server flag loads code)."""
    args = build_parser().parse_args(argv)
    exit_when_orphaned()
    cfg = config_preset(args.preset)
    params = init_params(cfg, jax.random.key(args.seed))
    mesh = json.loads(args.mesh) if args.mesh else {"expert": len(jax.local_devices())}
    if args.role == "prefill":
        from pdjax.disagg.prefill_server import PrefillServer
        PrefillServer(params, cfg, mesh, block_size=args.block_size, prefix_cache=args.prefix_cache,
                      link_wrapper=link_wrapper, host=args.host).serve_forever()
    elif args.role == "ffn":
        from pdjax.disagg.afd_remote import FFNServer
        from pdjax.disagg.prefill_server import mesh_devices
        FFNServer(params, cfg, mesh_devices(mesh), host=args.host, pull_timeout_s=args.pull_timeout).serve_forever()
    else:
        from pdjax.disagg.decode_server import DecodeServer
        DecodeServer(params, cfg, mesh, slots=args.slots, block_size=args.block_size,
                     max_context=args.max_context or cfg.max_position_embeddings, num_blocks=args.num_blocks,
                     max_prefill_attempts=args.max_prefill_attempts,
                     handoff_timeout_s=args.handoff_timeout, pull_timeout_s=args.pull_timeout,
                     host=args.host).serve_forever()
    return 0
