"""Per-stage training costs of a pipeline schedule, derived from a ModelConfig: what
:func:`pdjax.schedules.simulate` needs to predict a step's time, bubble and per-rank memory
before anything runs.

    s = pdjax.schedules.build("dualpipev", num_ranks=4, num_microbatches=16)
    costs = pipeline_costs(cfg, s, microbatch=(1, 4096), mtp_weight=0.3)
    t = costs.simulate(flop_rate=400e12 * 1e-3)     # FLOP per ms: times in ms
    t.makespan, t.bubble_ratio, costs.peak_bytes(t)

Stages hold the model as the executor (:class:`pdjax.pipeline.Executor`) places it: chunks of
consecutive decoder layers (:mod:`pdjax.schedules.layer_split`; ``layers_per_stage`` as
there), chunk 0 with the embedding, the last chunk with the final norm, the LM head and the
loss. Every amount is per micro-batch of ``microbatch = (rows, seq_len)`` tokens:

* FLOPs: 2 per multiply-add of every matmul (:mod:`pdjax.analysis.layer_gemms`, the naive
  MLA form), plus the causal attention core
  (:func:`pdjax.analysis.kernels.causal_attention_flops`); norms, softmax and activation
  functions are not counted, nor is the embedding (a row lookup). The backward is the
  forward's matmuls twice (input gradients, and weight gradients ``W`` = the forward's
  matmul FLOPs) and the attention core twice (all in the input-gradient part), so
  ``B = 2 M + 2 A``, ``W = M``, ``F = M + A``.
* Held activations (``activation_bytes``, the simulator's ``memory["F"]``: allocated by a
  forward, freed when its backward ends): the input of every norm and of every matmul, the
  attention's q, k, v and its probabilities (``H x seq_len`` per token), in the compute
  dtype; the logits in float32. An estimate (the executor holds what ``jax.vjp`` keeps;
  its byte model, ``Executor.stage_memory``, is measured), to compare configurations with.
* Params (``param_bytes``): the weights the stage holds, in the param dtype
  (:mod:`pdjax.param_counts`' per-layer counts); a rank holds its stages' params.

MTP. With ``mtp_weight`` > 0 the loss has DeepSeek-V3's MTP term (``pdjax.loss(...,
mtp_weight=)``, as ``Executor(mtp_weight=)`` runs it), and every stage that holds the last
chunk (one per pipeline: two in DualPipe, rank 0's second stage in DualPipeV) also runs the
MTP modules: :func:`mtp_term` is added to each such stage and nothing else changes. For
depth ``k = 1..num_nextn_predict_layers`` on ``rows x (seq_len - k)`` tokens: ``eh_proj``
([2D, D] on the concatenated normed embedding and hidden state), one decoder block (layer
index ``num_hidden_layers + k - 1``, dense or MoE as the config says) and a second use of the
LM head (with the depth's own norm); held: the embedded tokens and the concatenation, the
block's activations and the head's. Params: each depth's
(:func:`pdjax.param_counts.mtp_depth_params`) and a copy of the embedding (the executor
places one beside the MTP modules, unless the stage already embeds).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.analysis.kernels import causal_attention_flops
from pdjax.analysis.layer_gemms import head_gemms, layer_gemms, matmul_flops, mtp_gemms
from pdjax.arguments import check_int, check_positive
from pdjax.model_config_checks import check_mtp_weight
from pdjax.param_counts import layer_params
from pdjax.schedules.layer_split import Chunk, split_layers, stage_chunks
from pdjax.schedules.ops import OVERLAP
from pdjax.schedules.simulate import Timeline, simulate

#: Bytes per element of the config's param and compute dtypes.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_LOGIT_BYTES = 4          # the LM head's logits are float32


@dataclasses.dataclass(frozen=True)
class StageTerm:
    """One part of a stage's work for one micro-batch: forward FLOPs ``F``, backward ``B``
    (input and weight gradients), its weight-gradient part ``W`` (``I = B - W``);
    ``activation_bytes`` held from the forward until the backward ends; ``param_bytes`` of
    the weights it holds. Terms add up (``+``)."""

    F: float = 0.0
    B: float = 0.0
    W: float = 0.0
    activation_bytes: float = 0.0
    param_bytes: float = 0.0

    def __add__(self, other: "StageTerm") -> "StageTerm":
        return StageTerm(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def _work(matmul: float, attention: float, held_bytes: float, param_bytes: float) -> StageTerm:
    """A term from its forward matmul FLOPs ``M`` and attention-core FLOPs ``A``: F = M + A,
    B = 2 M + 2 A, W = M."""
    m, a = float(matmul), float(attention)
    return StageTerm(m + a, 2 * m + 2 * a, m, float(held_bytes), float(param_bytes))


def _attention_held(cfg, seq_len: int) -> int:
    """The elements MLA holds per token: the layer input and its normed copy, q's latent and
    its normed copy, the kv latent (with the rope key) and its normed copy, q, k, v, the
    probabilities and the attention output."""
    D, H, C, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    ql, dqk, dv = cfg.q_lora_rank or 0, cfg.qk_head_dim, cfg.v_head_dim
    return 2 * D + 2 * ql + (C + R) + C + 2 * H * dqk + H * dv + H * seq_len + H * dv


def _ffn_held(cfg, layer: int) -> int:
    """The elements the dense MLP or the MoE block holds per token (the routed experts a
    token uses)."""
    D = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return 2 * D + 3 * cfg.intermediate_size
    mi, k, shared = cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.n_shared_experts * cfg.moe_intermediate_size
    return 2 * D + cfg.n_routed_experts + k * (D + 3 * mi) + 3 * shared


def _bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def layer_term(cfg, layer: int, rows: int, seq_len: int) -> StageTerm:
    """Decoder layer ``layer`` (>= ``num_hidden_layers``: an MTP depth's block) on ``rows``
    sequences of ``seq_len`` tokens (see the module docstring)."""
    n = rows * seq_len
    matmul = matmul_flops(cfg, layer_gemms(cfg, layer, "naive"), n)
    held = _attention_held(cfg, seq_len) + _ffn_held(cfg, layer)
    return _work(matmul, rows * causal_attention_flops(cfg, [(seq_len, 0)]),
                 n * held * _bytes(cfg.compute_dtype), layer_params(cfg, layer) * _bytes(cfg.param_dtype))


def head_term(cfg, rows: int, seq_len: int, head_weights: bool = True) -> StageTerm:
    """A norm and the LM head on ``rows x seq_len`` tokens: held, the norm's input, the
    head's input and the float32 logits; params, the norm's and (``head_weights``) the head's."""
    n, D, V = rows * seq_len, cfg.hidden_size, cfg.vocab_size
    held = n * (2 * D * _bytes(cfg.compute_dtype) + V * _LOGIT_BYTES)
    params = D + (D * V if head_weights else 0)
    return _work(matmul_flops(cfg, head_gemms(cfg), n), 0.0, held, params * _bytes(cfg.param_dtype))


def embedding_term(cfg) -> StageTerm:
    """The token embedding: its params only (a row lookup does no FLOPs)."""
    return StageTerm(param_bytes=float(cfg.vocab_size * cfg.hidden_size * _bytes(cfg.param_dtype)))


def mtp_depth_term(cfg, depth: int, rows: int, seq_len: int) -> StageTerm:
    """MTP depth ``depth`` (1-based) on ``rows x (seq_len - depth)`` tokens: ``eh_proj``, its
    decoder block and the shared LM head (see the module docstring)."""
    D, t = cfg.hidden_size, seq_len - depth
    n, cd, pd = rows * t, _bytes(cfg.compute_dtype), _bytes(cfg.param_dtype)
    proj = _work(matmul_flops(cfg, mtp_gemms(cfg), n), 0.0, n * 3 * D * cd, (2 * D * D + 2 * D) * pd)   # + enorm, hnorm
    return proj + layer_term(cfg, cfg.num_hidden_layers + depth - 1, rows, t) + head_term(cfg, rows, t, False)


def mtp_term(cfg, rows: int, seq_len: int, embedding: bool = True) -> StageTerm:
    """What the MTP modules add to a stage that holds the LM head, for one micro-batch of
    ``rows x seq_len`` tokens: every depth's :func:`mtp_depth_term`, and (``embedding``) the
    params of the embedding copy placed beside them."""
    out = StageTerm()
    for depth in range(1, cfg.num_nextn_predict_layers + 1):
        out = out + mtp_depth_term(cfg, depth, rows, seq_len)
    return out + embedding_term(cfg) if embedding else out


def chunk_term(cfg, chunk: Chunk, rows: int, seq_len: int, mtp: bool = False) -> StageTerm:
    """A stage running ``chunk``: its layers, the embedding on the first chunk, the final
    norm and LM head on the last, and (``mtp``) the MTP term on the last."""
    out = StageTerm()
    for layer in range(chunk.start, chunk.stop):
        out = out + layer_term(cfg, layer, rows, seq_len)
    if chunk.first:
        out = out + embedding_term(cfg)
    if chunk.last:
        out = out + head_term(cfg, rows, seq_len)
        if mtp:
            out = out + mtp_term(cfg, rows, seq_len, embedding=not chunk.first)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineCosts:
    """The costs of ``schedule``'s stages for model ``cfg`` (:func:`pipeline_costs`).

    ``terms[s]``: stage ``s``'s :class:`StageTerm`; ``mtp``: what the MTP modules added to
    each of ``head_stages`` (zero when ``mtp_weight`` is 0; a stage that also embeds adds it
    without the embedding copy); ``chunks`` and ``stage_chunk``: the layer split and each
    stage's chunk. Per-stage arrays: ``F``, ``B``, ``W``, ``FB`` (FLOPs), ``activation_bytes``,
    ``param_bytes``."""

    cfg: object
    schedule: object
    microbatch: tuple
    mtp_weight: float
    chunks: tuple
    stage_chunk: tuple
    terms: tuple
    mtp: StageTerm

    def _column(self, name: str) -> np.ndarray:
        return np.array([getattr(t, name) for t in self.terms], dtype=float)

    F = property(lambda self: self._column("F"), doc="Forward FLOPs per stage and micro-batch.")
    B = property(lambda self: self._column("B"), doc="Backward FLOPs (input + weight gradients) per stage.")
    W = property(lambda self: self._column("W"), doc="Weight-gradient FLOPs per stage (``I = B - W``).")
    activation_bytes = property(lambda self: self._column("activation_bytes"),
                                doc="Bytes one micro-batch holds on each stage from its F until its backward ends.")
    param_bytes = property(lambda self: self._column("param_bytes"), doc="Bytes of each stage's weights.")

    @property
    def head_stages(self) -> tuple[int, ...]:
        """The stages that hold the LM head (the last chunk): where the MTP modules run."""
        return tuple(s for s, c in enumerate(self.stage_chunk) if self.chunks[c].last)

    @property
    def FB(self) -> np.ndarray:
        """FLOPs of an overlapped forward & backward pair, by its forward's stage (the
        simulator's convention): the forward's F plus the B of the stage whose backward it is
        paired with in the schedule (no overlap gain; DualPipe and DualPipeV pair a rank's two
        stages, so a head stage's MTP backward is costed where it runs). ``F + B`` for a stage
        in no pair; the largest partner's B if a schedule pairs one stage with several."""
        F, B = self.F, self.B
        partner = {}
        for op in (op for ops in self.schedule.ops for op in ops if op.kind == OVERLAP):
            f, b = op.forward.stage, op.backward.stage
            partner[f] = b if f not in partner or B[b] > B[partner[f]] else partner[f]
        return np.array([F[s] + B[partner.get(s, s)] for s in range(len(F))])

    def simulate_kwargs(self, flop_rate: float = 1.0) -> dict:
        """``F, B, W, FB`` (FLOPs / ``flop_rate``: e.g. FLOP per ms gives ms) and ``memory``
        (the held activation bytes as ``memory["F"]``) for :func:`pdjax.schedules.simulate`."""
        rate = check_positive("flop_rate", flop_rate)
        return dict(F=self.F / rate, B=self.B / rate, W=self.W / rate, FB=self.FB / rate,
                    memory={"F": self.activation_bytes})

    def simulate(self, flop_rate: float = 1.0, comm=0.0) -> Timeline:
        """The schedule simulated with these costs (``comm``: latency of every cross-rank
        dependency, in the same unit). A stage that does no FLOPs (no layer, no head) cannot
        be simulated: give ``layers_per_stage`` that leaves none empty."""
        return simulate(self.schedule, **self.simulate_kwargs(flop_rate), comm=comm)

    def rank_param_bytes(self) -> np.ndarray:
        """Bytes of the weights each rank holds (its stages' params; DualPipe: two copies)."""
        out = np.zeros(self.schedule.num_ranks)
        np.add.at(out, list(self.schedule.layout.stage_rank), self.param_bytes)
        return out

    def peak_bytes(self, timeline: Timeline) -> np.ndarray:
        """Per rank, its params plus the peak of the activations it holds in ``timeline``
        (from :meth:`simulate`)."""
        return self.rank_param_bytes() + timeline.peak_memory


def pipeline_costs(cfg, schedule, microbatch, *, layers_per_stage=None, mtp_weight: float = 0.0) -> PipelineCosts:
    """Per-stage FLOPs, held activations and params of ``schedule`` for model ``cfg``, one
    micro-batch being ``microbatch = (rows, seq_len)`` tokens (see the module docstring).

    ``layers_per_stage``: decoder layers per chunk, as :class:`pdjax.pipeline.Executor`
    takes it (default as even as possible). ``mtp_weight``: the loss's MTP weight, as the
    executor takes it; > 0 (the config must have MTP modules) adds :func:`mtp_term` to every
    stage that holds the LM head. Errors name the argument, before anything is computed."""
    for field in ("num_nextn_predict_layers", "param_dtype", "compute_dtype", "is_moe_layer"):
        if not hasattr(cfg, field):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__} (no {field!r})")
    if not hasattr(schedule, "layout") or not hasattr(schedule, "ops"):
        raise TypeError(f"schedule must be a Schedule (pdjax.schedules.build), got {type(schedule).__name__}")
    mtp = check_mtp_weight(mtp_weight, cfg) > 0
    rows, seq_len = _check_microbatch(microbatch, cfg.num_nextn_predict_layers if mtp else 0)
    positions = stage_chunks(schedule.layout)
    chunks = split_layers(cfg.num_hidden_layers, len(schedule.layout.pipelines[0].stages), layers_per_stage)
    terms = tuple(chunk_term(cfg, chunks[c], rows, seq_len, mtp) for c in positions)
    extra = mtp_term(cfg, rows, seq_len) if mtp else StageTerm()
    return PipelineCosts(cfg, schedule, (rows, seq_len), float(mtp_weight), chunks, tuple(positions), terms, extra)


def _check_microbatch(microbatch, depths: int) -> tuple[int, int]:
    """``(rows, seq_len)``: positive ints, seq_len >= 2 (+ the MTP depths with mtp_weight)."""
    if isinstance(microbatch, (str, bytes)) or not hasattr(microbatch, "__len__") or len(microbatch) != 2:
        raise TypeError(f"microbatch must be (rows, seq_len), got {microbatch!r}")
    rows, seq_len = (check_int(f"microbatch {name}", v) for name, v in zip(("rows", "seq_len"), microbatch))
    need = 2 + depths
    if seq_len < need:
        raise ValueError(f"microbatch seq_len must be at least {need}"
                         f"{' (num_nextn_predict_layers + 2 with mtp_weight)' if depths else ''}, got {seq_len}")
    return rows, seq_len
