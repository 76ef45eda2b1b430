"""Softmax cross-entropy over negatives shared by every row (a sampled softmax loss): each
row's softmax runs over its own positive and the negatives whose id is not its own.

The (P, N) logits come from one matrix product in the autocast dtype; one pass over them
(softmax_rows: the Triton kernel on CUDA, the pure-PyTorch twin elsewhere; backend
"triton" or "reference" picks one, "auto" by device) turns them into the losses and, in
place, their gradient, which the backward multiplies by the upstream gradient through two
more products. Differentiable in q, keys and the positives' logits on both paths.
"""
import torch
import torch.nn.functional as F

from ..backend import matmul_dtype, use_triton
from . import reference, triton_kernels

__all__ = ["sampled_softmax_cross_entropy"]


class _SampledSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keys, positive, key_ids, row_ids, softmax_rows, real_rows):
        mm_dtype = matmul_dtype(q)
        with torch.autocast(q.device.type, enabled=False):
            q_mm, keys_mm = q.to(mm_dtype), keys.to(mm_dtype)
            grad_logits = q_mm @ keys_mm.T  # the logits, then (softmax_rows) the summed losses' gradient by them
            # (the padding rows' logits become a zero gradient, and their positives' too)
            loss, grad_positive = softmax_rows(grad_logits[:real_rows], positive[:real_rows], key_ids, row_ids[:real_rows])
            grad_logits[real_rows:].zero_()
            grad_positive = F.pad(grad_positive, (0, q.shape[0] - real_rows))
        ctx.save_for_backward(grad_logits, q_mm, keys_mm, grad_positive)
        ctx.dtypes = q.dtype, keys.dtype, positive.dtype
        ctx.real_rows = real_rows
        dtype = torch.promote_types(q.dtype, torch.float32)
        if not real_rows:
            return q.new_tensor(float("nan"), dtype=dtype)
        return (loss.sum(dtype=torch.float64) / real_rows).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        grad_logits, q_mm, keys_mm, grad_positive = ctx.saved_tensors
        scale = grad.to(grad_positive.dtype) / max(ctx.real_rows, 1)
        want_q, want_keys, want_positive = ctx.needs_input_grad[:3]
        with torch.autocast(q_mm.device.type, enabled=False):
            dq = ((grad_logits @ keys_mm).to(scale.dtype) * scale).to(ctx.dtypes[0]) if want_q else None
            dkeys = ((grad_logits.T @ q_mm).to(scale.dtype) * scale).to(ctx.dtypes[1]) if want_keys else None
        dpositive = (grad_positive * scale).to(ctx.dtypes[2]) if want_positive else None
        return dq, dkeys, dpositive, None, None, None, None


def sampled_softmax_cross_entropy(
    q: torch.Tensor, keys: torch.Tensor, positive: torch.Tensor, key_ids: torch.Tensor, row_ids: torch.Tensor,
    backend: str = "auto", real_rows: int | None = None,
) -> torch.Tensor:
    """() float32 (float64 for float64 q): the mean over the P rows of q (P, D) of
    −log softmax([positive_p, q_p · keys_mᵀ for the m with key_ids[m] != row_ids[p]])[0];
    keys (N, D), positive (P,) each row's positive logit, key_ids (N,) and row_ids (P,)
    int64. NaN for P = 0. real_rows: only q's first real_rows rows are counted, the rest
    are padding (a batch padded to a row count the matrix products have seen before), whose
    rows take no part in the loss and get zero gradients."""
    triton = use_triton(backend, q.device, "sampled softmax")
    if q.dim() != 2 or keys.dim() != 2 or q.shape[1] != keys.shape[1]:
        raise ValueError(f"q and keys must be (P, D) and (N, D): got {tuple(q.shape)} and {tuple(keys.shape)}")
    if positive.shape != q.shape[:1]:
        raise ValueError(f"positive must be (P,) = ({q.shape[0]},): got {tuple(positive.shape)}")
    for name, ids, size in (("key_ids", key_ids, keys.shape[0]), ("row_ids", row_ids, q.shape[0])):
        if ids.shape != (size,) or ids.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 ({size},): got {ids.dtype} {tuple(ids.shape)}")
    real_rows = q.shape[0] if real_rows is None else real_rows
    if not 0 <= real_rows <= q.shape[0]:
        raise ValueError(f"real_rows must be between 0 and the {q.shape[0]} rows of q: got {real_rows}")
    rows = triton_kernels.softmax_rows if triton else reference.softmax_rows
    return _SampledSoftmaxCE.apply(q, keys, positive, key_ids, row_ids, rows, real_rows)
