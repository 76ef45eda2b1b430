"""Both biases of each pair, written by a prepass before the forward (and again before the
backward's dK dV kernel), so that those kernels' tiles read them as a tile (a bulk copy
through a tensor descriptor on GPUs with the Tensor Memory Accelerator, read in the
products' layout) instead of computing each pair's position index, time gap and bucket
and gathering two biases per pair, once per tile and head (pair) of heads. The biases and
the buckets are the same for every head: the prepass makes them once per pair.

The prepass (_pair_biases_kernel) writes, for each block of rows of a sequence,
position_bias[j - i] + time_bias[bucket(|t_i - t_j|)] for the columns up to the block's
last attended key (tiles._key_ranges): every pair a row attends to. Entries a reader's
tile holds that no row attends to (above the diagonal, the targets' other targets) may be
unwritten: the readers mask those pairs with tl.where before any product, which a NaN
there does not pass. Rows and columns past a sequence's end are never read as values (a
descriptor reads them as zeros; the pointer load masks them).

The buffer is (sequences, max_seq_len, score_grads_row_length(max_seq_len)), the stored
dS's layout with one head: a descriptor's rows start 16 bytes apart. Its dtype is the
inputs' (for 16-bit inputs the sum rounded once, as the products' inputs are).
"""
import torch
import triton
import triton.language as tl

from ..autotune import TunedLaunches, autotuned
from ..launch import cdiv, next_power_of_2
from .score_grads import _row_length, score_grads_row_length
from .tiles import _biases, _block_times, _key_ranges, _program_block

# few rows a program: the per-pair work keeps about five registers a pair live, so a
# thread with fewer pairs leaves room for more warps to hide the gathers' latency
CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
    for m, n, w, st in ((16, 64, 4, 2), (16, 128, 4, 2), (32, 64, 4, 2))
]
INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
TUNING_KEY = ["length_class"]


@triton.jit
def _pair_biases_slot(bias_ptr, b, max_seq_len):
    """Where sequence b's (max_seq_len, row length) block of the buffer starts (int64)."""
    return bias_ptr + b.to(tl.int64) * max_seq_len * _row_length(max_seq_len)


@triton.jit
def _pair_biases_kernel(
    bias_ptr, offsets_ptr, timestamps_ptr, targets_ptr, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets,
    context_len, length_class, HAS_TARGETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Both biases of rows m0 .. m0 + BLOCK_M - 1 of one sequence against every key any of
    them attends to."""
    m0, _head, b, start, n, history_end, t0 = _program_block(offsets_ptr, targets_ptr, timestamps_ptr, 1, BLOCK_M, HAS_TARGETS)
    if m0 >= n:
        return
    rows, row_live, t_rows = _block_times(timestamps_ptr, start, t0, m0, n, BLOCK_M)
    _begin, end = _key_ranges(m0, n, history_end, context_len, BLOCK_M, BLOCK_N)
    at = _pair_biases_slot(bias_ptr, b, max_seq_len) + (rows * _row_length(max_seq_len))[:, None]
    for n0 in range(0, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_live = cols < n
        t_cols = (tl.load(timestamps_ptr + start + cols, mask=col_live, other=t0) - t0).to(tl.float64)
        bias, _, _ = _biases(
            rows, cols, t_rows, t_cols, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, 0.0, 0.0, 0.0, False,
        )
        tl.store(at + cols[None, :], bias.to(bias_ptr.dtype.element_ty), mask=row_live[:, None] & col_live[None, :])


_pair_biases = TunedLaunches(autotuned(_pair_biases_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY))


def pair_biases(
    offsets: torch.Tensor, timestamps: torch.Tensor, position_bias: torch.Tensor, time_bias: torch.Tensor,
    max_seq_len: int, edges: torch.Tensor, dtype: torch.dtype, num_targets: torch.Tensor | None = None,
    context_len: int = 0,
) -> torch.Tensor:
    """(sequences, max_seq_len, score_grads_row_length(max_seq_len)) of dtype: each
    sequence's pair biases where the forward reads them (the module's docstring); edges:
    the float32 bucket edges the kernels read (triton_kernels._bucket_tables). The twin:
    reference.pair_biases."""
    sequences = offsets.numel() - 1
    out = torch.empty(sequences, max_seq_len, score_grads_row_length(max_seq_len), dtype=dtype, device=offsets.device)
    if sequences and timestamps.numel():
        _pair_biases(
            lambda meta: (cdiv(max_seq_len, meta["BLOCK_M"]), sequences),
            (out, offsets, timestamps, num_targets if num_targets is not None else offsets, position_bias, time_bias, edges,
             max_seq_len, time_bias.numel() - 1, context_len, next_power_of_2(max_seq_len)),
            dict(HAS_TARGETS=num_targets is not None),
        )
    return out
