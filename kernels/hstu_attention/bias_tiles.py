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
descriptor reads them as zeros; the pointer load masks them), so the prepass writes a
tile's columns up to the row's end, which keeps its stores vectors.

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
from .tiles import _biases, _block_times, _key_ranges, _program_block, _two_bucket_run
from .time_buckets import _tile_buckets, _tile_extremes

# few rows a program (8 or 16): fewer pairs a thread, so more warps an SM to hide the
# per-pair work and the loads; the fastest tilings when each was timed alone
# (benchmarks/hstu_attention.md, "The prepass's stores as vectors")
CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
    for m, n, w, st in ((16, 64, 4, 2), (16, 128, 4, 2), (8, 256, 4, 2), (8, 128, 2, 2))
]
INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
TUNING_KEY = ["length_class"]


@triton.jit
def _pair_biases_slot(bias_ptr, b, max_seq_len):
    """Where sequence b's (max_seq_len, row length) block of the buffer starts (int64)."""
    return bias_ptr + b.to(tl.int64) * max_seq_len * _row_length(max_seq_len)


@triton.jit
def _store_tile(
    at, rows, row_live, t_rows, n0, start, t0, n, row_length, timestamps_ptr, position_ptr, time_ptr, edges_ptr,
    max_seq_len, num_buckets, threshold, low, high, TWO_BUCKETS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Writes both biases of the rows against keys n0 .. n0 + BLOCK_N - 1 (tiles._biases;
    TWO_BUCKETS: a tile whose gaps span two buckets at most, the time bias `high` where a
    gap reaches `threshold`, else `low`)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    t_cols = (tl.load(timestamps_ptr + start + cols, mask=cols < n, other=t0) - t0).to(tl.float64)
    bias, _, _ = _biases(
        rows, cols, t_rows, t_cols, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, threshold, low, high,
        TWO_BUCKETS,
    )
    # (columns past the sequence's end up to the row's end written too: a mask constant over
    # runs of ROW_ALIGN columns lets the stores be vectors, where a mask by the sequence's
    # end makes one store per entry, which bound the prepass by the L2's transactions)
    tl.store(at + cols[None, :], bias.to(at.dtype.element_ty), mask=row_live[:, None] & (cols < row_length)[None, :])


@triton.jit
def _pair_biases_kernel(
    bias_ptr, offsets_ptr, timestamps_ptr, targets_ptr, position_ptr, time_ptr, edges_ptr, thresholds_ptr, ext_ptr,
    ext_blocks, max_seq_len, num_buckets, context_len, length_class, HAS_TARGETS: tl.constexpr,
    TWO_BUCKET_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Both biases of rows m0 .. m0 + BLOCK_M - 1 of one sequence against every key any of
    them attends to: first (TWO_BUCKET_TILES) the run of key blocks from the first whose
    tiles span two time buckets at most, whose pairs take one comparison for their bucket
    (time_buckets.py), then the rest pair by pair."""
    m0, _head, b, start, n, history_end, t0 = _program_block(offsets_ptr, targets_ptr, timestamps_ptr, 1, BLOCK_M, HAS_TARGETS)
    if m0 >= n:
        return
    rows, row_live, t_rows = _block_times(timestamps_ptr, start, t0, m0, n, BLOCK_M)
    full, end = _key_ranges(m0, n, history_end, context_len, BLOCK_M, BLOCK_N)
    row_length = _row_length(max_seq_len)
    at = _pair_biases_slot(bias_ptr, b, max_seq_len) + (rows * row_length)[:, None]
    split, lo, hi, entry = _two_bucket_run(
        ext_ptr, ext_blocks, b, t_rows, row_live, 0, full, edges_ptr, num_buckets, BLOCK_N, True, TWO_BUCKET_TILES,
    )
    if TWO_BUCKET_TILES:
        for n0 in range(0, split, BLOCK_N):
            k_lo, k_hi = _tile_extremes(ext_ptr, entry, n0, BLOCK_N)
            _, threshold, low, high = _tile_buckets(k_lo, k_hi, lo, hi, thresholds_ptr, time_ptr, edges_ptr, num_buckets)
            _store_tile(
                at, rows, row_live, t_rows, n0, start, t0, n, row_length, timestamps_ptr, position_ptr, time_ptr,
                edges_ptr, max_seq_len, num_buckets, threshold, low, high, True, BLOCK_N,
            )
    for n0 in range(split, end, BLOCK_N):
        _store_tile(
            at, rows, row_live, t_rows, n0, start, t0, n, row_length, timestamps_ptr, position_ptr, time_ptr, edges_ptr,
            max_seq_len, num_buckets, 0.0, 0.0, 0.0, False, BLOCK_N,
        )


_pair_biases = TunedLaunches(autotuned(_pair_biases_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY))


def pair_biases(
    offsets: torch.Tensor, timestamps: torch.Tensor, position_bias: torch.Tensor, time_bias: torch.Tensor,
    max_seq_len: int, tables: tuple, dtype: torch.dtype, num_targets: torch.Tensor | None = None, context_len: int = 0,
) -> torch.Tensor:
    """(sequences, max_seq_len, score_grads_row_length(max_seq_len)) of dtype: each
    sequence's pair biases where the forward reads them (the module's docstring); tables:
    what the kernels bucket gaps with (triton_kernels._time_tables: the bucket edges and
    thresholds, and the timestamp extremes with their blocks per sequence, where those are
    0 the tiles of two buckets do not run). The twin: reference.pair_biases."""
    sequences = offsets.numel() - 1
    out = torch.empty(sequences, max_seq_len, score_grads_row_length(max_seq_len), dtype=dtype, device=offsets.device)
    if sequences and timestamps.numel():
        edges, thresholds, ext, ext_blocks = tables
        _pair_biases(
            lambda meta: (cdiv(max_seq_len, meta["BLOCK_M"]), sequences),
            (out, offsets, timestamps, num_targets if num_targets is not None else offsets, position_bias, time_bias, edges,
             thresholds, ext, ext_blocks, max_seq_len, time_bias.numel() - 1, context_len, next_power_of_2(max_seq_len)),
            dict(HAS_TARGETS=num_targets is not None, TWO_BUCKET_TILES=ext_blocks > 0),
        )
    return out
