"""Embedding pooling over jagged bags (sum or mean), as for multi-valued side features:
the Triton kernels on CUDA, the pure-PyTorch twin elsewhere (backend "triton" or
"reference" picks one; "auto" by device). Differentiable in weight on both paths.

Bag b holds the ids indices[offsets[b]:offsets[b + 1]] (int64 rows of weight (N, D), any
row stride); an empty bag pools to zeros. With a dynamic table, weight is the rows of a
batch's unique ids and indices each id's place among them.
"""
import torch

from ..backend import use_triton
from ..jagged import check_offsets
from . import reference, triton_kernels
from .reference import MODES



class _Pool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, indices, offsets, mode):
        ctx.save_for_backward(indices, offsets)
        ctx.mode, ctx.num_rows, ctx.dtype = mode, weight.shape[0], weight.dtype
        return triton_kernels.pool(weight, indices, offsets, mode)

    @staticmethod
    def backward(ctx, grad):
        indices, offsets = ctx.saved_tensors
        weight_grad = triton_kernels.pool_backward(grad, indices, offsets, ctx.num_rows, ctx.mode)
        return weight_grad.to(ctx.dtype), None, None, None


def pool(weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, mode: str = "sum", backend: str = "auto") -> torch.Tensor:
    """(B, D): the sum (or mean) of weight's rows over each bag."""
    if mode not in MODES:
        raise ValueError(f"unknown pooling mode {mode!r}; choose from {MODES}")
    triton = use_triton(backend, weight.device, "pooling")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (rows, D), got shape {tuple(weight.shape)}")
    if indices.dim() != 1 or indices.dtype != torch.int64:
        raise ValueError(f"indices must be a 1-D int64 tensor, got {indices.dtype} {tuple(indices.shape)}")
    check_offsets(offsets)
    if triton:
        return _Pool.apply(weight, indices, offsets, mode)
    return reference.pool(weight, indices, offsets, mode)
