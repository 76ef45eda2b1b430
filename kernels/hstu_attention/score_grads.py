"""The attention's backward from stored score gradients (dS): the dK dV kernel
(attention_kernels._backward_kv_kernel with STORE_DS) writes each tile's dS, masked, in the
inputs' dtype, into a buffer of (sequences, heads, max_seq_len, max_seq_len), each row
padded to score_grads_row_length(max_seq_len) entries; from it

- dQ of each head is a product of those tiles with K (_dq_kernel), as the recomputing dQ
  kernel's last step, without its scores, biases and masks per pair;
- the biases' gradients take the heads' dS summed per pair (_bias_grads_kernel), a time
  bucket per pair for all heads where the recomputing dQ kernel makes them once per head.
  Its programs walk bands of tiles (band_grid), each tile a block of rows further along
  the diagonal than the one before, so that every tile of a band holds the same position
  indices at the same places: a band's tiles are summed in registers and added into the
  position gradient once, not an atomic add per pair and tile. Along a band the time
  gaps change slowly: the buckets of a program's unmasked tiles are found together before
  its loop, and its run of tiles of the same two buckets is summed in registers too.

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
from .bias_grads import _add_bucket_pair_sums, _add_time_grads, _bias_grad_copy
from .tiles import _block_times, _counted, _head_rows, _key_ranges, _load_head_rows, _program_block, _sequence
from .time_buckets import _distances, _gap_bucket, _rows_extremes

# dQ's tiles: a product of a stored (BLOCK_M, BLOCK_N) dS tile with K's block; no per-pair work
DQ_CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
    for m, n, w, st in ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4))
]
# the biases' gradients: per-pair sums over heads, buckets and atomic adds; no products.
# BAND_TILES: tiles a program sums before its position gradient's adds. The fastest
# tilings when each was timed alone (benchmarks/hstu_attention.md, "The bias gradients'
# buckets per band"): 32 x 32 at length 4,096, 64 x 32 on 8 warps at 200
BIAS_CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BAND_TILES": t}, num_warps=w, num_stages=st)
    for m, n, t, w, st in ((32, 32, 8, 4, 2), (32, 32, 4, 4, 2), (32, 32, 16, 4, 2), (64, 32, 16, 8, 2))
]
INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
BIAS_INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BAND_TILES": 2}, num_warps=4, num_stages=2)
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
def _band_pairs(
    ds_ptr, b, r0, o, timestamps_ptr, start, t0, n, history_end, max_seq_len, context_len, MASKED: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The tile of rows r0 .. r0 + BLOCK_M - 1 against keys r0 + o .. r0 + o + BLOCK_N - 1
    (those below 0 not counted): (the heads' dS summed per pair, 0 where not counted, its
    rows, its keys, which pairs count, the rows' timestamps, each pair's float64 gap)."""
    rows, row_live, t_rows = _block_times(timestamps_ptr, start, t0, r0, n, BLOCK_M)
    cols = r0 + o + tl.arange(0, BLOCK_N)
    counted = _counted(rows, row_live, cols, n, history_end, context_len, MASKED)
    if MASKED:
        counted &= (cols >= 0)[None, :]
    ds = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in tl.static_range(HEADS):  # (unrolled: the heads' loads issue together)
        ds += tl.load(_score_grads_at(ds_ptr, b, h, HEADS, rows, cols, max_seq_len), mask=counted, other=0.0).to(tl.float32)
    t_cols = (tl.load(timestamps_ptr + start + cols, mask=(cols >= 0) & (cols < n), other=t0) - t0).to(tl.float64)
    return ds, rows, cols, counted, t_rows, tl.abs(t_rows[:, None] - t_cols[None, :])


