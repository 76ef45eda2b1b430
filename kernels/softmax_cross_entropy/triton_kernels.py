"""Softmax cross-entropy against every key row as Triton kernels: the twin in reference.py
states the computation.

Forward: a program per block of BLOCK_P rows steps through the keys BLOCK_M at a time. It
computes the block's logits with float32 accumulation, keeps each row's running maximum
and sum of exponentials (an online softmax) and picks out the target's logit, then writes
each row's log-sum-exp and loss. The logits never leave the chip.

Backward: two kernels recompute the logits from q, keys and the saved log-sum-exp. One, a
program per block of rows, sums (softmax − one-hot) · keys into dQ; the other, a program
per block of keys and slice of the rows (grid axis 2: a catalog of a few thousand keys is
a few dozen blocks, too few for the device), sums (softmax − one-hot)ᵀ · q over its slice
and adds it into dKeys atomically. Both scale by the upstream gradient over P, read from
the device. Rows wider than MAX_BLOCK_D are split into column
chunks: the logits sum over the chunks, and each backward program writes one chunk of its
output (grid axis 1), recomputing the logits per chunk.
"""
import math

import torch
import triton
import triton.language as tl

from ..autotune import TunedLaunches, autotuned
from ..launch import cdiv, multiprocessors, next_power_of_2

MAX_BLOCK_D = 128  # columns per chunk of a row
MIN_BLOCK_D = 16  # tl.dot's least inner size: narrower rows are padded with masked columns
_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x · log2(e))
# (rows per program, keys per step, warps, stages); the backward over keys swaps the roles
CONFIGS = [
    triton.Config({"BLOCK_P": p, "BLOCK_M": m}, num_warps=w, num_stages=s)
    for p, m, w, s in ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 32, 4, 4))
]
INTERPRETER_CONFIG = triton.Config({"BLOCK_P": 32, "BLOCK_M": 16}, num_warps=4, num_stages=1)
TUNING_KEY = ["D", "keys_class"]  # keys_class: the number of keys' power of two
KEYS_PROGRAMS = 4  # per multiprocessor: the backward over keys splits the rows until it has this many programs


@triton.jit
def _chunk(ptr, idx, live, c, D, BLOCK_D: tl.constexpr):
    """Columns c · BLOCK_D .. (c + 1) · BLOCK_D - 1 of rows idx of a row-major (N, D)
    matrix; zeros for rows not live and columns past D."""
    cols = c * BLOCK_D + tl.arange(0, BLOCK_D)
    return tl.load(ptr + idx.to(tl.int64)[:, None] * D + cols[None, :], mask=live[:, None] & (cols[None, :] < D), other=0.0)


@triton.jit
def _row_block(target_ptr, lse_ptr, first, P, BLOCK_P: tl.constexpr):
    """(rows first .. first + BLOCK_P - 1, which are below P, their targets and saved
    log-sum-exps) for a backward kernel."""
    rows = first + tl.arange(0, BLOCK_P)
    row_live = rows < P
    target = tl.load(target_ptr + rows, mask=row_live, other=-1)
    return rows, row_live, target, tl.load(lse_ptr + rows, mask=row_live, other=0.0)


@triton.jit
def _dot(a, b):
    """a · b with float32 accumulation (float32 inputs: full precision, as the twin)."""
    return tl.dot(a, b, input_precision="ieee" if a.dtype == tl.float32 else "tf32")


