"""The matmuls of one decoder layer of a DeepSeek-style model and their shapes, read from its
ModelConfig: the one description every cost model that times or counts them reads.

The op-level cost model (:mod:`pdjax.analysis.opmodel`), DeepSeek's training chunk pair
(:mod:`pdjax.analysis.train_pair`), a pipeline's per-stage costs
(:mod:`pdjax.analysis.pipeline_costs`) and the roofline cost model's kv_b
(:mod:`pdjax.analysis.costmodel`) all take their GEMMs from here.

    gemms = layer_gemms(cfg, layer=3, form="naive")      # a tuple of Gemm
    matmul_flops(cfg, gemms, tokens=4096)                # 2 x multiply-adds of 4,096 new tokens

A :class:`Gemm` multiplies M activation rows of K columns by a K x N weight (N outputs),
``groups`` such products per row. Its rows (``Gemm.rows``) are one of

* ``"token"``: one per token the step computes (a prefill chunk's new tokens, a decode
  step's tokens, a training micro-batch's tokens);
* ``"attended"``: one per token whose K/V the step attends, new and cached (the naive MLA
  form expands every cached latent again);
* ``"routed"``: one per (token, routed expert) pair, ``num_experts_per_tok`` per token,
  grouped by expert (the weight is one of ``n_routed_experts``, the activation per token).

With D hidden, H heads, C kv_lora_rank, R qk_rope_head_dim, Q q_lora_rank, d_n / d_v the
no-RoPE key and value head dims, I moe_intermediate_size, S n_shared_experts, E
n_routed_experts, V vocab_size, Hi / Di DeepSeek-V3.2's index_n_heads / index_head_dim:

    name            block      N                  K           rows, notes
    qkv_a           attention  Q + C + R          D           q_a and kv_a fused (one input: the normed
                                                              hidden state); no q LoRA: N = H (d_n + R) + C + R
    q_b             attention  H (d_n + R)        Q           only with q LoRA
    kv_b            attention  H (d_n + d_v)      C           "attended"; naive form only
    w_uk            attention  C, H groups        d_n         absorbed form only: W_UK folded into q
    w_uv            attention  d_v, H groups      C           absorbed form only: W_UV on the output
    o               attention  D                  H d_v
    index_q         indexer    Hi Di              Q           the lightning indexer, only with
    index_k         indexer    Di                 D           sparse attention (index_topk > 0)
    index_w         indexer    Hi                 D
    router          router     E                  D
    shared_gate_up  shared     2 S I              D           the S shared experts fused; none if S = 0
    shared_down     shared     D                  S I
    routed_gate_up  routed     2 I                D           "routed"
    routed_down     routed     D                  I           "routed"
    mlp_gate_up     dense_mlp  2 intermediate     D           a dense layer's MLP (instead of the four above)
    mlp_down        dense_mlp  D                  intermediate
    lm_head         head       V                  D           :func:`head_gemms`
    eh_proj         mtp        D                  2 D         an MTP depth's projection, :func:`mtp_gemms`

Gate and up projections are one GEMM of N = 2 I (as DeepGEMM measured them). The form is
``"naive"`` (prefill and training: kv_b expands the latents) or ``"absorbed"`` (decode: the
per-head W_UK / W_UV products on the latent instead); every other GEMM is the same in both.
``Gemm.fp8`` is False for what DeepSeek's FP8 recipe keeps in BF16: the router, the absorbed
per-head products, the LM head (and the indexer's float32 head weights).

Every weight matrix of a layer (:func:`pdjax.param_counts.layer_params` less its norm and
bias vectors) is the weight of exactly one GEMM here (:func:`weight_elements`), and one token
multiplies with all of them once, the routed experts' ``num_experts_per_tok`` of E
(tests/analysis/test_layer_gemms.py holds both against the model's own parameter tree).
"""

from __future__ import annotations

import dataclasses

from pdjax.arguments import check_int

