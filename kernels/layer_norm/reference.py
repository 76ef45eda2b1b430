"""Layer norm over the last dimension in plain PyTorch: the twin of triton_kernels.py.

Each row of x (rows, D) is centred on its mean, divided by the square root of its
(biased) variance plus eps, then scaled by weight and shifted by bias, in float32 (the
Triton kernels' arithmetic) and returned in x's dtype. Differentiable through torch's own
layer norm.
"""
import torch
import torch.nn.functional as F


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """(rows, D) normalized rows of x."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return F.layer_norm(x.to(wide), (x.shape[-1],), weight.to(wide), bias.to(wide), eps).to(x.dtype)