@triton.jit
def _products(a_first, a_ptr, a_idx, a_live, b_ptr, b_idx, b_live, D, D_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(float32 a · bᵀ of rows a_idx of a and b_idx of b over their D columns, b's first
    chunk); a_first: a's first chunk, loaded once by the caller."""
    b_first = _chunk(b_ptr, b_idx, b_live, 0, D, BLOCK_D)
    s = _dot(a_first, tl.trans(b_first))
    for c in tl.static_range(1, D_CHUNKS):
        s += _dot(_chunk(a_ptr, a_idx, a_live, c, D, BLOCK_D), tl.trans(_chunk(b_ptr, b_idx, b_live, c, D, BLOCK_D)))
    return s, b_first


# P varies from call to call: not specialized (a compilation for P % 16 == 0 mid-training)
@triton.jit(do_not_specialize=["P"])
def _softmax_cross_entropy_forward_kernel(
    q_ptr, keys_ptr, target_ptr, lse_ptr, loss_ptr, P, M, D, keys_class,
    D_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    row_live = rows < P
    target = tl.load(target_ptr + rows, mask=row_live, other=-1)
    q_first = _chunk(q_ptr, rows, row_live, 0, D, BLOCK_D)
    top = tl.full([BLOCK_P], -float("inf"), tl.float32)  # running maximum
    norm = tl.zeros([BLOCK_P], tl.float32)  # running sum of exp(logit - top)
    hit = tl.zeros([BLOCK_P], tl.float32)  # the target's logit
    for m0 in range(0, M, BLOCK_M):
        cols = m0 + tl.arange(0, BLOCK_M)
        col_live = cols < M
        s, _ = _products(q_first, q_ptr, rows, row_live, keys_ptr, cols, col_live, D, D_CHUNKS, BLOCK_D)
        hit += tl.sum(tl.where(cols[None, :] == target[:, None], s, 0.0), 1)
        s = tl.where(col_live[None, :], s, -float("inf"))
        new_top = tl.maximum(top, tl.max(s, 1))
        norm = norm * tl.exp2((top - new_top) * _LOG2E) + tl.sum(tl.exp2((s - new_top[:, None]) * _LOG2E), 1)
        top = new_top
    lse = top + tl.log(norm)
    tl.store(lse_ptr + rows, lse, mask=row_live)
    tl.store(loss_ptr + rows, lse - hit, mask=row_live)


@triton.jit(do_not_specialize=["P"])
def _softmax_cross_entropy_backward_q_kernel(
    q_ptr, keys_ptr, target_ptr, lse_ptr, scale_ptr, dq_ptr, P, M, D, keys_class,
    D_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
):
    rows, row_live, target, lse = _row_block(target_ptr, lse_ptr, tl.program_id(0) * BLOCK_P, P, BLOCK_P)
    chunk = tl.program_id(1)
    q_first = _chunk(q_ptr, rows, row_live, 0, D, BLOCK_D)
    acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    for m0 in range(0, M, BLOCK_M):
        cols = m0 + tl.arange(0, BLOCK_M)
        col_live = cols < M
        s, k = _products(q_first, q_ptr, rows, row_live, keys_ptr, cols, col_live, D, D_CHUNKS, BLOCK_D)
        # d(summed loss)/d(logits): softmax − one-hot (keys past M: none)
        g = tl.where(col_live[None, :], tl.exp2((s - lse[:, None]) * _LOG2E), 0.0)
        g -= tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
        if D_CHUNKS > 1:
            k = _chunk(keys_ptr, cols, col_live, chunk, D, BLOCK_D)
        acc += _dot(g.to(k.dtype), k)
    out_cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    at = dq_ptr + rows.to(tl.int64)[:, None] * D + out_cols[None, :]
    tl.store(at, acc * tl.load(scale_ptr), mask=row_live[:, None] & (out_cols[None, :] < D))


@triton.jit(do_not_specialize=["P"])
def _softmax_cross_entropy_backward_keys_kernel(
    q_ptr, keys_ptr, target_ptr, lse_ptr, scale_ptr, dkeys_ptr, P, M, D, keys_class,
    D_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    chunk = tl.program_id(1)
    col_live = cols < M
    # this program's slice of the row blocks
    per_slice = tl.cdiv(tl.cdiv(P, BLOCK_P), tl.num_programs(2)) * BLOCK_P
    first = tl.program_id(2) * per_slice
    k_first = _chunk(keys_ptr, cols, col_live, 0, D, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for p0 in range(first, tl.minimum(first + per_slice, P), BLOCK_P):
        rows, row_live, target, lse = _row_block(target_ptr, lse_ptr, p0, P, BLOCK_P)
        # the logits transposed: (keys, rows)
        s, q = _products(k_first, keys_ptr, cols, col_live, q_ptr, rows, row_live, D, D_CHUNKS, BLOCK_D)
        g = tl.where(row_live[None, :], tl.exp2((s - lse[None, :]) * _LOG2E), 0.0)
        g -= tl.where(cols[:, None] == target[None, :], 1.0, 0.0)
        if D_CHUNKS > 1:
            q = _chunk(q_ptr, rows, row_live, chunk, D, BLOCK_D)
        acc += _dot(g.to(q.dtype), q)
    out_cols = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    at = dkeys_ptr + cols.to(tl.int64)[:, None] * D + out_cols[None, :]
    tl.atomic_add(at, acc * tl.load(scale_ptr), mask=col_live[:, None] & (out_cols[None, :] < D), sem="relaxed")


_forward = TunedLaunches(autotuned(_softmax_cross_entropy_forward_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY))
_backward_q = TunedLaunches(autotuned(_softmax_cross_entropy_backward_q_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY))
# (adds into dKeys: zeroed before each trial)
_backward_keys = TunedLaunches(autotuned(
    _softmax_cross_entropy_backward_keys_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY, reset_to_zero=["dkeys_ptr"]
))


def _shape(q: torch.Tensor, keys: torch.Tensor) -> tuple[tuple, dict]:
    """(the kernels' sizes P, M, D, keys_class; their column constants)."""
    P, D = q.shape
    block_d = min(MAX_BLOCK_D, max(MIN_BLOCK_D, next_power_of_2(D)))
    return (P, keys.shape[0], D, next_power_of_2(keys.shape[0])), dict(D_CHUNKS=math.ceil(D / block_d), BLOCK_D=block_d)


def row_losses(q: torch.Tensor, keys: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's loss −log softmax(q · keysᵀ)[target], each row's log-sum-exp of its
    logits), float32 (P,); q (P, D), keys (M, D) of one dtype, M >= 1."""
    q, keys, target = q.contiguous(), keys.contiguous(), target.contiguous()
    sizes, constants = _shape(q, keys)
    lse = torch.empty(q.shape[0], dtype=torch.float32, device=q.device)
    loss = torch.empty_like(lse)
    if q.shape[0]:
        _forward(lambda meta: (cdiv(sizes[0], meta["BLOCK_P"]),), (q, keys, target, lse, loss, *sizes), constants)
    return loss, lse


def softmax_cross_entropy_backward(
    scale: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dQ, dKeys) in float32 of scale · the summed row losses; scale: a (1,) float32
    tensor (the upstream gradient over P), lse: row_losses' log-sum-exp."""
    q, keys, target = q.contiguous(), keys.contiguous(), target.contiguous()
    sizes, constants = _shape(q, keys)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dkeys = torch.zeros(keys.shape, dtype=torch.float32, device=q.device)
    if not q.shape[0]:
        return dq, dkeys
    P, M = sizes[:2]
    chunks, programs = constants["D_CHUNKS"], KEYS_PROGRAMS * multiprocessors(q.device)
    args = (q, keys, target, lse, scale)
    _backward_q(lambda meta: (cdiv(P, meta["BLOCK_P"]), chunks), (*args, dq, *sizes), constants)

    def keys_grid(meta):
        blocks = cdiv(M, meta["BLOCK_M"]) * chunks
        return cdiv(M, meta["BLOCK_M"]), chunks, max(1, min(cdiv(P, meta["BLOCK_P"]), programs // blocks))

    _backward_keys(keys_grid, (*args, dkeys, *sizes), constants)
    return dq, dkeys
