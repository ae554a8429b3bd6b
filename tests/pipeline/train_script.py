"""What tests/pipeline/test_spanning.py launches to train across processes:
``python train_script.py STEPS CHECKPOINT_DIR OUT`` in each process of a launch, and the
same calls in one process (:func:`run`). Process 0 saves the run's losses to OUT."""

import sys

import jax
import numpy as np

import pdjax
import pdjax.pipeline as pp

RANKS, MICROBATCHES, ROWS, T, TOTAL = 4, 4, 1, 8, 4


def run(steps: int, checkpoint_dir: str, devices):
    cfg = pdjax.configs.tiny(num_hidden_layers=4, first_k_dense_replace=2)
    data = np.random.default_rng(1).integers(0, cfg.vocab_size, (TOTAL, MICROBATCHES * ROWS, T), dtype=np.int32)
    schedule = pp.build("zb1p", RANKS, MICROBATCHES)
    return pp.train(schedule, cfg, data, steps=steps, devices=devices, checkpoint_dir=checkpoint_dir)


if __name__ == "__main__":
    pdjax.cluster.initialize()
    state = run(int(sys.argv[1]), sys.argv[2], jax.devices())
    if jax.process_index() == 0:
        np.save(sys.argv[3], np.array(state.losses))
    print("done", flush=True)