@triton.jit
def _band_tile(
    acc, ds_ptr, b, r0, o, timestamps_ptr, start, t0, n, history_end, time_grad_ptr, edges_ptr, max_seq_len, num_buckets,
    context_len, MASKED: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """acc plus the heads' dS of a tile (_band_pairs), whose time gradient it adds by runs of
    equal buckets along each row (bias_grads.py)."""
    ds, rows, cols, counted, t_rows, gap = _band_pairs(
        ds_ptr, b, r0, o, timestamps_ptr, start, t0, n, history_end, max_seq_len, context_len, MASKED, HEADS, BLOCK_M, BLOCK_N,
    )
    _add_time_grads(
        time_grad_ptr, ds, _gap_bucket(gap, edges_ptr, num_buckets), counted, rows, cols, t_rows, r0 + o, timestamps_ptr,
        start, t0, n, history_end, context_len, edges_ptr, num_buckets, 0, MASKED, False, BLOCK_N,
    )
    return acc + ds


@triton.jit
def _band_buckets(
    tiles, live, o, n, ext_ptr, entry, edges_ptr, thresholds_ptr, num_buckets, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """For the unmasked tiles of a band whose row blocks are `tiles` (where live), all at
    once: (the lower bucket of each tile's gaps, whether they span two buckets at most,
    the least whole gap of the bucket above), from the extremes of the rows' and the keys'
    blocks (time_buckets.py)."""
    r0 = tiles * BLOCK_M
    lo, hi = _rows_extremes(ext_ptr, entry, r0, tl.minimum(r0 + BLOCK_M, n) - 1, live, BLOCK_M)
    k_lo, k_hi = _rows_extremes(ext_ptr, entry, r0 + o, r0 + o + BLOCK_N - 1, live, BLOCK_N)
    least, most = _distances(lo, hi, k_lo, k_hi)
    bucket = tl.where(live, _gap_bucket(least, edges_ptr, num_buckets), 0)
    two = live & (_gap_bucket(most, edges_ptr, num_buckets) - bucket <= 1)
    return bucket, two, tl.load(thresholds_ptr + bucket + 1, mask=live, other=0.0)


@triton.jit
def _band_run(
    acc, ds_ptr, b, first, last, o, timestamps_ptr, start, t0, n, history_end, time_grad_ptr, edges_ptr, thresholds_ptr,
    ext_ptr, entry, max_seq_len, num_buckets, context_len, HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BAND_TILES: tl.constexpr,
):
    """acc plus the unmasked tiles of row blocks first .. last - 1 of a band (at most
    BAND_TILES), whose time gradient it adds: each tile's buckets found before the loop
    (_band_buckets, their loads issued together), and the tiles whose gaps span two
    buckets at most summed in registers while their lower bucket stays the same, with two
    atomic adds where it changes and at the end (along a band the gaps, and so the
    buckets, change slowly); the other tiles by runs along each row (_band_tile)."""
    tiles = first + tl.arange(0, BAND_TILES)
    buckets, twos, thresholds = _band_buckets(
        tiles, tiles < last, o, n, ext_ptr, entry, edges_ptr, thresholds_ptr, num_buckets, BLOCK_M, BLOCK_N,
    )
    run = -1  # the lower bucket of the tiles summed so far (none: -1)
    low = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    high = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(first, last):
        this = tiles == r
        two = tl.sum(tl.where(this, twos, False).to(tl.int32), axis=0) > 0
        if two:
            ds, _, _, _, _, gap = _band_pairs(
                ds_ptr, b, r * BLOCK_M, o, timestamps_ptr, start, t0, n, history_end, max_seq_len, context_len, False, HEADS,
                BLOCK_M, BLOCK_N,
            )
            bucket = tl.sum(tl.where(this, buckets, 0), axis=0)
            if bucket != run:
                _add_bucket_pair_sums(time_grad_ptr, low, high, run, num_buckets)
                low = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                high = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                run = bucket
            upper = gap >= tl.sum(tl.where(this, thresholds, 0.0), axis=0)
            low += tl.where(upper, 0.0, ds)
            high += tl.where(upper, ds, 0.0)
            acc += ds
        else:
            acc = _band_tile(
                acc, ds_ptr, b, r * BLOCK_M, o, timestamps_ptr, start, t0, n, history_end, time_grad_ptr, edges_ptr,
                max_seq_len, num_buckets, context_len, False, HEADS, BLOCK_M, BLOCK_N,
            )
    _add_bucket_pair_sums(time_grad_ptr, low, high, run, num_buckets)
    return acc


@triton.jit
def _diagonal_reach(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The greatest band offset (a multiple of BLOCK_N) whose tiles hold a pair of a row
    with a key at or before it: a diagonal block's rows reach BLOCK_M - 1 keys past its
    first row, so with blocks of more rows than keys the bands up to that offset hold
    pairs that every row attends to, not only the context's."""
    return (BLOCK_M - 1) // BLOCK_N * BLOCK_N


def band_grid(max_seq_len: int, sequences: int, context: bool):
    """The bias-gradient kernel's grid: (bands × chunks of BAND_TILES row blocks, sequences),
    where a band is the tiles whose keys start a fixed offset o from their rows, o a
    multiple of BLOCK_N from that of a sequence's last row block's first key to the last
    offset that holds a pair of a diagonal block (_diagonal_reach: 0 where BLOCK_M <=
    BLOCK_N), and past it to max_seq_len where a context prefix attends to later keys."""
    def grid(meta):
        m, n = meta["BLOCK_M"], meta["BLOCK_N"]
        blocks = cdiv(max_seq_len, m)
        diagonal = _diagonal_reach.fn(m, n) // n  # (the kernel's own rule, on the host's ints)
        bands = cdiv((blocks - 1) * m, n) + 1 + diagonal + (cdiv(max_seq_len, n) if context else 0)
        return bands * cdiv(blocks, meta["BAND_TILES"]), sequences
    return grid


@triton.jit
def _bias_grads_kernel(
    ds_ptr, offsets_ptr, timestamps_ptr, targets_ptr, edges_ptr, position_grad_ptr, time_grad_ptr, thresholds_ptr,
    ext_ptr, ext_blocks, max_seq_len, num_buckets, context_len, length_class, HAS_TARGETS: tl.constexpr,
    TWO_BUCKET_TILES: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BAND_TILES: tl.constexpr,
):
    """The biases' gradients from up to BAND_TILES tiles of one band (band_grid) of one
    sequence, every head's dS summed per pair. The tiles of a band hold the same position
    indices at the same places (key less row), so their dS is summed in registers and the
    position gradient takes one atomic add per pair of the band's tile, not of each tile;
    the time gradient is added tile by tile (_band_tile)."""
    b = tl.program_id(1)
    start, n, history_end, t0 = _sequence(offsets_ptr, targets_ptr, timestamps_ptr, b, HAS_TARGETS)
    blocks = tl.cdiv(max_seq_len, BLOCK_M)
    chunks = tl.cdiv(blocks, BAND_TILES)
    o = (tl.program_id(0) // chunks - tl.cdiv((blocks - 1) * BLOCK_M, BLOCK_N)) * BLOCK_N  # the band's key offset
    first = tl.program_id(0) % chunks * BAND_TILES
    last = tl.minimum(first + BAND_TILES, tl.cdiv(n, BLOCK_M))
    # past the bands of the diagonal blocks only the context's rows attend
    last = tl.where(o > _diagonal_reach(BLOCK_M, BLOCK_N), tl.minimum(last, tl.cdiv(context_len, BLOCK_M)), last)
    below = tl.maximum(-o, 0)  # (rows r0 from which every key is 0 or more)
    first = tl.maximum(first, tl.cdiv(tl.maximum(below - BLOCK_N + 1, 0), BLOCK_M))  # (a key at 0 or more)
    if first >= last:
        return
    copy = _bias_grad_copy(max_seq_len, num_buckets)
    position_grad_ptr += copy
    time_grad_ptr += copy
    # the unmasked tiles: below the diagonal, every key in the history (which every row
    # attends to up to itself, targets and context rows too), none below 0
    spare = history_end - o - BLOCK_N  # (rows r0 up to which the keys end in the history)
    full_first = tl.minimum(tl.maximum(first, tl.cdiv(below, BLOCK_M)), last)
    full_last = tl.maximum(tl.minimum(last, tl.where(spare >= 0, spare // BLOCK_M + 1, 0)), full_first)
    if o + BLOCK_N - 1 > 0:
        full_first = last
        full_last = last
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(first, full_first):
        acc = _band_tile(
            acc, ds_ptr, b, r * BLOCK_M, o, timestamps_ptr, start, t0, n, history_end, time_grad_ptr, edges_ptr, max_seq_len,
            num_buckets, context_len, True, HEADS, BLOCK_M, BLOCK_N,
        )
    if TWO_BUCKET_TILES:
        acc = _band_run(
            acc, ds_ptr, b, full_first, full_last, o, timestamps_ptr, start, t0, n, history_end, time_grad_ptr, edges_ptr,
            thresholds_ptr, ext_ptr, b * ext_blocks, max_seq_len, num_buckets, context_len, HEADS, BLOCK_M, BLOCK_N,
            BAND_TILES,
        )
    else:
        for r in range(full_first, full_last):
            acc = _band_tile(
                acc, ds_ptr, b, r * BLOCK_M, o, timestamps_ptr, start, t0, n, history_end, time_grad_ptr, edges_ptr,
                max_seq_len, num_buckets, context_len, False, HEADS, BLOCK_M, BLOCK_N,
            )
    for r in range(full_last, last):
        acc = _band_tile(
            acc, ds_ptr, b, r * BLOCK_M, o, timestamps_ptr, start, t0, n, history_end, time_grad_ptr, edges_ptr, max_seq_len,
            num_buckets, context_len, True, HEADS, BLOCK_M, BLOCK_N,
        )
    # each pair of the band's tile: key less row o + column - row, as j - i + max_seq_len - 1
    rel = (max_seq_len - 1 + o) + tl.arange(0, BLOCK_N)[None, :] - tl.arange(0, BLOCK_M)[:, None]
    in_table = (rel >= 0) & (rel < 2 * max_seq_len - 1)
    tl.atomic_add(position_grad_ptr + rel, acc, mask=(acc != 0.0) & in_table, sem="relaxed")


_dq = TunedLaunches(autotuned(_dq_kernel, DQ_CONFIGS, INTERPRETER_CONFIG, TUNING_KEY))
# (adds into the biases' gradients: zeroed before each trial)
_bias_grads = TunedLaunches(autotuned(
    _bias_grads_kernel, BIAS_CONFIGS, BIAS_INTERPRETER_CONFIG, BIAS_TUNING_KEY,
    reset_to_zero=["position_grad_ptr", "time_grad_ptr"],
))
