"""Write docs/reproductions.md: every figure of the source articles that pdjax computes,
next to pdjax's value and the expression that computes it.

    .venv/bin/python docs/make_reproductions.py          # rewrite docs/reproductions.md
    .venv/bin/python docs/make_reproductions.py --check  # exit 1 if the file is stale

Each row's expression is evaluated after ``SETUP`` (printed at the top of the page, and run
by tests/test_docs.py like every other example there), so the page cannot show a value
pdjax does not compute. A row states the article's figure and how it is compared:

* ``Published(value, decimals)``: the article prints ``value`` rounded to ``decimals``
  places; pdjax's value must round to it;
* ``Between(lo, hi)``: the article gives a range;
* ``Formula(text, expression)``: the article gives a closed form; ``expression`` evaluates
  it from the config (or pdjax's own closed form), and pdjax's simulated or modelled value
  must equal it.

A note may quote further values as ``[[expression|format]]``, evaluated the same way.
A row the article rounds or truncates differently carries ``expect="differs"`` and a note;
any other mismatch raises, so a change in pdjax that breaks a reproduction fails
``--check`` and tests/test_docs.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from typing import Optional, Union

HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "reproductions.md")

SETUP = '''\
import math
import pdjax
from pdjax import analysis as A, pipeline as pp
from pdjax.schedules.formulas import bubble_ratio_1f1b, min_microbatches_1f1b

v2, v3 = pdjax.configs.deepseek_v2(), pdjax.configs.deepseek_v3()
h100, h800, h200, a100 = (A.hardware(n) for n in ("h100-sxm", "h800", "h200", "a100"))
serving = A.published.DEEPSEEK_V3_SERVING        # DeepSeek's EP32 prefill / EP144 decode, fp8 weights, mean KV 4,989
kv_mla, kv_mha = A.kv_bytes_per_token(v3, 2, "mla"), A.kv_bytes_per_token(v3, 2, "mha")
n_active = A.param_counts(v3).active   # weights one token multiplies with (embedding excluded)
w144 = A.ep_weight_bytes_per_gpu(v3, serving.decode_ep, serving.weight_dtype_bytes)
free_75 = math.floor(A.free_memory_bytes(h800.hbm_bytes, w144) / A.units.GB)   # the articles round 75.3 GB down
a100_2tb = a100.replace(hbm_bw=round(a100.hbm_bw / 1e12) * 1e12)      # ... and 2,039 GB/s to 2 TB/s
moe8 = pdjax.ModelConfig(n_routed_experts=A.published.MEGASCALE_INFER_EXAMPLE.n_routed_experts,
                         num_experts_per_tok=A.published.MEGASCALE_INFER_EXAMPLE.num_experts_per_tok)
qwen, fastafd = A.published.QWEN3_GB200_COLOCATED, A.published.FASTAFD_EXAMPLE
costs = dict(F=1.0, B=2.0, W=1.0, FB=2.5)   # F = I >= W and F&B >= max(F, B): the closed forms apply
ep_a2a = {ep: A.RooflineCostModel(v3, h800, dtype_bytes=2, ep_size=ep).op_costs(kv_lens=[0] * ep)["all_to_all"]
          for ep in (serving.prefill_ep, serving.decode_ep)}   # one token per GPU
'''


@dataclasses.dataclass(frozen=True)
class Published:
    value: float
    decimals: int
    text: Optional[str] = None

    def label(self) -> str:
        return self.text or f"{self.value:,.{self.decimals}f}"

    def holds(self, v: float, ns: dict) -> bool:
        return abs(v - self.value) <= 0.5 * 10 ** -self.decimals + 1e-9


@dataclasses.dataclass(frozen=True)
class Between:
    lo: float
    hi: float
    text: str

    def label(self) -> str:
        return self.text

    def holds(self, v: float, ns: dict) -> bool:
        return self.lo < v < self.hi


@dataclasses.dataclass(frozen=True)
class Formula:
    text: str
    expression: str

    def label(self) -> str:
        return f"{self.text} = `{self.expression}`"

    def holds(self, v: float, ns: dict) -> bool:
        return math.isclose(v, float(eval(self.expression, ns)), rel_tol=1e-12, abs_tol=1e-12)


@dataclasses.dataclass(frozen=True)
class Row:
    what: str
    article: Union[Published, Between, Formula]
    expression: str
    fmt: str = "{:,.2f}"
    unit: str = ""
    note: str = ""
    expect: str = "same"            # "differs": the article rounds or truncates otherwise (see note)


def bubble_1f1b(m: int) -> Row:
    ratio = {16: 48.4, 32: 31.9, 64: 19.0, 128: 10.5, 256: 5.5}[m]
    return Row(f"1F1B bubble ratio (P-1)/(m+P-1), P = 16, m = {m}", Published(ratio, 1),
               f'100 * pp.simulate(pp.build("1f1b", 16, {m}), F=1.0, B=2.0).bubble_ratio', "{:.2f}", "%",
               f"simulated; the closed form `bubble_ratio_1f1b(16, {m})` is equal")


SECTIONS: list[tuple[str, list[Row]]] = [
    ("Two workloads: roofline", [
        Row("Weight arithmetic intensity 2B/p, B = 1 token, bf16", Formula("2B/p", "2 * 1 / 2"),
            "A.weight_intensity(1, 2)", "{:g}", "FLOP/B"),
        Row("Machine balance A*, H100 SXM, bf16", Published(295, 0, "≈ 295"),
            'A.machine_balance(h100, "bf16")', "{:.1f}", "FLOP/B"),
        Row("Machine balance A*, H100 SXM, fp8", Published(591, 0, "≈ 591"),
            'A.machine_balance(h100, "fp8")', "{:.1f}", "FLOP/B"),
        Row("Machine balance A*, A100 (HBM 2 TB/s)", Published(156, 0),
            "A.machine_balance(a100_2tb)", "{:.1f}", "FLOP/B",
            "the article rounds the A100's [[a100.hbm_bw / 1e9|,.0f]] GB/s to 2 TB/s; the datasheet value gives "
            "[[A.machine_balance(a100)|.0f]]"),
        Row("Machine balance A*, H200", Published(206, 0, "≈ 206"), "A.machine_balance(h200)", "{:.1f}", "FLOP/B"),
        Row("Share of peak a bf16 decode uses at B = 1, H100", Published(0.3, 1, "≈ 0.3"),
            '100 * A.roofline.decode_utilisation_bound(h100, batch_tokens=1, dtype="bf16")', "{:.2f}", "%"),
        Row("Decode batch to reach the compute roof, H100 bf16", Published(295, 0, "≈ A* ≈ 295"),
            'A.roofline.compute_bound_batch(h100, "bf16")', "{:.1f}", "sequences"),
        Row("Attention intensity, MHA, bf16 (2/p; S cancels)", Formula("2/p", "2 / 2"),
            'A.attention_intensity(v3, "mha", 2)', "{:g}", "FLOP/B"),
        Row("Attention intensity, MLA, DeepSeek-V3, bf16", Published(56.9, 1, "≈ 56.9"),
            'A.attention_intensity(v3, "mla", 2)', "{:.2f}", "FLOP/B"),
    ]),
    ("KV cache accounting", [
        Row("KV per token, DeepSeek-V3 MLA, bf16", Published(70272, 0), "kv_mla", "{:,.0f}", "B"),
        Row("... in KiB", Published(68.6, 1), "kv_mla / A.units.KiB", "{:.2f}", "KiB"),
        Row("KV per token, DeepSeek-V3 MHA counterfactual, bf16", Published(3997696, 0), "kv_mha", "{:,.0f}", "B"),
        Row("... in MiB", Published(3.81, 2), "kv_mha / A.units.MiB", "{:.3f}", "MiB"),
        Row("MHA / MLA, DeepSeek-V3", Published(56.9, 1), "kv_mha / kv_mla", "{:.2f}", "x"),
        Row("KV per token, DeepSeek-V2 MLA, bf16", Formula("(d_c + d_R) L p",
            "(v2.kv_lora_rank + v2.qk_rope_head_dim) * v2.num_hidden_layers * 2"),
            'A.kv_bytes_per_token(v2, 2, "mla")', "{:,.0f}", "B"),
        Row("KV per token, DeepSeek-V2 MHA counterfactual, bf16", Formula("2 n_h d_h L p",
            "2 * v2.num_attention_heads * v2.v_head_dim * v2.num_hidden_layers * 2"),
            'A.kv_bytes_per_token(v2, 2, "mha")', "{:,.0f}", "B"),
        Row("DeepSeek-V3 parameters", Published(671, 0, "671 B"), "A.param_counts(v3).total / 1e9", "{:.2f}",
            "B params"),
        Row("DeepSeek-V3 active parameters per token N_a", Published(37, 0, "37 B"), "n_active / 1e9", "{:.2f}",
            "B params"),
        Row("Weights in fp8", Published(671, 0, "671 GB"),
            "A.param_counts(v3).total * serving.weight_dtype_bytes / A.units.GB", "{:.2f}", "GB"),
        Row("... per GPU over EP144", Published(4.7, 1, "≈ 4.7 GB"), "w144 / A.units.GB", "{:.2f}", "GB",
            "the whole model split evenly; `layout=\"replicated\"` (attention on every GPU) gives "
            "[[A.ep_weight_bytes_per_gpu(v3, 144, 1, layout='replicated') / A.units.GB|.1f]] GB"),
        Row("Free HBM per H800 after the weights", Published(75, 0, "75 GB"),
            "A.free_memory_bytes(h800.hbm_bytes, w144) / A.units.GB", "{:.2f}", "GB",
            "the rows below use `free_75`, rounded down to whole GB as the article does"),
        Row("Sequences per GPU C_max, MLA, S = 4,989", Published(214, 0, "≈ 214"),
            'A.concurrency_bound(free_75, serving.mean_kv_len, kv_mla, unit="GB")', "{:.1f}", "seqs"),
        Row("Sequences per GPU C_max, MHA, S = 4,989", Published(3.76, 2),
            'A.concurrency_bound(free_75, serving.mean_kv_len, kv_mha, unit="GB")', "{:.3f}", "seqs"),
        Row("... the same 75 read as GiB (binary units)", Published(4.04, 2),
            'A.concurrency_bound(free_75, serving.mean_kv_len, kv_mha, unit="GiB")', "{:.3f}", "seqs"),
        Row("KV handoff, S = 32,768, 50 GB/s", Published(46.0, 1),
            "1e3 * A.kv_handoff_time(32768, kv_mla, h800.scale_out_bw)", "{:.2f}", "ms",
            "the article truncates [[1e3 * A.kv_handoff_time(32768, kv_mla, h800.scale_out_bw)|.3f]] to 46.0",
            "differs"),
        Row("KV handoff, S = 32,768, 160 GB/s", Published(14.4, 1),
            "1e3 * A.kv_handoff_time(32768, kv_mla, h800.scale_up_bw)", "{:.2f}", "ms"),
        Row("Handoff / prefill compute, 989 TFLOP/s, 50 GB/s (any S)", Published(1.9, 1, "≈ 1.9"),
            '100 * A.handoff_to_prefill_ratio(kv_mla, n_active, h800.peak_flops("bf16"), h800.scale_out_bw)',
            "{:.2f}", "%"),
        Row("Link speed at which the handoff reaches 50 % of prefill", Between(1, 2, "1-2 GB/s"),
            'A.kv.link_bw_for_handoff_ratio(0.5, kv_mla, n_active, h800.peak_flops("bf16")) / A.units.GB', "{:.2f}", "GB/s"),
    ]),
    ("Expert parallelism and PD disaggregation", [
        Row("Decode EP over prefill EP (144 / 32)", Published(4.5, 1), "serving.ep_ratio", "{:g}", "x"),
        Row("EP all-to-all per token per MoE layer, EP32, bf16 (dispatch + combine)",
            Formula("2 k D p (EP-1)/EP",
                    "2 * v3.num_experts_per_tok * v3.hidden_size * 2 * (serving.prefill_ep - 1) / serving.prefill_ep"),
            "ep_a2a[serving.prefill_ep].link_bytes", "{:,.0f}", "B",
            "the cost model's link bytes per GPU; one token per GPU"),
        Row("EP all-to-all per token per MoE layer, EP144, bf16",
            Formula("2 k D p (EP-1)/EP",
                    "2 * v3.num_experts_per_tok * v3.hidden_size * 2 * (serving.decode_ep - 1) / serving.decode_ep"),
            "ep_a2a[serving.decode_ep].link_bytes", "{:,.0f}", "B"),
    ]),
    ("AF disaggregation", [
        Row("Colocated decode batch at 2K context, Qwen3-235B on GB200", Published(395, 0),
            "A.decode_batch_for_context(qwen.kv_token_capacity, qwen.context_len)", "{:.1f}", "seqs",
            "B = KV-token capacity / S, with the capacity the source reports"),
        Row("... at 128K context", Published(6, 0),
            "A.decode_batch_for_context(qwen.kv_token_capacity, 128 * 1024)", "{:.2f}", "seqs"),
        Row("MoE MFU bound k/E, 8 experts top-2", Published(25, 0), "100 * A.moe_bounds.moe_mfu_bound(moe8)", "{:.0f}", "%"),
        Row("Tokens per expert at the A100 balance batch", Published(39, 0),
            "A.moe_bounds.tokens_per_expert_at_balance(moe8, a100_2tb)", "{:.1f}", "tokens"),
        Row("Ping-pong micro-batches, T_c = T_f / 2: m >= 2(1 + T_c/T_f)", Published(3, 0),
            "A.afd_min_microbatches(0.5, 1.0)", "{:g}", ""),
        Row("Ping-pong micro-batches, T_c = T_f", Published(4, 0), "A.afd_min_microbatches(1.0, 1.0)", "{:g}", ""),
        Row("AFD speedup 1.50 x 1.15 x 0.85", Published(1.47, 2, "≈ 1.47"),
            "A.afd_speedup(fastafd.batch_gain, fastafd.step_time_gain, fastafd.attention_share)", "{:.4f}", "x"),
    ]),
    ("Pipeline bubbles", [
        *(bubble_1f1b(m) for m in (16, 32, 64, 128, 256)),
        Row("Micro-batches for a 1F1B bubble below 10 %, P = 16: m > 9(P-1)", Published(136, 0, "≈ 136"),
            "min_microbatches_1f1b(16, 0.10)", "{:d}", ""),
        Row("1F1B bubble per device, P = 8", Formula("(P-1)(F+B)", 'pp.bubble_formula("1f1b", 8, **costs)'),
            'pp.simulate(pp.build("1f1b", 8, 20), F=1.0, B=2.0).bubble.max()', "{:g}", "F units",
            "simulated, every rank"),
        Row("ZB1P bubble per device, P = 8", Formula("(P-1)(F+B-2W)", 'pp.bubble_formula("zb1p", 8, **costs)'),
            'pp.simulate(pp.build("zb1p", 8, 20), F=1.0, B=2.0, W=1.0).bubble.max()', "{:g}", "F units",
            "simulated, every rank"),
        Row("DualPipe bubble per device, P = 8", Formula("(P/2-1)(F&B+B-3W)",
                                                         'pp.bubble_formula("dualpipe", 8, **costs)'),
            'pp.simulate(pp.build("dualpipe", 8, 20), **costs).bubble.max()', "{:g}", "F units",
            "simulated, middle ranks (the others idle less)"),
        Row("DualPipeV bubble per device, 4 devices (P = 8 stages)",
            Formula("(P/2-1)(F&B+B-3W)", 'pp.bubble_formula("dualpipev", 8, **costs)'),
            'pp.simulate(pp.build("dualpipev", 4, 20), **costs).bubble.max()', "{:g}", "F units",
            "simulated, last rank"),
        Row("DualPipe parameter copies per device", Formula("2x", 'pp.memory_table("dualpipe", 8)["params"]'),
            'max(pp.build("dualpipe", 8, 20).param_copies())', "{:d}", "stages"),
        Row("DualPipe peak activations per device, P = 8", Formula("P+1",
                                                                   'pp.memory_table("dualpipe", 8)["activations"]'),
            'int(pp.simulate(pp.build("dualpipe", 8, 20), **costs).peak_activations.max())', "{:d}",
            "micro-batches", "simulated, every rank"),
        Row("ZB1P peak activations per device, P = 8", Formula("P", 'pp.memory_table("zb1p", 8)["activations"]'),
            'int(pp.simulate(pp.build("zb1p", 8, 20), F=1.0, B=2.0, W=1.0).peak_activations.max())', "{:d}",
            "micro-batches"),
    ]),
]

NOT_COMPUTED = """\
Not reproduced, because they are measurements rather than consequences of a config: the
MoE FFN MFU of 28 % at 2K falling to 0.5 % at 128K (scaling the 28 % with the batch above
gives [[100 * qwen.moe_mfu * A.decode_batch_for_context(qwen.kv_token_capacity, 128 * 1024) / A.decode_batch_for_context(qwen.kv_token_capacity, qwen.context_len)|.2f]] %); Sarathi-Serve's 28.3x TBT inflation and +32 % for a 257-token chunk; the
MegaScale-Infer and FastAFD end-to-end gains (64A16F +11.3 %, 48A16F -5.3 %, 1.90x per
GPU); SGLang's TBO +27-35 %; Mooncake's best P:D of 1:1 on its own trace; and DeepSeek's
production throughput and cost. pdjax's serving simulator and cost model produce
comparable quantities for a workload you specify (see [howto.md](howto.md#simulate-a-deployment-and-sweep-pd)),
not these numbers."""


def namespace() -> dict:
    ns: dict = {"__name__": "reproductions"}
    exec(SETUP, ns)
    return ns


def evaluate(row: Row, ns: dict) -> tuple[float, bool]:
    value = eval(row.expression, ns)
    return value, row.article.holds(float(value), ns)


def fill(text: str, ns: dict) -> str:
    """``text`` with every ``[[expression|format]]`` replaced by the expression's value."""
    return re.sub(r"\[\[(.+?)\|(.*?)\]\]", lambda m: format(eval(m.group(1), ns), m.group(2)), text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    ns = namespace()
    out = ["# Reproductions", "",
           "Every figure of the source articles (technical write-ups of DeepSeek's deployment, PD and AF",
           "disaggregation and pipeline bubbles) that pdjax computes, next to pdjax's value and the",
           "expression that computes it. Generated by `docs/make_reproductions.py`; `tests/test_docs.py`",
           "fails when this page and the script's output differ, so the values cannot drift from the code.",
           "", "The expressions run after this set-up:", "", "```python", SETUP.rstrip("\n"), "```", "",
           "Columns: *article* is the figure as printed (a closed form is shown with the expression that",
           "evaluates it from the config); *pdjax* is the expression's value; *match* is ✓ when pdjax's",
           "value rounds to the printed figure (or equals the closed form), ✗ where the article rounds or",
           "truncates differently (the note says how).", ""]
    problems = []
    for title, rows in SECTIONS:
        out += [f"## {title}", "", "| figure | article | pdjax | match | expression | note |",
                "|---|---|---|---|---|---|"]
        for row in rows:
            value, ok = evaluate(row, ns)
            if ok != (row.expect == "same"):
                problems.append(f"{row.what}: pdjax gives {value!r}, article {row.article.label()} "
                                f"(expected {'a match' if row.expect == 'same' else 'a difference'})")
            shown = row.fmt.format(value) + (f" {row.unit}" if row.unit else "")
            out.append(f"| {_cell(row.what)} | {_cell(row.article.label())} | {shown} | "
                       f"{'✓' if ok else '✗'} | `{_cell(row.expression)}` | {_cell(fill(row.note, ns))} |")
        out.append("")
    if problems:
        raise AssertionError("reproductions changed:\n" + "\n".join(problems))
    out += ["## Not computed", "", fill(NOT_COMPUTED, ns), ""]
    return "\n".join(out)


def write_or_check(output: str, text: str, argv: list[str], script: str) -> int:
    """Write ``text`` to ``output``, or with ``--check`` in ``argv`` exit status 1 if the file
    differs from it (the generated pages' entry point; ``script`` names the generator)."""
    if "--check" in argv:
        with open(output) as f:
            stale = f.read() != text
        print(f"{os.path.relpath(output)} is {f'stale: run {script}' if stale else 'up to date'}")
        return int(stale)
    with open(output, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(output)}")
    return 0


def main(argv: list[str]) -> int:
    return write_or_check(OUTPUT, render(), argv, "docs/make_reproductions.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
