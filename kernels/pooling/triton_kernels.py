"""Embedding pooling over jagged bags as Triton kernels, with the signature of the twin in
reference.py, forward and backward.

Forward: one program per bag and block of columns gathers the bag's rows BLOCK_N at a
time and sums them in float32. Backward: the same programs add the bag's output gradient
(divided by the bag's length for the mean) to the rows of each of its ids, by atomic adds
into a float32 gradient (ids repeat across bags). The block shapes are autotuned on the
device by width; Triton's interpreter (no device) runs one configuration.
"""
import torch
import triton
import triton.language as tl

from ..autotune import autotuned

MEAN_MODE = {"sum": False, "mean": True}
# (ids per step, columns per program, warps): few ids per step suit short bags, wide
# column blocks suit wide rows
CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_D": d}, num_warps=w)
    for n, d, w in ((8, 64, 2), (16, 64, 2), (16, 128, 4), (32, 128, 4), (8, 128, 2), (16, 256, 4), (32, 64, 4))
]
INTERPRETER_CONFIG = triton.Config({"BLOCK_N": 8, "BLOCK_D": 32}, num_warps=1)


@triton.jit
def _program_bag(offsets_ptr, dim, BLOCK_D: tl.constexpr):
    """(this program's bag, its block of columns, which of them are in the row, the bag's
    first id and its end)."""
    bag = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    return bag, cols, cols < dim, tl.load(offsets_ptr + bag), tl.load(offsets_ptr + bag + 1)


@triton.jit
def _bag_rows(weight_ptr, weight_stride, indices_ptr, i, end, cols, dim, BLOCK_N: tl.constexpr):
    """(the ids i .. i + BLOCK_N - 1 of a bag ending at end, whether each is live, the
    pointers to their columns cols of weight)."""
    n = i + tl.arange(0, BLOCK_N)
    live = n < end
    ids = tl.load(indices_ptr + n, mask=live, other=0)
    return live, weight_ptr + ids[:, None] * weight_stride + cols[None, :]


@triton.jit
def _pool_kernel(
    weight_ptr, weight_stride, indices_ptr, offsets_ptr, out_ptr, dim,
    MEAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bag, cols, in_row, start, end = _program_bag(offsets_ptr, dim, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(start, end, BLOCK_N):
        live, rows = _bag_rows(weight_ptr, weight_stride, indices_ptr, i, end, cols, dim, BLOCK_N)
        acc += tl.sum(tl.load(rows, mask=live[:, None] & in_row[None, :], other=0).to(tl.float32), axis=0)
    if MEAN:
        acc = acc / tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + bag * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _pool_backward_kernel(
    grad_ptr, indices_ptr, offsets_ptr, weight_grad_ptr, dim,
    MEAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bag, cols, in_row, start, end = _program_bag(offsets_ptr, dim, BLOCK_D)
    g = tl.load(grad_ptr + bag * dim + cols, mask=in_row, other=0).to(tl.float32)
    if MEAN:
        g = g / tl.maximum(end - start, 1).to(tl.float32)
    for i in range(start, end, BLOCK_N):
        live, rows = _bag_rows(weight_grad_ptr, dim, indices_ptr, i, end, cols, dim, BLOCK_N)
        m = live[:, None] & in_row[None, :]
        tl.atomic_add(rows, tl.broadcast_to(g[None, :], (BLOCK_N, BLOCK_D)), mask=m, sem="relaxed")


_pool = autotuned(_pool_kernel, CONFIGS, INTERPRETER_CONFIG, key=["dim"])
# (the backward adds into its output: zeroed before each trial)
_pool_backward = autotuned(_pool_backward_kernel, CONFIGS, INTERPRETER_CONFIG, key=["dim"], reset_to_zero=["weight_grad_ptr"])


def _grid(bags: int, dim: int):
    return lambda meta: (bags, triton.cdiv(dim, meta["BLOCK_D"]))


def pool(weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, mode: str = "sum") -> torch.Tensor:
    bags, dim = offsets.numel() - 1, weight.shape[1]
    out = weight.new_empty((bags, dim))
    if out.numel():
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        _pool[_grid(bags, dim)](weight, weight.stride(0), indices.contiguous(), offsets.contiguous(), out, dim, MEAN=MEAN_MODE[mode])
    return out


def pool_backward(grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, num_rows: int, mode: str = "sum") -> torch.Tensor:
    """(num_rows, D) float32 gradient of pool's weight, given the gradient of its output."""
    bags, dim = grad.shape
    weight_grad = torch.zeros((num_rows, dim), dtype=torch.float32, device=grad.device)
    if bags and dim and indices.numel():
        _pool_backward[_grid(bags, dim)](grad.contiguous(), indices.contiguous(), offsets.contiguous(), weight_grad, dim, MEAN=MEAN_MODE[mode])
    return weight_grad
