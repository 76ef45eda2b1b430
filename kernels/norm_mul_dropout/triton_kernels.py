"""Dropout(LayerNorm(x) ⊙ u) over the last dimension as Triton kernels, with the signature
of the twin in reference.py (which states the mask), forward and backward: HSTU's block
output before its projection, one pass over memory each way.

Forward: each row's mean and reciprocal standard deviation, kept for the backward, and the
dropped-out product. Neither the mask nor the normalized rows are kept: the backward makes
the mask again from the seed (Philox through tl.randint4x, one call per four columns) and
the normalized rows from x. Backward: x's and u's gradients row by row; the weight's and
bias's summed over a program's rows (a program strides over the row blocks), one partial
row per program, summed after the kernel. On rows of at least SMALL_TILE_WIDTH the
backward's programs hold BACKWARD_ROW_TILE elements, a quarter of the forward's, and
there are BACKWARD_PROGRAMS_PER_SM of them a multiprocessor: its tile keeps three inputs,
two outputs and the mask's words live, so the forward's larger tile left too few programs
a multiprocessor, and too few loads in flight, for a pass that only moves memory.
Narrower rows, whose passes are short, kept the forward's tile, warps and the layer
norm's MAX_PARTIALS programs faster (benchmarks/train_throughput.md, "norm_mul_dropout's
backward on smaller tiles"). Warps are autotuned by width; Triton's interpreter runs one
configuration.
"""
import torch
import triton
import triton.language as tl

from ..autotune import TunedLaunches, autotuned
from ..launch import multiprocessors
from ..layer_norm.triton_kernels import MAX_PARTIALS, ROW_TILE, _input_grad, _normalized_rows, _renormalized_rows, backward_partials

CONFIGS = [triton.Config({}, num_warps=w) for w in (4, 8, 16)]  # (2 warps spill at the forward's tiles)
BACKWARD_ROW_TILE = 1024  # elements a backward program holds at once: rows of BACKWARD_ROW_TILE // width columns
SMALL_TILE_WIDTH = 512  # the least (padded) width whose backward takes BACKWARD_ROW_TILE
SMALL_TILE_CONFIGS = [triton.Config({}, num_warps=w) for w in (1, 2, 4, 8, 16)]
SMALL_TILE_INTERPRETER_CONFIG = triton.Config({}, num_warps=2)  # (also the GPU tests' one)
BACKWARD_PROGRAMS_PER_SM = 8  # backward programs a multiprocessor, each writing one partial row of the sums
WORDS = 4  # the words of one tl.randint4x call: the mask's columns per counter
_WORDS = tl.constexpr(WORDS)  # (a kernel reads module constants as constexpr only)
WORD_VALUES = 1 << 32  # a Philox word is an unsigned 32-bit integer
INTERPRETER_CONFIG = triton.Config({}, num_warps=8)  # (also the GPU tests' one: it does not spill)


@triton.jit
def _kept(seed_ptr, r, dim, threshold, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """(BLOCK_R, BLOCK_D) bool: which elements of rows r the dropout keeps (reference.kept):
    the four words of one Philox call at counter r · ⌈dim / 4⌉ + column // 4 interleaved
    into four consecutive columns."""
    groups = tl.arange(0, BLOCK_D // _WORDS)
    counter = r[:, None] * tl.cdiv(dim, _WORDS) + groups[None, :]
    w0, w1, w2, w3 = tl.randint4x(tl.load(seed_ptr), counter)
    # join(join(w0, w2), join(w1, w3)) is (..., 2, 2) with [a, b] = word 2a + b: in row-major
    # order, words 0, 1, 2, 3 of each counter
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_R, BLOCK_D))
    return words.to(tl.int64) >= threshold


