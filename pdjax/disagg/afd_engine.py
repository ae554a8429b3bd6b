"""Attention-FFN disaggregated decode: ``AFDEngine``.

M attention devices, data-parallel, own the paged latent KV cache, the decode scheduler,
the dense layers, the attention, the router, the shared experts and the sampling
(:class:`~pdjax.disagg.afd_attention.AFDPool`); N FFN devices hold the routed experts,
expert-parallel, stateless (:class:`~pdjax.disagg.afd_ffn.FFNPool`). Every decode step runs
m micro-batches in ping-pong: per MoE layer, each micro-batch's normed hidden states with its
top-k expert ids and weights go to the FFN devices (A2F), its experts run there, and the
result comes back (F2A), while the next micro-batch's attention runs.

Prefill is colocated on the attention devices (a :class:`~pdjax.disagg.prefill.PrefillPool`
on their mesh, expert-parallel over them when the experts divide, else replicated): AFD is a
decode-side technique, and the engine is :class:`~pdjax.disagg.engine.Engine`'s machinery
with its decode pool replaced, as :class:`~pdjax.disagg.engine.ColocatedEngine` shares the
decode devices with the prefill (prefill chunks and decode steps take turns; the prefilled
latents are written straight into the attention ranks' paged cache).

``eng.stats["afd"]`` after ``generate``: bytes per MoE layer each way (``a2f_bytes``: the
hidden states; ``routing_bytes``: expert ids, weights and the valid mask, counted apart;
``f2a_bytes``: the experts' output; ``check_bytes``: the exchange's checksums), FFN
failures, ``exchange_corrupt`` (micro-batch steps whose exchange delivered a piece that
failed its checksum: each was run again; see :mod:`pdjax.disagg.afd_attention`), and, when
``eng.timeline`` is a
:class:`~pdjax.disagg.device_spans.DeviceSpans`, the per-stage times (:func:`stage_times`) and the
measured spans (streams "attention", "a2f", "ffn", "f2a").
"""

from __future__ import annotations

import math


from pdjax.arguments import check_int
from pdjax.model_config import ModelConfig
from pdjax.disagg.afd_attention import AFDPool
from pdjax.disagg.engine import Engine

MAX_MICROBATCHES = 4


