"""Dropout(LayerNorm(x) ⊙ u) over the last dimension, HSTU's block output before its
projection: the Triton kernels on CUDA, the pure-PyTorch twin elsewhere (backend "triton"
or "reference" picks one; "auto" by device). Differentiable in x, u and the norm's weight
and bias on both paths.

Each call draws a seed from torch's generator on x's device (a device tensor: a CUDA
graph's replays draw their own), from which both paths make the same mask
(reference.py); the Triton backward makes it again instead of keeping it. Inside
torch.compile the Triton path is a pair of custom ops (graph_ops.py).
"""
import torch

from ..backend import use_triton
from . import graph_ops, reference, triton_kernels

SEED_BOUND = 1 << 62  # seeds are drawn uniformly below this


def new_seed(device: torch.device) -> torch.Tensor:
    """A one-element int64 seed drawn from torch's generator on device."""
    return torch.randint(SEED_BOUND, (1,), dtype=torch.int64, device=device)


def forward_rows(x, u, weight, bias, eps: float, p: float):
    """(output (rows, D), x and u as (rows, D) contiguous, each row's mean and reciprocal
    standard deviation, the seed): the Triton forward over x's and u's rows, with a seed
    drawn for it (an unread one without dropout)."""
    x, u = x.reshape(-1, x.shape[-1]).contiguous(), u.reshape(-1, x.shape[-1]).contiguous()
    seed = new_seed(x.device) if p > 0 else x.new_empty(1, dtype=torch.int64)  # (unread without dropout)
    out, mean, rstd = triton_kernels.norm_mul_dropout_forward(x, u, weight.contiguous(), bias.contiguous(), eps, p, seed)
    return out, x, u, mean, rstd, seed


def backward_rows(grad, x, u, weight, bias, mean, rstd, p: float, seed):
    """(dx, du (rows, D), d weight, d bias (float32)): the Triton backward of forward_rows,
    given its inputs x and u in any shape of D-wide rows."""
    x, u = x.reshape(-1, x.shape[-1]).contiguous(), u.reshape(-1, x.shape[-1]).contiguous()
    return triton_kernels.norm_mul_dropout_backward(
        grad.reshape(x.shape), x, u, weight.contiguous(), bias.contiguous(), mean, rstd, p, seed,
    )


class _NormMulDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, u, weight, bias, eps, p):
        out, x_rows, u_rows, mean, rstd, seed = forward_rows(x, u, weight, bias, eps, p)
        ctx.save_for_backward(x_rows, u_rows, weight, bias, mean, rstd, seed)
        ctx.shape, ctx.p = x.shape, p
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, u, weight, bias, mean, rstd, seed = ctx.saved_tensors
        dx, du, dw, db = backward_rows(grad, x, u, weight, bias, mean, rstd, ctx.p, seed)
        return dx.view(ctx.shape), du.view(ctx.shape), dw.to(weight.dtype), db.to(bias.dtype), None, None


def norm_mul_dropout(
    x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Dropout(LayerNorm(x) · u, p) for x and u of one shape (..., D): x normalized over
    its last dimension, scaled by weight (D,) and shifted by bias (D,), times u, then each
    element zeroed with probability p and the rest scaled by 1 / (1 - p) (p = 0: no
    dropout, as in evaluation). The result takes x's and u's promoted dtype."""
    triton = use_triton(backend, x.device, "norm_mul_dropout")
    if u.shape != x.shape or weight.shape != (x.shape[-1],) or bias.shape != weight.shape:
        raise ValueError(f"u must have x's shape {tuple(x.shape)} and weight and bias ({x.shape[-1]},): got "
                         f"{tuple(u.shape)}, {tuple(weight.shape)} and {tuple(bias.shape)}")
    reference.check_probability(p)
    if triton and torch.compiler.is_compiling():  # (one op of the compiled graph: graph_ops.py)
        return graph_ops.norm_mul_dropout(x, u, weight, bias, eps, p)[0]
    if triton:
        return _NormMulDropout.apply(x, u, weight, bias, eps, p)
    seed = int(new_seed(x.device)) if p > 0 else 0
    shape = x.shape
    return reference.norm_mul_dropout(x.reshape(-1, shape[-1]), u.reshape(-1, shape[-1]), weight, bias, eps, p, seed).view(shape)
