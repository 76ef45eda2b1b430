"""Layer norm over the last dimension as Triton kernels, with the signature of the twin
in reference.py, forward and backward.

PyTorch's CUDA layer norm takes a row per thread block at the narrow widths of the paper
presets (50: the rows are too short for its vectorized kernel), so its statistics kernel
runs one block per row over 25,600 rows (benchmarks/train_throughput.md). Here a program
takes ROW_TILE // width rows whole (the width padded to a power of two), in float32.

Forward: each row's mean and reciprocal standard deviation, kept for the backward, and
the normalized, scaled and shifted row. Backward: the input gradient row by row; the
weight's and bias's gradients summed over a program's rows (a program strides over the
row blocks), one partial row per program, summed after the kernel (no atomic adds: the
same inputs give the same sums). Warps are autotuned by width; Triton's interpreter (no
device) runs one configuration.
"""
import torch
import triton
import triton.language as tl

from ..autotune import TunedLaunches, autotuned

ROW_TILE = 4096  # elements a program holds at once: rows of ROW_TILE // width columns (at least one)
MAX_PARTIALS = 256  # programs of the backward, each writing one partial row of the weight's and bias's gradients
CONFIGS = [triton.Config({}, num_warps=w) for w in (1, 2, 4, 8)]
INTERPRETER_CONFIG = triton.Config({}, num_warps=1)


