"""Dropout(LayerNorm(x) ⊙ u) through the Triton kernels as torch.library custom ops, for
models compiled whole by torch.compile: one opaque op of the graph each way (the kernels
launch at run time, as in eager mode). norm_mul_dropout calls these while compiling; eager
calls keep the autograd Function in __init__.py, which costs the host less a call. The
forward op draws its seed and returns it, for the backward to make the same mask."""
import torch


@torch.library.custom_op("hstu::norm_mul_dropout", mutates_args=())
def norm_mul_dropout(
    x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the output in x's shape, each row's mean and reciprocal standard deviation, the
    seed): __init__.forward_rows."""
    from . import forward_rows  # (here: the package's __init__ imports this module)

    out, _, _, mean, rstd, seed = forward_rows(x, u, weight, bias, eps, p)
    return out.view(x.shape), mean, rstd, seed


@norm_mul_dropout.register_fake
def _norm_mul_dropout_fake(x, u, weight, bias, eps, p):
    rows = x.numel() // x.shape[-1]
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, u.dtype)), x.new_empty(rows, dtype=torch.float32),
            x.new_empty(rows, dtype=torch.float32), x.new_empty(1, dtype=torch.int64))


@torch.library.custom_op("hstu::norm_mul_dropout_backward", mutates_args=())
def norm_mul_dropout_backward(
    grad: torch.Tensor, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
    rstd: torch.Tensor, p: float, seed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, du in x's shape, the weight's and the bias's gradients as the rows of one (2, D)
    float32 tensor): __init__.backward_rows."""
    from . import backward_rows  # (here: the package's __init__ imports this module)

    dx, du, dw, db = backward_rows(grad, x, u, weight, bias, mean, rstd, p, seed)
    return dx.view(x.shape), du.view(x.shape), torch.stack([dw, db])


@norm_mul_dropout_backward.register_fake
def _norm_mul_dropout_backward_fake(grad, x, u, weight, bias, mean, rstd, p, seed):
    return x.new_empty(x.shape), u.new_empty(u.shape), weight.new_empty(2, weight.shape[0], dtype=torch.float32)


def _save(ctx, inputs, output) -> None:
    x, u, weight, bias, _, p = inputs
    _, mean, rstd, seed = output
    ctx.save_for_backward(x, u, weight, bias, mean, rstd, seed)
    ctx.p = p


def _backward(ctx, grad, *_unused):
    x, u, weight, bias, mean, rstd, seed = ctx.saved_tensors
    dx, du, sums = norm_mul_dropout_backward(grad.contiguous(), x, u, weight, bias, mean, rstd, ctx.p, seed)
    return dx, du, sums[0].to(weight.dtype), sums[1].to(bias.dtype), None, None


norm_mul_dropout.register_autograd(_backward, setup_context=_save)