#: The two forms of MLA's attention projections: "naive" (prefill, training), "absorbed" (decode).
FORMS = ("naive", "absorbed")
#: What one row of a GEMM's activation is (see the module docstring).
ROWS = ("token", "attended", "routed")


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matmul of a layer: activation rows (``rows``: "token", "attended" or "routed") of
    ``k`` columns by a ``k`` x ``n`` weight, ``groups`` independent products per row (the
    absorbed form's heads); ``block`` the part of the layer it belongs to; ``fp8`` False
    where DeepSeek's FP8 recipe keeps it in BF16."""

    name: str
    block: str
    n: int
    k: int
    rows: str = "token"
    groups: int = 1
    fp8: bool = True

    def transposed(self) -> "Gemm":
        """The input gradient's GEMM: the same rows, N and K swapped."""
        return dataclasses.replace(self, n=self.k, k=self.n)


def _check_form(form: str) -> str:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return form


def attention_gemms(cfg, form: str = "naive") -> tuple[Gemm, ...]:
    """MLA's projections in ``form`` ("naive" or "absorbed"), and DeepSeek-V3.2's lightning
    indexer when the config has sparse attention (see the module docstring)."""
    _check_form(form)
    D, H, C, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v, Q = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    q_heads = H * (nope + R)
    out = [Gemm("qkv_a", "attention", (Q or q_heads) + C + R, D)]
    if Q:
        out.append(Gemm("q_b", "attention", q_heads, Q))
    if form == "naive":
        out.append(Gemm("kv_b", "attention", H * (nope + v), C, rows="attended"))
    else:
        out += [Gemm("w_uk", "attention", C, nope, groups=H, fp8=False),
                Gemm("w_uv", "attention", v, C, groups=H, fp8=False)]
    out.append(Gemm("o", "attention", D, H * v))
    return tuple(out) + indexer_gemms(cfg)


def indexer_gemms(cfg) -> tuple[Gemm, ...]:
    """DeepSeek-V3.2's lightning indexer (none without sparse attention): its query from the
    q LoRA residual, its key and its per-head weights from the hidden state."""
    if not getattr(cfg, "index_topk", 0):
        return ()
    Hi, Di, D = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    return (Gemm("index_q", "indexer", Hi * Di, cfg.q_lora_rank), Gemm("index_k", "indexer", Di, D),
            Gemm("index_w", "indexer", Hi, D, fp8=False))


def moe_gemms(cfg) -> tuple[Gemm, ...]:
    """An MoE layer's router, shared experts (fused, none when n_shared_experts is 0) and
    routed experts."""
    D, inter, S = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_shared_experts
    out = [Gemm("router", "router", cfg.n_routed_experts, D, fp8=False)]
    if S:
        out += [Gemm("shared_gate_up", "shared", 2 * S * inter, D), Gemm("shared_down", "shared", D, S * inter)]
    return tuple(out) + (Gemm("routed_gate_up", "routed", 2 * inter, D, rows="routed"),
                         Gemm("routed_down", "routed", D, inter, rows="routed"))


def dense_mlp_gemms(cfg) -> tuple[Gemm, ...]:
    """The dense SwiGLU MLP of a dense layer (the first ``first_k_dense_replace``)."""
    D, inter = cfg.hidden_size, cfg.intermediate_size
    return Gemm("mlp_gate_up", "dense_mlp", 2 * inter, D), Gemm("mlp_down", "dense_mlp", D, inter)


def layer_gemms(cfg, layer: int, form: str = "naive") -> tuple[Gemm, ...]:
    """Every matmul of decoder layer ``layer`` in ``form``: the attention's, then the MoE
    block's or the dense MLP's, as ``cfg.is_moe_layer(layer)`` says (``layer`` >=
    ``num_hidden_layers``: an MTP depth's block, built like any layer of that index)."""
    check_int("layer", layer, 0)
    ffn = moe_gemms(cfg) if cfg.is_moe_layer(layer) else dense_mlp_gemms(cfg)
    return attention_gemms(cfg, form) + ffn


def head_gemms(cfg) -> tuple[Gemm, ...]:
    """The LM head (BF16 in DeepSeek's recipe)."""
    return (Gemm("lm_head", "head", cfg.vocab_size, cfg.hidden_size, fp8=False),)


def mtp_gemms(cfg) -> tuple[Gemm, ...]:
    """An MTP depth's own projection ``eh_proj`` of the concatenated [embedding | hidden]
    (its decoder block is :func:`layer_gemms` of layer ``num_hidden_layers + depth - 1``, its
    head the model's)."""
    D = cfg.hidden_size
    return (Gemm("eh_proj", "mtp", D, 2 * D),)


def row_counts(cfg, tokens, attended=None) -> dict:
    """{rows kind: M} of a step computing ``tokens`` tokens that attends ``attended`` tokens
    (default ``tokens``: nothing cached); "routed" is ``tokens`` x ``num_experts_per_tok``."""
    return {"token": tokens, "attended": tokens if attended is None else attended,
            "routed": tokens * cfg.num_experts_per_tok}


def matmul_flops(cfg, gemms, tokens, attended=None):
    """2 x the multiply-adds of ``gemms`` in a step of ``tokens`` tokens attending ``attended``
    (:func:`row_counts`): 2 M N K x groups each (an int for int arguments)."""
    rows = row_counts(cfg, tokens, attended)
    return sum(2 * rows[g.rows] * g.n * g.k * g.groups for g in gemms)


def weight_elements(cfg, gemms) -> int:
    """Elements of the weights ``gemms`` multiply with: N K x groups each, the routed ones
    once per routed expert (E of them)."""
    return sum(g.n * g.k * g.groups * (cfg.n_routed_experts if g.rows == "routed" else 1) for g in gemms)