@triton.jit
def _tile(first_row, rows, dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """(the tile's rows, whether each is live, its columns, whether each is in the row,
    the element offsets and mask of the tile)."""
    r = tl.arange(0, BLOCK_R).to(tl.int64) + first_row
    c = tl.arange(0, BLOCK_D)
    live, in_row = r < rows, c < dim
    return r, live, c, in_row, r[:, None] * dim + c[None, :], live[:, None] & in_row[None, :]


@triton.jit
def _normalized_rows(x_ptr, weight_ptr, bias_ptr, rows, dim, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's tile of x's rows normalized, in float32: (its rows, whether each is
    live, the element offsets and mask (_tile), the rows scaled by weight and shifted by
    bias, each row's mean and reciprocal standard deviation)."""
    r, live, c, in_row, at, m = _tile(tl.program_id(0) * BLOCK_R, rows, dim, BLOCK_R, BLOCK_D)
    x = tl.load(x_ptr + at, mask=m, other=0).to(tl.float32)
    mean = tl.sum(x, axis=1) / dim
    centred = tl.where(m, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / dim + eps)
    w = tl.load(weight_ptr + c, mask=in_row, other=0).to(tl.float32)
    b = tl.load(bias_ptr + c, mask=in_row, other=0).to(tl.float32)
    return r, live, at, m, centred * rstd[:, None] * w[None, :] + b[None, :], mean, rstd


@triton.jit
def _renormalized_rows(x_ptr, mean_ptr, rstd_ptr, first, rows, dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows first .. first + BLOCK_R - 1 of x normalized again from their saved statistics,
    for a backward: (the rows, the element offsets and mask (_tile), (x - mean) · rstd in
    float32 (0 outside the tile), each row's rstd)."""
    r, live, c, in_row, at, m = _tile(first, rows, dim, BLOCK_R, BLOCK_D)
    x = tl.load(x_ptr + at, mask=m, other=0).to(tl.float32)
    mean = tl.load(mean_ptr + r, mask=live, other=0)
    rstd = tl.load(rstd_ptr + r, mask=live, other=0)
    return r, at, m, tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0), rstd


@triton.jit
def _input_grad(wg, xhat, rstd, dim):
    """The gradient of a tile's rows x from wg, the weight times their output's gradient
    (that of xhat = (x - mean) · rstd): rstd (wg - mean(wg) - xhat mean(wg xhat))."""
    return (wg - tl.sum(wg, axis=1)[:, None] / dim - xhat * (tl.sum(wg * xhat, axis=1)[:, None] / dim)) * rstd[:, None]


@triton.jit(do_not_specialize=["rows"])  # the row count changes with every batch
def _layer_norm_forward_kernel(
    x_ptr, weight_ptr, bias_ptr, y_ptr, mean_ptr, rstd_ptr, rows, dim, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r, live, at, m, y, mean, rstd = _normalized_rows(x_ptr, weight_ptr, bias_ptr, rows, dim, eps, BLOCK_R, BLOCK_D)
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(mean_ptr + r, mean, mask=live)
    tl.store(rstd_ptr + r, rstd, mask=live)


@triton.jit(do_not_specialize=["rows"])
def _layer_norm_backward_kernel(
    grad_ptr, x_ptr, weight_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, rows, dim,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    program, programs = tl.program_id(0), tl.num_programs(0)
    c = tl.arange(0, BLOCK_D)
    w = tl.load(weight_ptr + c, mask=c < dim, other=0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(program * BLOCK_R, rows, programs * BLOCK_R):
        _, at, m, xhat, rstd = _renormalized_rows(x_ptr, mean_ptr, rstd_ptr, first, rows, dim, BLOCK_R, BLOCK_D)
        g = tl.load(grad_ptr + at, mask=m, other=0).to(tl.float32)
        tl.store(dx_ptr + at, _input_grad(g * w[None, :], xhat, rstd, dim).to(dx_ptr.dtype.element_ty), mask=m)
        dw += tl.sum(g * xhat, axis=0)
        db += tl.sum(g, axis=0)
    tl.store(dw_ptr + program * dim + c, dw, mask=c < dim)
    tl.store(db_ptr + program * dim + c, db, mask=c < dim)


_forward = TunedLaunches(autotuned(_layer_norm_forward_kernel, CONFIGS, INTERPRETER_CONFIG, key=["dim"]))
_backward = TunedLaunches(autotuned(_layer_norm_backward_kernel, CONFIGS, INTERPRETER_CONFIG, key=["dim"]))


def _blocks(dim: int) -> tuple[int, int]:
    """(rows a program holds, the width padded to a power of two)."""
    block_d = triton.next_power_of_2(max(dim, 1))
    return max(1, ROW_TILE // block_d), block_d


def backward_partials(
    rows: int, dim: int, block_r: int, device: torch.device, most_programs: int = MAX_PARTIALS,
) -> tuple[int, torch.Tensor]:
    """(the backward's programs, at most most_programs, each over blocks of block_r rows;
    (2, programs, dim) float32 for the weight's and bias's partial sums, one row a program,
    zeros where there are no rows to write them)."""
    programs = max(1, min(triton.cdiv(rows, block_r), most_programs))
    return programs, (torch.empty if rows else torch.zeros)((2, programs, dim), dtype=torch.float32, device=device)


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
    """(y in x's dtype, each row's mean, each row's reciprocal standard deviation (float32))
    for x (rows, D) contiguous."""
    rows, dim = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if rows and dim:
        block_r, block_d = _blocks(dim)
        _forward(lambda meta: (triton.cdiv(rows, block_r),), (x, weight, bias, y, mean, rstd, rows, dim, eps),
                 dict(BLOCK_R=block_r, BLOCK_D=block_d))
    return y, mean, rstd


def layer_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor):
    """(the gradient of x in x's dtype, of weight and of bias (float32)) from that of y."""
    rows, dim = x.shape
    dx = torch.empty_like(x)
    block_r, block_d = _blocks(dim)
    programs, partial = backward_partials(rows, dim, block_r, x.device)
    if rows and dim:
        _backward(lambda meta: (programs,), (grad.contiguous(), x, weight, mean, rstd, dx, partial[0], partial[1], rows, dim),
                  dict(BLOCK_R=block_r, BLOCK_D=block_d))
    sums = partial.sum(1)
    return dx, sums[0], sums[1]