def check_afd_options(cfg: ModelConfig, attention_devices, ffn_devices, microbatches, slots) -> int:
    """Raise ValueError naming the first bad AFD option (before anything is built); returns
    the decode slots (default: the fewest that split, m * lcm(M, N)). ``ffn_devices``: a
    device list, or the FFN ranks (an int) of an FFN process."""
    remote = isinstance(ffn_devices, int)
    M, N = len(attention_devices), ffn_devices if remote else len(ffn_devices)
    if not M or not N:
        raise ValueError(f"attention_devices and ffn_devices must be non-empty, got {M} and {N} devices")
    shared = [] if remote else sorted({d.id for d in attention_devices} & {d.id for d in ffn_devices})
    if shared:
        raise ValueError(f"attention_devices and ffn_devices must be disjoint; both hold device ids {shared}")
    if not any(cfg.is_moe_layer(l) for l in range(cfg.num_hidden_layers)):
        raise ValueError("AF disaggregation needs MoE layers; the model has none")
    if cfg.n_routed_experts % N:
        raise ValueError(f"{cfg.n_routed_experts} routed experts do not divide over the {N} FFN devices")
    m = check_int("num_microbatches", microbatches, 1, MAX_MICROBATCHES)
    if slots is None:
        return m * math.lcm(M, N)
    slots = check_int("max_decode_slots", slots)
    if slots % M or (slots // M) < m:
        raise ValueError(f"num_microbatches={m} needs at least {m} decode slots on each of the {M} attention "
                         f"ranks (max_decode_slots a multiple of {m * M}), got max_decode_slots={slots}")
    if (slots // M) % m or (slots // m) % N:
        raise ValueError(f"max_decode_slots={slots} must split into {m} equal micro-batches on each of the {M} "
                         f"attention ranks whose rows divide over the {N} FFN ranks: use a multiple of "
                         f"{m * math.lcm(M, N)}")
    return slots


class AFDEngine(Engine):
    """Attention-FFN disaggregated serving; see the module docstring. ``attention_devices``
    (M) and ``ffn_devices`` (N): disjoint device lists, the routed experts dividing over N;
    or, instead of ``ffn_devices``, ``ffn_address``: the control address of an FFN process
    (``pdjax serve --role ffn``, :func:`~pdjax.disagg.launch_ffn`), N its ranks,
    ``ffn_timeout_s`` the deadline of each of its answers and pulls
    (:mod:`pdjax.disagg.afd_process`);
    ``num_microbatches``: m in 1..4; ``max_decode_slots``: a multiple of m * lcm(M, N)
    (default that product); ``prefill_mesh``: the attention devices' mesh (default
    {"expert": M} when the experts divide over M, else {"data": M}); ``ffn_retries``: reruns
    of a micro-batch whose FFN call failed before its requests fail. Other options as
    :class:`~pdjax.disagg.engine.Engine`. ``generate`` returns one token list per prompt (a
    :class:`~pdjax.disagg.request.RequestError` in place of a failed request)."""

    def __init__(self, params, cfg: ModelConfig, *, attention_devices, ffn_devices=None, ffn_address: str | None = None,
                 num_microbatches: int = 2, max_decode_slots: int | None = None, prefill_mesh: dict | None = None,
                 ffn_retries: int = 1, ffn_timeout_s: float = 60.0, **kwargs):
        if kwargs.get("speculative") is not None:
            raise ValueError("AFDEngine decodes one token a step; MTP speculative decoding is served by PDEngine "
                             "and ColocatedEngine")
        if (ffn_devices is None) == (ffn_address is None):
            raise ValueError("give exactly one of ffn_devices (the FFN side in this process) and ffn_address "
                             "(an FFN process's control address, `pdjax serve --role ffn`)")
        attention_devices = list(attention_devices)
        remote = None
        if ffn_address is not None:
            from pdjax.disagg.afd_process import RemoteFFN
            remote = RemoteFFN(ffn_address, timeout_s=ffn_timeout_s)      # its hello: how many FFN ranks
        try:
            ffn = list(ffn_devices) if remote is None else remote.ranks
            slots = check_afd_options(cfg, attention_devices, ffn, num_microbatches, max_decode_slots)
            check_int("ffn_retries", ffn_retries, 0)
            M = len(attention_devices)
            mesh = prefill_mesh or ({"expert": M} if cfg.n_routed_experts % M == 0 else {"data": M})
            self._afd = {"microbatches": num_microbatches, "ffn_retries": ffn_retries,
                         **({"remote_ffn": remote} if remote is not None else {"ffn_devices": ffn})}
            super().__init__(params, cfg, prefill_devices=attention_devices, decode_devices=attention_devices,
                             prefill_mesh=mesh, decode_mesh=mesh, colocated=True, max_decode_slots=slots, **kwargs)
        except BaseException:
            if remote is not None:
                remote.close()
            raise

    def _decode_pool(self, params, cfg: ModelConfig, devices, mesh_axes: dict, **options) -> AFDPool:
        return AFDPool(params, cfg, devices, mesh_axes, **self._afd, **options)

    def generate(self, prompts, max_new_tokens=16, **kwargs):
        """As :meth:`Engine.generate`; ``stats["afd"]`` then holds the exchange's bytes and,
        with ``self.timeline`` set, the measured stages."""
        self.decode.begin(self.timeline)
        out = super().generate(prompts, max_new_tokens, **kwargs)
        afd = {**self.decode.stats, "steps": self.decode.steps, "microbatches": self.decode.m}
        if self.timeline is not None:
            spans = [s for s in self.timeline.wait().spans if "chain" in s]
            afd.update(stage_s=stage_times(spans), timeline=spans)
        self.stats["afd"] = afd
        return out


def op_times(spans, resource: dict | None = None) -> list[tuple[dict, float]]:
    """[(span, seconds)] in issue order: each op's time once it could start, its ready time
    minus the latest of its issue, the ready time of the previous op of its micro-batch's
    chain (``span["chain"]``) and that of the previous op on its resource. ``resource`` maps
    a stream to the device resource it runs on (default: each stream its own); on XLA:CPU,
    which runs multi-device programs one at a time, ``{"attention": "mesh", "ffn": "mesh"}``
    keeps an FFN program's wait behind the last attention program out of its time."""
    resource = resource or {}
    last_chain: dict = {}
    last_res: dict = {}
    out = []
    for s in sorted(spans, key=lambda s: s["issued"]):
        res = resource.get(s["stream"], s["stream"])
        start = max(s["issued"], last_chain.get(s["chain"], 0.0), last_res.get(res, 0.0))
        out.append((s, max(s["ready"] - start, 0.0)))
        last_chain[s["chain"]] = last_res[res] = s["ready"]
    return out


def stage_times(spans) -> dict:
    """Per stream, the seconds each op took once it could start (:func:`op_times`, each
    stream its own resource). Returns {stream: {"mean", "total", "count"}}. On a CPU host
    the simulated devices share its cores, so this is an upper bound on each stage's own
    time."""
    out: dict = {}
    for s, took in op_times(spans):
        o = out.setdefault(s["stream"], {"total": 0.0, "count": 0})
        o["total"] += took
        o["count"] += 1
    for o in out.values():
        o["mean"] = o["total"] / o["count"]
    return out
