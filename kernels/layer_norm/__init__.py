"""Layer norm over the last dimension: the Triton kernels on CUDA, the pure-PyTorch twin
elsewhere (backend "triton" or "reference" picks one; "auto" by device). Differentiable
in x, weight and bias on both paths.

Under autocast it runs in float32 and returns float32, as autocast runs torch's layer
norm. Inside torch.compile it is torch's own (Inductor fuses it with its neighbours).
"""
import torch
import torch.nn.functional as F

from ..backend import use_triton
from . import reference, triton_kernels


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, x, weight, bias, eps):
        shape = x.shape
        x = x.reshape(-1, shape[-1]).contiguous()
        y, mean, rstd = triton_kernels.layer_norm_forward(x, weight.contiguous(), bias.contiguous(), eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = triton_kernels.layer_norm_backward(grad.reshape(x.shape), x, weight.contiguous(), mean, rstd)
        return dx.view(ctx.shape), dw.to(weight.dtype), db.to(weight.dtype), None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, backend: str = "auto") -> torch.Tensor:
    """x (..., D) normalized over its last dimension, scaled by weight (D,) and shifted by
    bias (D,)."""
    triton = use_triton(backend, x.device, "layer norm")
    if weight.shape != (x.shape[-1],) or bias.shape != weight.shape:
        raise ValueError(f"weight and bias must be ({x.shape[-1]},) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)} and {tuple(bias.shape)}")
    if torch.compiler.is_compiling():
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if triton:
        return _LayerNorm.apply(x, weight, bias, eps)
    return reference.layer_norm(x.reshape(-1, x.shape[-1]), weight, bias, eps).view(x.shape)
