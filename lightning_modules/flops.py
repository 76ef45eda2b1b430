"""The matrix-product FLOPs of HSTU training: per sequence, what the data loader balances
the ranks' shares of a batch by (balanced_sampler.py), and per step, what the benchmarks
divide by their time (TFLOP/s, MFU).

Layer norms, activations and the embedding table are left out. A sequence of n rows the
model reads, width D, H heads of dqk / dv, `blocks` blocks and N negatives (the catalog for
the full softmax) costs:

    projections = blocks · (2·n·D·H·(2·dqk + 2·dv) + 2·n·H·dv·D)
    attention   = blocks · H · n² · (dqk + dv)          the causal half of QKᵀ and AV
    loss        = 2·n·N·D                                the loss's logits
    training    = 3 · (projections + loss) + 3.5 · attention     forward + backward
"""
from collections.abc import Callable
from functools import partial

import numpy as np

from .config import HSTUConfig


def sequence_flops(config: HSTUConfig, input_lengths: np.ndarray, negatives: int) -> np.ndarray:
    """(B,) float64: the training FLOPs of each sequence, from the rows the model reads."""
    c = config
    n = np.asarray(input_lengths, dtype=np.float64)
    projections = c.num_blocks * n * c.embedding_dim * c.num_heads * (2 * (2 * c.attention_dim + 2 * c.linear_dim) + 2 * c.linear_dim)
    attention = c.num_blocks * c.num_heads * n**2 * (c.attention_dim + c.linear_dim)
    loss = 2 * n * negatives * c.embedding_dim
    return 3 * (projections + loss) + 3.5 * attention


def step_flops(config: HSTUConfig, input_lengths: np.ndarray, negatives: int) -> float:
    """The training FLOPs of one step's sequences."""
    return float(sequence_flops(config, input_lengths, negatives).sum())


def step_negatives(config: HSTUConfig, catalog_size: int) -> int:
    """The negatives a step scores: num_negatives, or the whole catalog where it is smaller
    (the full softmax)."""
    return min(config.num_negatives, catalog_size)


def sequence_cost(config: HSTUConfig, catalog_size: int) -> Callable[[np.ndarray], np.ndarray]:
    """input lengths → sequence_flops with a step's negatives: what the data loader
    balances the ranks by."""
    return partial(sequence_flops, config, negatives=step_negatives(config, catalog_size))
