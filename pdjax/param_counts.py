"""Parameter counts of a DeepSeek-style model, computed from its :class:`~pdjax.ModelConfig`.

Conventions (checked against the published figures in ``tests/analysis``):

* ``total`` counts every weight of the main model, input embedding and LM head included,
  the multi-token-prediction (MTP) module excluded. DeepSeek-V3: 671.03e9 (published
  "671B"); DeepSeek-V2: 235.7e9 ("236B"); V2-Lite: 15.7e9 ("15.7B"/"16B").
* ``active`` counts the weights one token's forward pass multiplies with: every attention,
  norm and dense-MLP weight, the router, the shared experts and ``num_experts_per_tok``
  routed experts of each MoE layer, and the LM head; the input embedding is a row
  lookup, not a matmul, and is left out. DeepSeek-V3: 36.63e9 (published "37B");
  V2: 20.85e9 ("21B"); V2-Lite: 2.451e9 ("2.4B", truncated). Counting the input embedding
  too (``active_with_embedding``) gives 37.55e9 / 21.38e9 / 2.66e9, which misses V3's
  "37B"; leaving out the head as well gives 35.70e9 / 20.33e9 / 2.24e9, which misses both.
  DeepSeek-V3's published N_a = 37 B is this ``active`` count.
* ``mtp`` counts ``mtp_layers`` MTP modules (default the config's
  ``num_nextn_predict_layers``; DeepSeek-V3 has one), apart from ``total``: each is one MoE decoder layer plus its projection
  ``eh_proj`` (2D x D) and three RMSNorms; it shares the embedding and head with the main
  model. The HF checkpoint stores its own copies of both, so
  ``checkpoint_total = total + mtp + mtp_layers * (embedding + lm_head)`` = 684.5e9 for V3
  (DeepSeek: "685B, of which 671B main model and 14B MTP": 13.46e9 by this count).

Norm weights and the V3 router bias are counted; they are negligible (< 0.01 %).

A pure function of the config's fields, below :mod:`pdjax.model_config` (which shows the counts
in its notebook view), so it reads the fields it needs and imports no config class.
"""

from __future__ import annotations

import dataclasses

from pdjax.arguments import check_int

# the config fields the counts read (a ModelConfig has them all)
_FIELDS = ("hidden_size", "num_attention_heads", "q_lora_rank", "qk_head_dim", "kv_lora_rank", "qk_rope_head_dim",
           "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
           "moe_intermediate_size", "intermediate_size", "topk_method", "num_hidden_layers", "is_moe_layer",
           "vocab_size", "tie_word_embeddings")


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by component (numbers of elements, not bytes)."""

    embedding: int          # input embedding, vocab x hidden
    lm_head: int            # output projection, hidden x vocab (0 if tied to the embedding)
    attention: int          # all MLA projections and their LoRA norms, all layers
    norms: int              # per-layer RMSNorms (2 per layer) and the final norm
    dense_mlp: int          # SwiGLU MLPs of the dense (non-MoE) layers
    routed_experts: int     # all routed experts of all MoE layers
    shared_experts: int     # shared experts of all MoE layers
    router: int             # gate weights (+ V3 correction bias) of all MoE layers
    routed_active: int      # num_experts_per_tok routed experts per MoE layer
    mtp: int = 0            # MTP modules (without their embedding/head copies)
    mtp_layers: int = 0

    COMPONENTS = ("embedding", "lm_head", "attention", "norms", "dense_mlp", "routed_experts",
                  "shared_experts", "router", "mtp")

    def table(self) -> list[tuple[str, int]]:
        """``(row, count)``: every component of the main model, the total, the MTP modules
        (apart from the total, when there are any) and the active count."""
        rows = [(k, getattr(self, k)) for k in self.COMPONENTS if k != "mtp"] + [("total", self.total)]
        return rows + ([("mtp (apart)", self.mtp)] if self.mtp else []) + [("active per token", self.active)]

    def _repr_html_(self) -> str:
        cells = "".join(f"<tr><td>{k}</td><td style='text-align:right'>{v:,}</td>"
                        f"<td style='text-align:right'>{v / 1e9:.3f} B</td></tr>" for k, v in self.table())
        return f"<table><tr><th>params</th><th>count</th><th></th></tr>{cells}</table>"

    @property
    def total(self) -> int:
        """Main model, embedding and head included, MTP excluded (V3: 671B)."""
        return (self.embedding + self.lm_head + self.attention + self.norms + self.dense_mlp
                + self.routed_experts + self.shared_experts + self.router)

    @property
    def non_routed(self) -> int:
        """Everything except the routed experts (what each EP rank replicates)."""
        return self.total - self.routed_experts

    @property
    def active(self) -> int:
        """Params multiplied per token: all but the input embedding and idle experts (V3: 37B)."""
        head = self.lm_head if self.lm_head else self.embedding  # a tied head is still a matmul
        return (head + self.attention + self.norms + self.dense_mlp + self.shared_experts
                + self.router + self.routed_active)

    @property
    def active_with_embedding(self) -> int:
        """``active`` plus the input embedding table (V3: 37.55e9)."""
        return self.active + self.embedding

    @property
    def checkpoint_total(self) -> int:
        """``total`` plus the MTP modules and their stored embedding/head copies (V3: 684.5e9)."""
        head = self.lm_head if self.lm_head else self.embedding
        return self.total + self.mtp + self.mtp_layers * (self.embedding + head)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(total=self.total, active=self.active, non_routed=self.non_routed,
                 active_with_embedding=self.active_with_embedding,
                 checkpoint_total=self.checkpoint_total)
        return d


def _attention_params(cfg: "ModelConfig") -> int:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = d * h * cfg.qk_head_dim
    else:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    kv = (d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
          + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
    out = h * cfg.v_head_dim * d
    return q + kv + out + _indexer_params(cfg)


def _indexer_params(cfg: "ModelConfig") -> int:
    """DeepSeek-V3.2's lightning indexer (0 without sparse attention): wq_b [Q, Hi*Di],
    wk [D, Di], its key's LayerNorm (weight and bias) and weights_proj [D, Hi]."""
    hi, di = getattr(cfg, "index_n_heads", 0), getattr(cfg, "index_head_dim", 0)
    if not getattr(cfg, "index_topk", 0):
        return 0
    return cfg.q_lora_rank * hi * di + cfg.hidden_size * di + 2 * di + cfg.hidden_size * hi


