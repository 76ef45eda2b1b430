"""Embedding pooling over jagged bags in plain PyTorch: the twin of triton_kernels.py.

Bag b holds the ids indices[offsets[b]:offsets[b + 1]], each a row of `weight` (N, D);
its output is the sum of those rows, or their mean (an empty bag gives zeros), summed in
float32 (or float64) and returned in weight's dtype. Differentiable in weight through torch's indexing.
"""
import torch

MODES = ("sum", "mean")


def pool(weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, mode: str = "sum") -> torch.Tensor:
    """(B, D) pooled rows of weight over the bags given by offsets."""
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=weight.device), lengths, output_size=indices.numel())
    rows = weight[indices].to(torch.promote_types(weight.dtype, torch.float32))  # float32 at least
    pooled = rows.new_zeros((lengths.numel(), weight.shape[1])).index_add(0, bag, rows)
    if mode == "mean":
        pooled = pooled / lengths.clamp(min=1).unsqueeze(1)
    return pooled.to(weight.dtype)
