"""The Triton programs of HSTU attention on jagged sequences (launched by
triton_kernels.py, which states when each runs).

Forward (_forward_kernel): a program per block of BLOCK_M query rows of one sequence and
head (or of two consecutive heads, PAIR, which share the per-pair bias and mask work)
steps through the key blocks its rows may attend to, computing the scores in float32 with
the two biases either read as a tile from the pair biases' prepass (BIAS_TILES,
bias_tiles.py) or looked up from their tables per pair (no (L, L) tensor in memory), and
accumulates SiLU(scores) / max_seq_len · V. The grid is sized by max_seq_len, so no
length is read on the host; programs past their sequence's end return at once. With
ROWS_BY_DESCRIPTOR the blocks of rows a kernel reads per tile (K and V in the forward, Q
and dO in the dK dV kernel) come through tensor descriptors of a head's rows
(tiles._head_rows_in), else through pointers.
Backward: _backward_kv_kernel, a program per key block, recomputes the scores and gives
dK and dV, and with STORE_DS writes each tile's dS (the scores' gradient) into a buffer
(score_grads.py: dQ and the biases' gradients from it); _backward_q_kernel, a program per
query block, recomputes the scores once more for dQ and the biases' gradients where no
buffer is used.

Where the biases come from the prepass, the forward and the dK dV kernel load each unmasked
tile's biases one tile ahead through pointers (_prefetched_biases), so the products do not
wait for them; the masked tiles (the diagonal, a sequence's last block) read theirs where
they use them, through the descriptor.
Where the biases are computed per tile, each kernel walks its tiles in three loops: the
tiles whose every pair is allowed (wholly below the diagonal and inside the history) skip
the mask, and of those, the run farthest from the diagonal whose gaps span two time
buckets at most takes the bucket from one comparison per pair (TWO_BUCKET_TILES,
time_buckets.py); the rest (the diagonal, the targets, the context prefix, a sequence's
last partial block) compute the mask. Timestamps enter as float64 offsets from the
sequence's first one, exact below 2^53 time units, so each pair's gap is one float64
subtraction that rounds to float32 as the twin's int64 gap does.
"""
import triton
import triton.language as tl

from ..autotune import TunedLaunches, autotuned
from .bias_tiles import _pair_biases_slot
from .bias_grads import _add_bias_grads, _bias_grad_copy
from .score_grads import _row_length, _score_grads_at, _score_grads_slot
from .tiles import (
    _allowed, _attend, _biased_scores, _biases, _counted, _head_rows, _key_ranges, _load_head_rows, _program_block, _query_ranges,
    _head_rows_in, _row_block, _sigmoid, _two_bucket_run,
)
from .time_buckets import _tile_buckets, _tile_extremes

# blocks of query and key rows, warps and pipeline stages, tuned per head dims and length
CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
    for m, n, w, st in ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3))
]
INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
LARGEST_BLOCK = max(max(c.kwargs.values()) for c in CONFIGS)  # the timestamp extremes cover a sequence in such blocks
TUNING_KEY = ["DQK", "DV", "length_class"]  # length_class: max_seq_len's power of two


@triton.jit
def _tile_biases(biases_in, rows, cols, m0, n0, n, max_seq_len, BY_DESCRIPTOR: tl.constexpr):
    """A tile's float32 pair biases from the prepass's buffer (bias_tiles.py): biases_in is
    the sequence's descriptor (BY_DESCRIPTOR: a bulk copy into shared memory, read in the
    products' layout; past the sequence's end zeros), else its block's pointer."""
    if BY_DESCRIPTOR:
        bias = biases_in.load([m0, n0])
    else:
        at = biases_in + (rows * _row_length(max_seq_len))[:, None] + cols[None, :]
        bias = tl.load(at, mask=(rows < n)[:, None] & (cols < n)[None, :], other=0.0)
    return bias.to(tl.float32)


