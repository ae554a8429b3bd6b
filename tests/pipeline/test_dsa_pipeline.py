"""DeepSeek-V3.2's sparse attention trains through the pipeline executor: loss and gradients
equal jax.value_and_grad(pdjax.loss) of the unsplit model.
The indexer's top-k is jax.lax.top_k (k up to 2,048), not pdjax.model.topk's k max passes."""

import jax
import numpy as np

import pdjax
from pdjax import pipeline as pp


def test_the_loss_and_its_gradients_are_the_unsplit_models():
    cfg = pdjax.configs.tiny_v32()
    params = pdjax.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 16), dtype=np.int32)   # 16 > 8 selected
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p, t: pdjax.loss(p, cfg, t)))(params, tokens)
    ex = pp.Executor(pp.build("1f1b", num_ranks=2, num_microbatches=4), cfg, devices=jax.devices()[:2], measure=False)
    loss, grads = ex.step(params, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, ref_grads)
    # the language-model loss reaches the indexer only through a discrete selection: its
    # gradient is zero (DeepSeek trains the indexer with a loss of its own)
    assert all(float(np.abs(np.asarray(g)).max()) == 0 for g in jax.tree.leaves(grads["layers"][1]["attn"]["indexer"]))
    assert float(np.abs(np.asarray(grads["layers"][1]["attn"]["wkv_a"])).max()) > 0