def _mlp_params(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate  # SwiGLU: gate, up, down


def _router_params(cfg: "ModelConfig") -> int:
    bias = cfg.n_routed_experts if cfg.topk_method == "noaux_tc" else 0
    return cfg.n_routed_experts * cfg.hidden_size + bias


def layer_params(cfg, layer: int) -> int:
    """Elements of decoder layer ``layer``'s weights: attention, its two norms, and the dense MLP
    or the MoE block (routed and shared experts, router), as ``cfg.is_moe_layer(layer)`` says.
    ``layer`` >= ``num_hidden_layers`` is an MTP module's block (depth ``layer -
    num_hidden_layers + 1``), built like any other layer of that index."""
    check_int("layer", layer, 0)
    d = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return _attention_params(cfg) + 2 * d + _mlp_params(d, cfg.intermediate_size)
    expert = _mlp_params(d, cfg.moe_intermediate_size)
    return (_attention_params(cfg) + 2 * d + (cfg.n_routed_experts + cfg.n_shared_experts) * expert
            + _router_params(cfg))


def mtp_depth_params(cfg, depth: int) -> int:
    """Elements of MTP depth ``depth``'s weights (1-based): its block (:func:`layer_params` of
    layer ``num_hidden_layers + depth - 1``), ``eh_proj`` [2D, D] and its three norms
    (``enorm``, ``hnorm``, ``head_norm``); the embedding and head it shares are not in it."""
    check_int("depth", depth, 1)
    d = cfg.hidden_size
    return layer_params(cfg, cfg.num_hidden_layers + depth - 1) + 2 * d * d + 3 * d


def param_counts(cfg: "ModelConfig", mtp_layers: int | None = None) -> ParamCounts:
    """Count the parameters of ``cfg`` by component; see the module docstring for which
    sums reproduce the published totals. ``mtp_layers``: MTP modules to count (default
    ``cfg.num_nextn_predict_layers``; V3: 1), reported apart from ``total``."""
    missing = [f for f in _FIELDS if not hasattr(cfg, f)]
    if missing:
        raise TypeError(f"param_counts expects a ModelConfig, got {type(cfg).__name__} (no {missing[0]!r})")
    mtp_layers = getattr(cfg, "num_nextn_predict_layers", 0) if mtp_layers is None else mtp_layers
    check_int("mtp_layers", mtp_layers, 0)
    d = cfg.hidden_size
    n_layers = cfg.num_hidden_layers
    moe_layers = [i for i in range(n_layers) if cfg.is_moe_layer(i)]
    n_moe, n_dense = len(moe_layers), n_layers - len(moe_layers)
    expert = _mlp_params(d, cfg.moe_intermediate_size) if cfg.n_routed_experts else 0
    attn = _attention_params(cfg)
    mtp = sum(mtp_depth_params(cfg, k) for k in range(1, mtp_layers + 1))
    embedding = cfg.vocab_size * d
    return ParamCounts(
        embedding=embedding,
        lm_head=0 if cfg.tie_word_embeddings else embedding,
        attention=n_layers * attn,
        norms=n_layers * 2 * d + d,
        dense_mlp=n_dense * _mlp_params(d, cfg.intermediate_size),
        routed_experts=n_moe * cfg.n_routed_experts * expert,
        shared_experts=n_moe * cfg.n_shared_experts * expert,
        router=n_moe * _router_params(cfg) if cfg.n_routed_experts else 0,
        routed_active=n_moe * cfg.num_experts_per_tok * expert,
        mtp=mtp,
        mtp_layers=mtp_layers,
    )
