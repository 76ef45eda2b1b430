"""Softmax cross-entropy of queries against every row of a key matrix (a full-catalog
softmax loss), never holding the (P, M) logits: the Triton kernels on CUDA and the
pure-PyTorch twin elsewhere (backend "triton" or "reference" picks one; "auto" by device).
Differentiable in q and keys on both paths; reference.py states the computation.
"""
import torch

from ..backend import matmul_dtype, use_triton
from . import reference, triton_kernels

__all__ = ["softmax_cross_entropy"]


class _SoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keys, target):
        # under autocast the products run in its dtype, the softmax in float32 (as the twin)
        mm_dtype = matmul_dtype(q)
        q_mm, keys_mm = q.to(mm_dtype), keys.to(mm_dtype)
        loss, lse = triton_kernels.row_losses(q_mm, keys_mm, target)
        ctx.save_for_backward(q_mm, keys_mm, target, lse)
        ctx.dtypes = q.dtype, keys.dtype
        if not q.shape[0]:
            return q.new_tensor(float("nan"))
        return (loss.sum(dtype=torch.float64) / q.shape[0]).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q_mm, keys_mm, target, lse = ctx.saved_tensors
        scale = (grad.to(torch.float32) / max(q_mm.shape[0], 1)).reshape(1)
        dq, dkeys = triton_kernels.softmax_cross_entropy_backward(scale, q_mm, keys_mm, target, lse)
        return dq.to(ctx.dtypes[0]), dkeys.to(ctx.dtypes[1]), None


def softmax_cross_entropy(q: torch.Tensor, keys: torch.Tensor, target: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """() mean over the P rows of q (P, D) of −log softmax(q · keysᵀ)[target]; keys (M, D),
    target (P,) int64 in [0, M) (not checked: reading it would wait for the device). NaN
    for P = 0."""
    triton = use_triton(backend, q.device, "softmax cross-entropy")
    if q.dim() != 2 or keys.dim() != 2 or q.shape[1] != keys.shape[1]:
        raise ValueError(f"q and keys must be (P, D) and (M, D): got {tuple(q.shape)} and {tuple(keys.shape)}")
    if target.shape != q.shape[:1] or target.dtype != torch.int64:
        raise ValueError(f"target must be int64 (P,) = ({q.shape[0]},): got {target.dtype} {tuple(target.shape)}")
    if keys.shape[0] == 0 and q.shape[0]:
        raise ValueError("no keys to take the softmax over")
    if triton:
        return _SoftmaxCE.apply(q, keys, target)
    return reference.softmax_cross_entropy(q, keys, target)
