"""The attention's backward from stored score gradients (dS): the dK dV kernel
(attention_kernels._backward_kv_kernel with STORE_DS) writes each tile's dS, masked, in the
inputs' dtype, into a buffer of (sequences, heads, max_seq_len, max_seq_len), each row
padded to score_grads_row_length(max_seq_len) entries; from it

- dQ of each head is a product of those tiles with K (_dq_kernel), as the recomputing dQ
  kernel's last step, without its scores, biases and masks per pair;
- the biases' gradients take the heads' dS summed per pair (_bias_grads_kernel): one
  position index, time bucket and atomic add per pair for all heads, where the recomputing
  dQ kernel makes them once per head.

Only pairs a row attends to are written (tiles._allowed), and only those are read: the
rest of the buffer is never touched. On GPUs with the Tensor Memory Accelerator (compute
capability 9 and later) the dK dV kernel stores each tile through a tensor descriptor of
its sequence's (length, length) block: the tile leaves through shared memory in one bulk
copy, clipped at the sequence's end, instead of a store per thread of the products'
register layout. A descriptor's rows must start 16 bytes apart, hence the padded rows.
The host (triton_kernels.hstu_attention_backward) runs the sequences through a buffer of
bounded size, some sequences at a time.

dS is stored in the inputs' dtype, as the products of dQ and dK take it; so the biases'
gradients are sums of 16-bit dS for 16-bit inputs (relative error about 2e-3 against the
twin at B8 N4096 in bfloat16, as dQ, dK and dV have; the recomputing dQ kernel adds each
head's float32 dS, about 6e-5), and float32 sums for float32 inputs.
"""
import triton
import triton.language as tl

from ..autotune import TunedLaunches, autotuned
from ..launch import cdiv
from .bias_grads import _add_bias_grads, _bias_grad_copy
from .tiles import _block_times, _counted, _head_rows, _key_ranges, _load_head_rows, _pair_buckets, _program_block, _two_bucket_run
from .time_buckets import _tile_bucket, _tile_extremes

# dQ's tiles: a product of a stored (BLOCK_M, BLOCK_N) dS tile with K's block; no per-pair work
DQ_CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
    for m, n, w, st in ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4))
]
# the biases' gradients: per-pair sums over heads, indices and atomic adds; no products.
# BLOCK_N at most 128 (the timestamp extremes cover sequences in blocks of that many rows).
# Blocks of 16 rows: fewer pairs a thread, so more warps an SM wait on the loads and adds
BIAS_CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
    for m, n, w, st in ((32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 4, 2), (64, 128, 8, 2), (16, 64, 4, 2), (16, 128, 4, 2))
]
INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
TUNING_KEY = ["DQK", "length_class"]  # length_class: max_seq_len's power of two
BIAS_TUNING_KEY = ["HEADS", "length_class"]


# a row of the buffer holds a multiple of this many entries: 16 bytes at 16 bits
ROW_ALIGN = tl.constexpr(8)


def score_grads_row_length(max_seq_len: int) -> int:
    """Entries per row of the stored dS buffer: max_seq_len rounded up to ROW_ALIGN."""
    return cdiv(max_seq_len, ROW_ALIGN.value) * ROW_ALIGN.value


@triton.jit
def _row_length(max_seq_len):
    """score_grads_row_length in a kernel."""
    return tl.cdiv(max_seq_len, ROW_ALIGN) * ROW_ALIGN


@triton.jit
def _score_grads_slot(ds_ptr, b, h, heads, max_seq_len):
    """Where sequence b's dS of head h starts in the buffer, offset in int64 (a buffer of
    SCORE_GRADS_BUFFER_BYTES may hold 2^31 entries)."""
    return ds_ptr + (b * heads + h).to(tl.int64) * max_seq_len * _row_length(max_seq_len)


@triton.jit
def _score_grads_at(ds_ptr, b, h, heads, rows, cols, max_seq_len):
    """Pointers to dS of rows `rows` against columns `cols` of sequence b (its slot in the
    buffer) and head h; the tile's offsets within the slot in int32."""
    slot = _score_grads_slot(ds_ptr, b, h, heads, max_seq_len)
    return slot + (rows * _row_length(max_seq_len))[:, None] + cols[None, :]


@triton.jit
def _dq_tile(
    acc, ds_ptr, k_ptr, b, h, heads, rows, row_live, n0, start, n, history_end, context_len, max_seq_len,
    MASKED: tl.constexpr, DQK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
):
    """acc plus the stored dS of the key rows n0 .. n0 + BLOCK_N - 1 (read where counted) · K."""
    cols = n0 + tl.arange(0, BLOCK_N)
    counted = _counted(rows, row_live, cols, n, history_end, context_len, MASKED)
    ds = tl.load(_score_grads_at(ds_ptr, b, h, heads, rows, cols, max_seq_len), mask=counted, other=0.0)
    k = _load_head_rows(k_ptr, start, cols, cols < n, heads, h, DQK, BLOCK_DQK)
    return acc + tl.dot(ds, k, input_precision="ieee" if k.dtype == tl.float32 else "tf32")