@triton.jit
def _biases_in(biases_ptr, b, n, max_seq_len, BY_DESCRIPTOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What _tile_biases reads sequence b's tiles through."""
    at = _pair_biases_slot(biases_ptr, b, max_seq_len)
    if BY_DESCRIPTOR:
        at = tl.make_tensor_descriptor(at, shape=[n, n], strides=[_row_length(max_seq_len), 1], block_shape=[BLOCK_M, BLOCK_N])
    return at


@triton.jit
def _prefetched_biases(at, live, ahead):
    """A tile of the prepass's pair biases loaded through pointers `at` (zeros where not
    live, none where not `ahead`): the tile after the one the products use. A descriptor's
    load waits for its data where it is issued, and Triton's pipeliner prefetches only the
    products' operands, so the biases of each unmasked tile are loaded while the tile
    before computes (benchmarks/hstu_attention.md, "The biases a tile ahead")."""
    # (not `live & ahead`: Triton's interpreter gives a tile `&` a scalar an integer type, no mask)
    return tl.load(at, mask=tl.where(ahead, live, False), other=0.0)


@triton.jit
def _forward_tile(
    acc, acc2, q, q2, rows, t_rows, n0, k_in, v_in, k2_in, v2_in, timestamps_ptr, start, t0, n, history_end, heads, h,
    position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, threshold, low, high, biases_in, m0,
    MASKED: tl.constexpr, TWO_BUCKETS: tl.constexpr, PAIR: tl.constexpr, BIAS_TILES: tl.constexpr,
    BY_DESCRIPTOR: tl.constexpr, ROWS_BY_DESCRIPTOR: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, given=0.0, GIVEN: tl.constexpr = False,
):
    """The tile of key rows n0 .. n0 + BLOCK_N - 1 added into head h's acc, and (PAIR) head
    h + 1's acc2: the biases and the mask are the heads' own, computed once for both, or
    (BIAS_TILES) read from the prepass's tile (bias_tiles.py), or (GIVEN) that tile loaded
    before (_prefetched_biases): biases_in is the sequence's descriptor (BY_DESCRIPTOR),
    else its block's pointer. k_in, v_in (k2_in, v2_in: head h + 1's) are K's and V's
    pointers, or (ROWS_BY_DESCRIPTOR) their heads' descriptors."""
    cols, col_live, k, v, t_cols = _row_block(
        k_in, v_in, timestamps_ptr, start, t0, n0, n, heads, h, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV, ROWS_BY_DESCRIPTOR,
    )
    if GIVEN:
        bias = given.to(tl.float32)
    elif BIAS_TILES:
        bias = _tile_biases(biases_in, rows, cols, m0, n0, n, max_seq_len, BY_DESCRIPTOR)
    else:
        bias, _, _ = _biases(
            rows, cols, t_rows, t_cols, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, threshold, low, high,
            TWO_BUCKETS,
        )
    allowed = None
    if MASKED:
        allowed = _allowed(rows, cols, n, history_end, context_len)
    acc = _attend(acc, q, k, v, bias, allowed, scale, MASKED)
    if PAIR:
        if ROWS_BY_DESCRIPTOR:
            k2 = k2_in.load([n0, 0])
            v2 = v2_in.load([n0, 0])
        else:
            k2 = _load_head_rows(k2_in, start, cols, col_live, heads, h + 1, DQK, BLOCK_DQK)
            v2 = _load_head_rows(v2_in, start, cols, col_live, heads, h + 1, DV, BLOCK_DV)
        acc2 = _attend(acc2, q2, k2, v2, bias, allowed, scale, MASKED)
    return acc, acc2


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, offsets_ptr, timestamps_ptr, targets_ptr, position_ptr, time_ptr, edges_ptr,
    thresholds_ptr, ext_ptr, ext_blocks, biases_ptr, heads, max_seq_len, num_buckets, context_len, scale, length_class,
    HAS_TARGETS: tl.constexpr, TWO_BUCKET_TILES: tl.constexpr, PAIR: tl.constexpr, BIAS_TILES: tl.constexpr,
    BY_DESCRIPTOR: tl.constexpr, ROWS_BY_DESCRIPTOR: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The output of a block of query rows of one head, or (PAIR) of two consecutive heads,
    which share the tiles' biases and masks; BIAS_TILES: the biases read from biases_ptr,
    the prepass's buffer (bias_tiles.py), through a descriptor of the sequence's block
    where BY_DESCRIPTOR; ROWS_BY_DESCRIPTOR: K's and V's blocks through descriptors of the
    heads' rows (tiles._head_rows_in)."""
    m0, h, b, start, n, history_end, t0 = _program_block(
        offsets_ptr, targets_ptr, timestamps_ptr, heads, BLOCK_M, HAS_TARGETS, 2 if PAIR else 1,
    )
    if m0 >= n:
        return
    biases_in = biases_ptr
    if BIAS_TILES:
        biases_in = _biases_in(biases_ptr, b, n, max_seq_len, BY_DESCRIPTOR, BLOCK_M, BLOCK_N)
    k_in, v_in, k2_in, v2_in = k_ptr, v_ptr, k_ptr, v_ptr
    if ROWS_BY_DESCRIPTOR:
        k_in = _head_rows_in(k_ptr, start, n, heads, h, DQK, BLOCK_N, BLOCK_DQK)
        v_in = _head_rows_in(v_ptr, start, n, heads, h, DV, BLOCK_N, BLOCK_DV)
        if PAIR:
            k2_in = _head_rows_in(k_ptr, start, n, heads, h + 1, DQK, BLOCK_N, BLOCK_DQK)
            v2_in = _head_rows_in(v_ptr, start, n, heads, h + 1, DV, BLOCK_N, BLOCK_DV)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_live = rows < n
    q = _load_head_rows(q_ptr, start, rows, row_live, heads, h, DQK, BLOCK_DQK)
    t_rows = (tl.load(timestamps_ptr + start + rows, mask=row_live, other=t0) - t0).to(tl.float64)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if PAIR:
        q2 = _load_head_rows(q_ptr, start, rows, row_live, heads, h + 1, DQK, BLOCK_DQK)
        acc2 = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    else:  # (unused)
        q2 = q
        acc2 = tl.zeros([1, 1], dtype=tl.float32)
    full, end = _key_ranges(m0, n, history_end, context_len, BLOCK_M, BLOCK_N)
    # the unmasked key blocks from the first: those whose tiles span two buckets at most, then the rest
    split, lo, hi, entry = _two_bucket_run(
        ext_ptr, ext_blocks, b, t_rows, row_live, 0, full, edges_ptr, num_buckets, BLOCK_N, True, TWO_BUCKET_TILES,
    )
    if TWO_BUCKET_TILES:
        # (each tile's block extremes are loaded while the tile before it computes)
        k_lo, k_hi = _tile_extremes(ext_ptr, entry, 0, BLOCK_N)
        for n0 in range(0, split, BLOCK_N):
            _, threshold, low, high = _tile_buckets(k_lo, k_hi, lo, hi, thresholds_ptr, time_ptr, edges_ptr, num_buckets)
            k_lo, k_hi = _tile_extremes(ext_ptr, entry, tl.minimum(n0 + BLOCK_N, split - BLOCK_N), BLOCK_N)
            acc, acc2 = _forward_tile(
                acc, acc2, q, q2, rows, t_rows, n0, k_in, v_in, k2_in, v2_in, timestamps_ptr, start, t0, n, history_end, heads, h,
                position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, threshold, low, high, biases_in,
                m0, False, True, PAIR, BIAS_TILES, BY_DESCRIPTOR, ROWS_BY_DESCRIPTOR, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
            )
    given = 0.0
    if BIAS_TILES:  # (no two-bucket tiles there: split is 0) the first unmasked tile's biases
        bias_at = _pair_biases_slot(biases_ptr, b, max_seq_len) + (rows * _row_length(max_seq_len))[:, None]
        bias_at += tl.arange(0, BLOCK_N)[None, :]
        given = _prefetched_biases(bias_at + split, row_live[:, None], split < full)
    for n0 in range(split, full, BLOCK_N):
        tile_biases = given
        if BIAS_TILES:
            given = _prefetched_biases(bias_at + (n0 + BLOCK_N), row_live[:, None], n0 + BLOCK_N < full)
        acc, acc2 = _forward_tile(
            acc, acc2, q, q2, rows, t_rows, n0, k_in, v_in, k2_in, v2_in, timestamps_ptr, start, t0, n, history_end, heads, h,
            position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, 0.0, 0.0, 0.0, biases_in, m0,
            False, False, PAIR, BIAS_TILES, BY_DESCRIPTOR, ROWS_BY_DESCRIPTOR, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
            tile_biases, BIAS_TILES,
        )
    for n0 in range(full, end, BLOCK_N):
        acc, acc2 = _forward_tile(
            acc, acc2, q, q2, rows, t_rows, n0, k_in, v_in, k2_in, v2_in, timestamps_ptr, start, t0, n, history_end, heads, h,
            position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, 0.0, 0.0, 0.0, biases_in, m0,
            True, False, PAIR, BIAS_TILES, BY_DESCRIPTOR, ROWS_BY_DESCRIPTOR, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
        )
    out_at, out_mask = _head_rows(out_ptr, start, rows, row_live, heads, h, DV, BLOCK_DV)
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    if PAIR:
        out2_at = _head_rows(out_ptr, start, rows, row_live, heads, h + 1, DV, BLOCK_DV)[0]
        tl.store(out2_at, acc2.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _score_grads(s, do, v, scale):
    """(A, dS) before the mask: the attention weights and the scores' gradient, given
    dO · Vᵀ's inputs."""
    sig = _sigmoid(s, 1.0, v.dtype != tl.float32)
    da = tl.dot(do, tl.trans(v), input_precision="ieee" if v.dtype == tl.float32 else "tf32")
    return s * sig * scale, da * sig * (1 + s * (1 - sig)) * scale


@triton.jit
def _backward_kv_tile(
    dk_acc, dv_acc, k, v, cols, col_live, t_cols, m0, n0, q_in, do_in, ds_out, timestamps_ptr, start, t0, n, history_end,
    heads, h, b, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, threshold, low, high,
    biases_in, MASKED: tl.constexpr, TWO_BUCKETS: tl.constexpr, STORE_DS: tl.constexpr, BY_DESCRIPTOR: tl.constexpr,
    BIAS_TILES: tl.constexpr, ROWS_BY_DESCRIPTOR: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, given=0.0, GIVEN: tl.constexpr = False,
):
    """dK and dV plus the query rows m0 .. m0 + BLOCK_M - 1's share; (STORE_DS) the tile's
    dS into ds_out: the sequence's descriptor (BY_DESCRIPTOR), else the buffer's pointer;
    (BIAS_TILES) the biases read through biases_in as the forward reads them, or (GIVEN)
    that tile loaded before (_prefetched_biases); q_in, do_in: Q's and dO's pointers, or
    (ROWS_BY_DESCRIPTOR) head h's descriptors."""
    rows, row_live, q, do, t_rows = _row_block(
        q_in, do_in, timestamps_ptr, start, t0, m0, n, heads, h, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV, ROWS_BY_DESCRIPTOR,
    )
    if BIAS_TILES:
        if GIVEN:
            bias = given.to(tl.float32)
        else:
            bias = _tile_biases(biases_in, rows, cols, m0, n0, n, max_seq_len, BY_DESCRIPTOR)
        s = tl.dot(q, tl.trans(k), input_precision="ieee" if q.dtype == tl.float32 else "tf32") + bias
    else:
        s, _, _ = _biased_scores(
            q, k, rows, cols, t_rows, t_cols, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, threshold, low, high,
            TWO_BUCKETS,
        )
    a, ds = _score_grads(s, do, v, scale)
    if MASKED:
        allowed = _allowed(rows, cols, n, history_end, context_len)
        a = tl.where(allowed, a, 0.0)
        ds = tl.where(allowed, ds, 0.0)
    if STORE_DS:  # (score_grads.py; masked pairs as 0, rows and columns past the sequence's end not written)
        if BY_DESCRIPTOR:
            ds_out.store([m0, n0], ds.to(ds_out.dtype))
        else:
            ds_at = _score_grads_at(ds_out, b, h, heads, rows, cols, max_seq_len)
            tl.store(ds_at, ds.to(ds_out.dtype.element_ty), mask=row_live[:, None] & col_live[None, :])
    dv_acc += tl.dot(tl.trans(a.to(do.dtype)), do, input_precision="ieee" if q.dtype == tl.float32 else "tf32")
    dk_acc += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision="ieee" if q.dtype == tl.float32 else "tf32")
    return dk_acc, dv_acc


@triton.jit
def _backward_kv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, ds_ptr, offsets_ptr, timestamps_ptr, targets_ptr, position_ptr, time_ptr,
    edges_ptr, thresholds_ptr, ext_ptr, ext_blocks, biases_ptr, heads, max_seq_len, num_buckets, context_len, scale,
    length_class, HAS_TARGETS: tl.constexpr, TWO_BUCKET_TILES: tl.constexpr, STORE_DS: tl.constexpr,
    BY_DESCRIPTOR: tl.constexpr, BIAS_TILES: tl.constexpr, ROWS_BY_DESCRIPTOR: tl.constexpr, DQK: tl.constexpr,
    DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dK and dV of a block of key rows: Σ over the query rows that attend to them; and
    (STORE_DS) each tile's dS written into ds_ptr's buffer (score_grads.py), through a
    tensor descriptor of the sequence's block of it where BY_DESCRIPTOR; BIAS_TILES: the
    biases read from biases_ptr, the pair biases' buffer (bias_tiles.py), through a
    descriptor where BY_DESCRIPTOR; ROWS_BY_DESCRIPTOR: Q's and dO's blocks through
    descriptors of head h's rows (tiles._head_rows_in)."""
    n0, h, b, start, n, history_end, t0 = _program_block(offsets_ptr, targets_ptr, timestamps_ptr, heads, BLOCK_N, HAS_TARGETS)
    if n0 >= n:
        return
    q_in, do_in = q_ptr, do_ptr
    if ROWS_BY_DESCRIPTOR:
        q_in = _head_rows_in(q_ptr, start, n, heads, h, DQK, BLOCK_M, BLOCK_DQK)
        do_in = _head_rows_in(do_ptr, start, n, heads, h, DV, BLOCK_M, BLOCK_DV)
    biases_in = biases_ptr
    if BIAS_TILES:
        biases_in = _biases_in(biases_ptr, b, n, max_seq_len, BY_DESCRIPTOR, BLOCK_M, BLOCK_N)
    cols, col_live, k, v, t_cols = _row_block(k_ptr, v_ptr, timestamps_ptr, start, t0, n0, n, heads, h, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    if STORE_DS and BY_DESCRIPTOR:  # (tiles past the sequence's end are clipped at its length)
        ds_out = tl.make_tensor_descriptor(
            _score_grads_slot(ds_ptr, b, h, heads, max_seq_len), shape=[n, n], strides=[_row_length(max_seq_len), 1],
            block_shape=[BLOCK_M, BLOCK_N],
        )
    else:
        ds_out = ds_ptr
    first, full = _query_ranges(n0, n, history_end, context_len, BLOCK_M, BLOCK_N)
    for m0 in range(first, tl.minimum(full, n), BLOCK_M):
        dk_acc, dv_acc = _backward_kv_tile(
            dk_acc, dv_acc, k, v, cols, col_live, t_cols, m0, n0, q_in, do_in, ds_out, timestamps_ptr, start, t0, n,
            history_end, heads, h, b, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, 0.0, 0.0, 0.0,
            biases_in, True, False, STORE_DS, BY_DESCRIPTOR, BIAS_TILES, ROWS_BY_DESCRIPTOR, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV,
        )
    # the unmasked query blocks: the rest, then those to the last whose tiles span two buckets at most
    split, lo, hi, entry = _two_bucket_run(
        ext_ptr, ext_blocks, b, t_cols, col_live, full, n, edges_ptr, num_buckets, BLOCK_M, False, TWO_BUCKET_TILES,
    )
    given = 0.0
    if BIAS_TILES:  # (no two-bucket tiles there: split is n) the first unmasked tile's biases
        row_len = _row_length(max_seq_len)
        tile_rows = tl.arange(0, BLOCK_M)[:, None]
        bias_at = _pair_biases_slot(biases_ptr, b, max_seq_len) + tile_rows * row_len + cols[None, :]
        given = _prefetched_biases(bias_at + full * row_len, full + tile_rows < n, full < split)
    for m0 in range(full, split, BLOCK_M):
        tile_biases = given
        if BIAS_TILES:
            given = _prefetched_biases(bias_at + (m0 + BLOCK_M) * row_len, m0 + BLOCK_M + tile_rows < n, m0 + BLOCK_M < split)
        dk_acc, dv_acc = _backward_kv_tile(
            dk_acc, dv_acc, k, v, cols, col_live, t_cols, m0, n0, q_in, do_in, ds_out, timestamps_ptr, start, t0, n,
            history_end, heads, h, b, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, 0.0, 0.0, 0.0,
            biases_in, False, False, STORE_DS, BY_DESCRIPTOR, BIAS_TILES, ROWS_BY_DESCRIPTOR, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV,
            tile_biases, BIAS_TILES,
        )
    if TWO_BUCKET_TILES:
        last = (tl.cdiv(n, BLOCK_M) - 1) * BLOCK_M  # (the last query block: no extremes are read past it)
        q_lo, q_hi = _tile_extremes(ext_ptr, entry, tl.minimum(split, last), BLOCK_M)  # (a tile ahead, as the forward)
        for m0 in range(split, n, BLOCK_M):
            _, threshold, low, high = _tile_buckets(q_lo, q_hi, lo, hi, thresholds_ptr, time_ptr, edges_ptr, num_buckets)
            q_lo, q_hi = _tile_extremes(ext_ptr, entry, tl.minimum(m0 + BLOCK_M, last), BLOCK_M)
            dk_acc, dv_acc = _backward_kv_tile(
                dk_acc, dv_acc, k, v, cols, col_live, t_cols, m0, n0, q_in, do_in, ds_out, timestamps_ptr, start, t0, n,
                history_end, heads, h, b, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, threshold, low, high,
                biases_in, False, True, STORE_DS, BY_DESCRIPTOR, BIAS_TILES, ROWS_BY_DESCRIPTOR, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV,
            )
    dk_at, dk_mask = _head_rows(dk_ptr, start, cols, col_live, heads, h, DQK, BLOCK_DQK)
    tl.store(dk_at, dk_acc.to(dk_ptr.dtype.element_ty), mask=dk_mask)
    dv_at, dv_mask = _head_rows(dv_ptr, start, cols, col_live, heads, h, DV, BLOCK_DV)
    tl.store(dv_at, dv_acc.to(dv_ptr.dtype.element_ty), mask=dv_mask)


@triton.jit
def _backward_q_tile(
    dq_acc, q, do, rows, row_live, t_rows, n0, k_ptr, v_ptr, timestamps_ptr, start, t0, n, history_end, heads, h,
    position_ptr, time_ptr, edges_ptr, position_grad_ptr, time_grad_ptr, max_seq_len, num_buckets, context_len, scale,
    tile_bucket, threshold, low, high, MASKED: tl.constexpr, TWO_BUCKETS: tl.constexpr, BIAS_GRADS: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    cols, _, k, v, t_cols = _row_block(k_ptr, v_ptr, timestamps_ptr, start, t0, n0, n, heads, h, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV)
    s, rel, bucket = _biased_scores(
        q, k, rows, cols, t_rows, t_cols, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, threshold, low, high,
        TWO_BUCKETS,
    )
    _, ds = _score_grads(s, do, v, scale)
    counted = _counted(rows, row_live, cols, n, history_end, context_len, MASKED)
    if MASKED:  # (else rows past the sequence's end have dS 0: they add nothing)
        ds = tl.where(counted, ds, 0.0)
    if BIAS_GRADS:
        copy = _bias_grad_copy(max_seq_len, num_buckets)
        _add_bias_grads(
            position_grad_ptr + copy, time_grad_ptr + copy, ds, rel, bucket, counted, rows, cols, t_rows, n0, timestamps_ptr,
            start, t0, n, history_end, context_len, edges_ptr, num_buckets, tile_bucket, MASKED, TWO_BUCKETS, BLOCK_N,
        )
    return dq_acc + tl.dot(ds.to(k.dtype), k, input_precision="ieee" if k.dtype == tl.float32 else "tf32")


@triton.jit
def _backward_q_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, offsets_ptr, timestamps_ptr, targets_ptr, position_ptr, time_ptr, edges_ptr,
    position_grad_ptr, time_grad_ptr, thresholds_ptr, ext_ptr, ext_blocks, heads, max_seq_len, num_buckets, context_len,
    scale, length_class, HAS_TARGETS: tl.constexpr, TWO_BUCKET_TILES: tl.constexpr, BIAS_GRADS: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dQ of a block of query rows, and (BIAS_GRADS) its pairs' share of the biases'
    gradients."""
    m0, h, b, start, n, history_end, t0 = _program_block(offsets_ptr, targets_ptr, timestamps_ptr, heads, BLOCK_M, HAS_TARGETS)
    if m0 >= n:
        return
    rows, row_live, q, do, t_rows = _row_block(q_ptr, do_ptr, timestamps_ptr, start, t0, m0, n, heads, h, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV)
    dq_acc = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    full, end = _key_ranges(m0, n, history_end, context_len, BLOCK_M, BLOCK_N)
    # as the forward: the unmasked key blocks whose tiles span two buckets at most, then the rest
    split, lo, hi, entry = _two_bucket_run(
        ext_ptr, ext_blocks, b, t_rows, row_live, 0, full, edges_ptr, num_buckets, BLOCK_N, True, TWO_BUCKET_TILES,
    )
    if TWO_BUCKET_TILES:
        k_lo, k_hi = _tile_extremes(ext_ptr, entry, 0, BLOCK_N)  # (a tile ahead, as the forward)
        for n0 in range(0, split, BLOCK_N):
            tile_bucket, threshold, low, high = _tile_buckets(k_lo, k_hi, lo, hi, thresholds_ptr, time_ptr, edges_ptr, num_buckets)
            k_lo, k_hi = _tile_extremes(ext_ptr, entry, tl.minimum(n0 + BLOCK_N, split - BLOCK_N), BLOCK_N)
            dq_acc = _backward_q_tile(
                dq_acc, q, do, rows, row_live, t_rows, n0, k_ptr, v_ptr, timestamps_ptr, start, t0, n, history_end, heads, h,
                position_ptr, time_ptr, edges_ptr, position_grad_ptr, time_grad_ptr, max_seq_len, num_buckets, context_len,
                scale, tile_bucket, threshold, low, high, False, True, BIAS_GRADS, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
            )
    for n0 in range(split, full, BLOCK_N):
        dq_acc = _backward_q_tile(
            dq_acc, q, do, rows, row_live, t_rows, n0, k_ptr, v_ptr, timestamps_ptr, start, t0, n, history_end, heads, h,
            position_ptr, time_ptr, edges_ptr, position_grad_ptr, time_grad_ptr, max_seq_len, num_buckets, context_len, scale,
            0, 0.0, 0.0, 0.0, False, False, BIAS_GRADS, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
        )
    for n0 in range(full, end, BLOCK_N):
        dq_acc = _backward_q_tile(
            dq_acc, q, do, rows, row_live, t_rows, n0, k_ptr, v_ptr, timestamps_ptr, start, t0, n, history_end, heads, h,
            position_ptr, time_ptr, edges_ptr, position_grad_ptr, time_grad_ptr, max_seq_len, num_buckets, context_len, scale,
            0, 0.0, 0.0, 0.0, True, False, BIAS_GRADS, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
        )
    dq_at, dq_mask = _head_rows(dq_ptr, start, rows, row_live, heads, h, DQK, BLOCK_DQK)
    tl.store(dq_at, dq_acc.to(dq_ptr.dtype.element_ty), mask=dq_mask)


# (tuned apart where the biases come from the prepass's tiles: another kernel)
_forward = TunedLaunches(autotuned(_forward_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY + ["PAIR", "BIAS_TILES", "ROWS_BY_DESCRIPTOR"]))
_backward_kv = TunedLaunches(autotuned(_backward_kv_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY + ["STORE_DS", "BIAS_TILES", "ROWS_BY_DESCRIPTOR"]))
# (adds into the biases' gradients: zeroed before each trial)
_backward_q = TunedLaunches(autotuned(
    _backward_q_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY, reset_to_zero=["position_grad_ptr", "time_grad_ptr"]
))