@triton.jit(do_not_specialize=["rows", "threshold"])  # the row count changes with every batch
def _norm_mul_dropout_forward_kernel(
    x_ptr, u_ptr, weight_ptr, bias_ptr, seed_ptr, out_ptr, mean_ptr, rstd_ptr, rows, dim, eps, threshold, scale,
    DROPOUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r, live, at, m, y, mean, rstd = _normalized_rows(x_ptr, weight_ptr, bias_ptr, rows, dim, eps, BLOCK_R, BLOCK_D)
    z = y * tl.load(u_ptr + at, mask=m, other=0).to(tl.float32)
    if DROPOUT:
        z = tl.where(_kept(seed_ptr, r, dim, threshold, BLOCK_R, BLOCK_D), z * scale, 0.0)
    tl.store(out_ptr + at, z.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(mean_ptr + r, mean, mask=live)
    tl.store(rstd_ptr + r, rstd, mask=live)


@triton.jit(do_not_specialize=["rows", "threshold"])
def _norm_mul_dropout_backward_kernel(
    grad_ptr, x_ptr, u_ptr, weight_ptr, bias_ptr, seed_ptr, mean_ptr, rstd_ptr, dx_ptr, du_ptr, dw_ptr, db_ptr, rows, dim,
    threshold, scale, DROPOUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    program, programs = tl.program_id(0), tl.num_programs(0)
    c = tl.arange(0, BLOCK_D)
    w = tl.load(weight_ptr + c, mask=c < dim, other=0).to(tl.float32)
    b = tl.load(bias_ptr + c, mask=c < dim, other=0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(program * BLOCK_R, rows, programs * BLOCK_R):
        r, at, m, xhat, rstd = _renormalized_rows(x_ptr, mean_ptr, rstd_ptr, first, rows, dim, BLOCK_R, BLOCK_D)
        g = tl.load(grad_ptr + at, mask=m, other=0).to(tl.float32)
        if DROPOUT:
            g = tl.where(_kept(seed_ptr, r, dim, threshold, BLOCK_R, BLOCK_D), g * scale, 0.0)
        u = tl.load(u_ptr + at, mask=m, other=0).to(tl.float32)
        tl.store(du_ptr + at, (g * (xhat * w[None, :] + b[None, :])).to(du_ptr.dtype.element_ty), mask=m)
        gy = g * u  # the gradient at the layer norm's output
        tl.store(dx_ptr + at, _input_grad(gy * w[None, :], xhat, rstd, dim).to(dx_ptr.dtype.element_ty), mask=m)
        dw += tl.sum(gy * xhat, axis=0)
        db += tl.sum(gy, axis=0)
    tl.store(dw_ptr + program * dim + c, dw, mask=c < dim)
    tl.store(db_ptr + program * dim + c, db, mask=c < dim)


TUNING_KEY = ["dim", "DROPOUT"]
_forward = TunedLaunches(autotuned(_norm_mul_dropout_forward_kernel, CONFIGS, INTERPRETER_CONFIG, key=TUNING_KEY))
_backward = TunedLaunches(autotuned(_norm_mul_dropout_backward_kernel, CONFIGS, INTERPRETER_CONFIG, key=TUNING_KEY))
_backward_small_tiles = TunedLaunches(
    autotuned(_norm_mul_dropout_backward_kernel, SMALL_TILE_CONFIGS, SMALL_TILE_INTERPRETER_CONFIG, key=TUNING_KEY),
)


def keep_threshold(p: float) -> int:
    """The least Philox word that keeps an element: p of the WORD_VALUES words drop it."""
    return round(p * WORD_VALUES)


def keep_scale(p: float) -> float:
    """1 / (1 - p), what a kept element is multiplied by (0 where nothing is kept)."""
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def _blocks(dim: int, tile: int = ROW_TILE) -> tuple[int, int]:
    """(rows a program holds at `tile` elements, the width padded to a power of two of at
    least WORDS)."""
    block_d = max(WORDS, triton.next_power_of_2(max(dim, 1)))
    return max(1, tile // block_d), block_d


def norm_mul_dropout_forward(
    x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, p: float, seed: torch.Tensor,
):
    """(the output in x's and u's promoted dtype, each row's mean, each row's reciprocal
    standard deviation (float32)) for x, u (rows, D) contiguous; seed: a one-element int64
    tensor on the device (read by the kernel: a CUDA graph's replays each read their own)."""
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=torch.promote_types(x.dtype, u.dtype), device=x.device)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if rows and dim:
        block_r, block_d = _blocks(dim)
        _forward(
            lambda meta: (triton.cdiv(rows, block_r),),
            (x, u, weight, bias, seed, out, mean, rstd, rows, dim, eps, keep_threshold(p), keep_scale(p)),
            dict(DROPOUT=p > 0, BLOCK_R=block_r, BLOCK_D=block_d),
        )
    return out, mean, rstd


def norm_mul_dropout_backward(
    grad: torch.Tensor, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
    rstd: torch.Tensor, p: float, seed: torch.Tensor,
):
    """(the gradients of x and u in their dtypes, of weight and of bias (float32)) from the
    output's, under the forward's seed."""
    rows, dim = x.shape
    dx, du = torch.empty_like(x), torch.empty_like(u)
    block_r, block_d = _blocks(dim)
    launches, most_programs = _backward, MAX_PARTIALS
    if block_d >= SMALL_TILE_WIDTH:
        block_r, block_d = _blocks(dim, BACKWARD_ROW_TILE)
        launches, most_programs = _backward_small_tiles, BACKWARD_PROGRAMS_PER_SM * multiprocessors(x.device)
    programs, partial = backward_partials(rows, dim, block_r, x.device, most_programs)
    if rows and dim:
        launches(
            lambda meta: (programs,),
            (grad.contiguous(), x, u, weight, bias, seed, mean, rstd, dx, du, partial[0], partial[1], rows, dim,
             keep_threshold(p), keep_scale(p)),
            dict(DROPOUT=p > 0, BLOCK_R=block_r, BLOCK_D=block_d),
        )
    sums = partial.sum(1)
    return dx, du, sums[0], sums[1]