@triton.jit
def _dq_kernel(
    ds_ptr, k_ptr, dq_ptr, offsets_ptr, timestamps_ptr, targets_ptr, heads, max_seq_len, context_len, length_class,
    HAS_TARGETS: tl.constexpr, DQK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
):
    """dQ of a block of query rows of one head: Σ over the key blocks its rows attend to
    of dS · K."""
    m0, h, b, start, n, history_end, _ = _program_block(offsets_ptr, targets_ptr, timestamps_ptr, heads, BLOCK_M, HAS_TARGETS)
    if m0 >= n:
        return
    rows = m0 + tl.arange(0, BLOCK_M)
    row_live = rows < n
    acc = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    full, end = _key_ranges(m0, n, history_end, context_len, BLOCK_M, BLOCK_N)
    for n0 in range(0, full, BLOCK_N):
        acc = _dq_tile(acc, ds_ptr, k_ptr, b, h, heads, rows, row_live, n0, start, n, history_end, context_len, max_seq_len,
                       False, DQK, BLOCK_N, BLOCK_DQK)
    for n0 in range(full, end, BLOCK_N):
        acc = _dq_tile(acc, ds_ptr, k_ptr, b, h, heads, rows, row_live, n0, start, n, history_end, context_len, max_seq_len,
                       True, DQK, BLOCK_N, BLOCK_DQK)
    dq_at, dq_mask = _head_rows(dq_ptr, start, rows, row_live, heads, h, DQK, BLOCK_DQK)
    tl.store(dq_at, acc.to(dq_ptr.dtype.element_ty), mask=dq_mask)


@triton.jit
def _bias_grad_tile(
    ds_ptr, b, rows, row_live, t_rows, n0, timestamps_ptr, start, t0, n, history_end, position_grad_ptr, time_grad_ptr,
    edges_ptr, max_seq_len, num_buckets, context_len, tile_bucket, threshold, MASKED: tl.constexpr,
    TWO_BUCKETS: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    cols = n0 + tl.arange(0, BLOCK_N)
    counted = _counted(rows, row_live, cols, n, history_end, context_len, MASKED)
    ds = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in tl.static_range(HEADS):  # (unrolled: the heads' loads issue together)
        ds += tl.load(_score_grads_at(ds_ptr, b, h, HEADS, rows, cols, max_seq_len), mask=counted, other=0.0).to(tl.float32)
    t_cols = (tl.load(timestamps_ptr + start + cols, mask=cols < n, other=t0) - t0).to(tl.float64)
    rel, bucket = _pair_buckets(rows, cols, t_rows, t_cols, max_seq_len, edges_ptr, num_buckets, threshold, TWO_BUCKETS)
    _add_bias_grads(
        position_grad_ptr, time_grad_ptr, ds, rel, bucket, counted, rows, cols, t_rows, n0, timestamps_ptr, start, t0, n,
        history_end, context_len, edges_ptr, num_buckets, tile_bucket, MASKED, TWO_BUCKETS, BLOCK_N,
    )


@triton.jit
def _bias_grads_kernel(
    ds_ptr, offsets_ptr, timestamps_ptr, targets_ptr, edges_ptr, position_grad_ptr, time_grad_ptr, thresholds_ptr,
    ext_ptr, ext_blocks, max_seq_len, num_buckets, context_len, length_class, HAS_TARGETS: tl.constexpr,
    TWO_BUCKET_TILES: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The biases' gradients from a block of query rows of one sequence, every head's dS
    summed per pair; the tiles in the recomputing dQ kernel's three loops (two buckets at
    most, the rest unmasked, masked)."""
    m0, _, b, start, n, history_end, t0 = _program_block(offsets_ptr, targets_ptr, timestamps_ptr, 1, BLOCK_M, HAS_TARGETS)
    if m0 >= n:
        return
    rows, row_live, t_rows = _block_times(timestamps_ptr, start, t0, m0, n, BLOCK_M)
    copy = _bias_grad_copy(max_seq_len, num_buckets)
    position_grad_ptr += copy
    time_grad_ptr += copy
    full, end = _key_ranges(m0, n, history_end, context_len, BLOCK_M, BLOCK_N)
    split, lo, hi, entry = _two_bucket_run(
        ext_ptr, ext_blocks, b, t_rows, row_live, 0, full, edges_ptr, num_buckets, BLOCK_N, True, TWO_BUCKET_TILES,
    )
    if TWO_BUCKET_TILES:
        for n0 in range(0, split, BLOCK_N):
            k_lo, k_hi = _tile_extremes(ext_ptr, entry, n0, BLOCK_N)
            tile_bucket, threshold = _tile_bucket(k_lo, k_hi, lo, hi, thresholds_ptr, edges_ptr, num_buckets)
            _bias_grad_tile(
                ds_ptr, b, rows, row_live, t_rows, n0, timestamps_ptr, start, t0, n, history_end, position_grad_ptr,
                time_grad_ptr, edges_ptr, max_seq_len, num_buckets, context_len, tile_bucket, threshold, False, True, HEADS,
                BLOCK_M, BLOCK_N,
            )
    for n0 in range(split, full, BLOCK_N):
        _bias_grad_tile(
            ds_ptr, b, rows, row_live, t_rows, n0, timestamps_ptr, start, t0, n, history_end, position_grad_ptr,
            time_grad_ptr, edges_ptr, max_seq_len, num_buckets, context_len, 0, 0.0, False, False, HEADS, BLOCK_M, BLOCK_N,
        )
    for n0 in range(full, end, BLOCK_N):
        _bias_grad_tile(
            ds_ptr, b, rows, row_live, t_rows, n0, timestamps_ptr, start, t0, n, history_end, position_grad_ptr,
            time_grad_ptr, edges_ptr, max_seq_len, num_buckets, context_len, 0, 0.0, True, False, HEADS, BLOCK_M, BLOCK_N,
        )


_dq = TunedLaunches(autotuned(_dq_kernel, DQ_CONFIGS, INTERPRETER_CONFIG, TUNING_KEY))
# (adds into the biases' gradients: zeroed before each trial)
_bias_grads = TunedLaunches(autotuned(
    _bias_grads_kernel, BIAS_CONFIGS, INTERPRETER_CONFIG, BIAS_TUNING_KEY, reset_to_zero=["position_grad_ptr", "time_grad_ptr"]
))
