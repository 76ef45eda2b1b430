"""The pieces the HSTU attention kernels (triton_kernels.py) build their tiles from, shared
by the forward and both backward kernels: a sequence's bounds and a program's block, a
block's rows of one head, both biases of a tile looked up from their tables, the masks
(reference.py's), the ranges of key and query blocks a block meets, the run of tiles of
two time buckets at most (time_buckets.py), and the forward's SiLU-weighted product."""
import triton
import triton.language as tl

from ..autotune import interpreting
from .time_buckets import _gap_bucket, _two_bucket_blocks

# On a GPU, for 16-bit inputs, the hardware's tanh (relative error about 2^-11, below those
# inputs' rounding) for the sigmoid in one instruction instead of an exp and a division.
# The interpreter has none.
_FAST_MATH = tl.constexpr(not interpreting())


@triton.jit
def _sigmoid(x, scale, SIXTEEN_BIT: tl.constexpr):
    """scale · sigmoid(x) (the scale joins the tanh form's one multiply-add)."""
    if _FAST_MATH and SIXTEEN_BIT:
        tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [0.5 * x], dtype=tl.float32, is_pure=True, pack=1)
        half = 0.5 * scale
        return half * tanh + half
    return tl.sigmoid(x) * scale


@triton.jit
def _pair_buckets(rows, cols, t_rows, t_cols, max_seq_len, edges_ptr, num_buckets, threshold, TWO_BUCKETS: tl.constexpr):
    """(each pair's position index, its time bucket) of query rows `rows` against key rows
    `cols` of one sequence; t_rows, t_cols: their float64 timestamp offsets. TWO_BUCKETS, a
    tile whose gaps span two buckets at most (time_buckets._tile_bucket): the bucket is
    whether a pair's gap reaches `threshold` (the upper of the two), else the pair's own."""
    # j - i + max_seq_len - 1, with rows and columns (past a sequence's end too) kept below
    # max_seq_len so that it stays inside the table: an add per pair
    rel = tl.minimum(cols, max_seq_len - 1)[None, :] + (max_seq_len - 1 - tl.minimum(rows, max_seq_len - 1))[:, None]
    gap = tl.abs(t_rows[:, None] - t_cols[None, :])
    if TWO_BUCKETS:
        bucket = gap >= threshold
    else:
        bucket = _gap_bucket(gap, edges_ptr, num_buckets)
    return rel, bucket


@triton.jit
def _biases(
    rows, cols, t_rows, t_cols, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, threshold, low, high,
    TWO_BUCKETS: tl.constexpr,
):
    """(float32 sum of both biases, each pair's position index, its time bucket):
    _pair_buckets, and the biases looked up; TWO_BUCKETS: the time bias is `high` where a
    pair reaches the upper bucket, else `low`."""
    rel, bucket = _pair_buckets(rows, cols, t_rows, t_cols, max_seq_len, edges_ptr, num_buckets, threshold, TWO_BUCKETS)
    if TWO_BUCKETS:
        bias = tl.load(position_ptr + rel).to(tl.float32) + tl.where(bucket, high, low)
    else:
        # the two gathers summed as a pair along a third axis (the same float32 sum): Triton
        # moves a gathered tile into the product's layout through shared memory, and the
        # joined pair's sum is one such move where `a + b` makes one per gather
        bias = tl.sum(tl.join(tl.load(position_ptr + rel).to(tl.float32), tl.load(time_ptr + bucket).to(tl.float32)), axis=2)
    return bias, rel, bucket


@triton.jit
def _biased_scores(
    q, k, rows, cols, t_rows, t_cols, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, threshold, low, high,
    TWO_BUCKETS: tl.constexpr,
):
    """(float32 scores q · kᵀ plus both biases, each pair's position index, its time
    bucket): _biases with the product."""
    bias, rel, bucket = _biases(
        rows, cols, t_rows, t_cols, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, threshold, low, high,
        TWO_BUCKETS,
    )
    return tl.dot(q, tl.trans(k), input_precision="ieee" if q.dtype == tl.float32 else "tf32") + bias, rel, bucket


@triton.jit
def _allowed(rows, cols, n, history_end, context_len):
    """Whether each query row attends to each key row (reference.py's masks), made from two
    values per row so that a pair costs two comparisons: a row below n attends to the
    columns up to its limit (history_end - 1 for context and target rows, itself for
    history rows) and, outside the context, to its own column; a row past n to none. The
    limit and the own column are below n, so no column past n is allowed (the bias
    gradients' columns may be below 0)."""
    shared = (rows < context_len) | (rows >= history_end)
    limit = tl.where(shared, history_end - 1, rows)
    own = rows >= context_len
    allowed = (cols[None, :] <= limit[:, None]) | ((cols[None, :] == rows[:, None]) & own[:, None])
    return allowed & (rows < n)[:, None]


@triton.jit
def _counted(rows, row_live, cols, n, history_end, context_len, MASKED: tl.constexpr):
    """Which pairs of a tile count: _allowed's where the tile is MASKED, else (every pair
    of a live row attended to) the live rows'."""
    if MASKED:
        return _allowed(rows, cols, n, history_end, context_len)
    return tl.broadcast_to(row_live[:, None], (rows.shape[0], cols.shape[0]))


@triton.jit
def _sequence(offsets_ptr, targets_ptr, timestamps_ptr, b, HAS_TARGETS: tl.constexpr):
    """(start, length, history end, first timestamp) of sequence b."""
    start = tl.load(offsets_ptr + b)
    n = (tl.load(offsets_ptr + b + 1) - start).to(tl.int32)
    history_end = n
    if HAS_TARGETS:
        history_end = n - tl.load(targets_ptr + b).to(tl.int32)
    return start, n, history_end, tl.load(timestamps_ptr + start, mask=n > 0, other=0)


@triton.jit
def _head_rows(ptr, start, idx, live, heads, h, WIDTH: tl.constexpr, BLOCK_D: tl.constexpr):
    """(pointers, mask) of rows start + idx (where live) of head h of a (total, heads,
    WIDTH) tensor, BLOCK_D columns (those past WIDTH masked)."""
    cols = tl.arange(0, BLOCK_D)
    at = ptr + ((start + idx) * heads + h)[:, None] * WIDTH + cols[None, :]
    if WIDTH == BLOCK_D:
        return at, tl.broadcast_to(live[:, None], (idx.shape[0], BLOCK_D))
    return at, live[:, None] & (cols[None, :] < WIDTH)


@triton.jit
def _load_head_rows(ptr, start, idx, live, heads, h, WIDTH: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows start + idx of head h of a (total, heads, WIDTH) tensor, zeros where not live
    and past WIDTH."""
    at, mask = _head_rows(ptr, start, idx, live, heads, h, WIDTH, BLOCK_D)
    return tl.load(at, mask=mask, other=0)


@triton.jit
def _block_times(timestamps_ptr, start, t0, first, n, BLOCK: tl.constexpr):
    """(rows first .. first + BLOCK - 1 of a sequence of n rows at `start`, which are live,
    their timestamps as float64 offsets from t0)."""
    idx = first + tl.arange(0, BLOCK)
    live = idx < n
    return idx, live, (tl.load(timestamps_ptr + start + idx, mask=live, other=t0) - t0).to(tl.float64)


@triton.jit
def _head_rows_in(ptr, start, n, heads, h, WIDTH: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """A tensor descriptor of head h's rows of one sequence (n rows at `start`) of a
    (total, heads, WIDTH) tensor, read BLOCK rows at a time: a bulk copy into shared memory
    (the Tensor Memory Accelerator), zeros past the sequence's end and past WIDTH. Its
    rows must start 16 bytes apart, and the tensor at a multiple of 16 bytes
    (triton_kernels._rows_by_descriptor)."""
    return tl.make_tensor_descriptor(
        ptr + (start * heads + h) * WIDTH, shape=[n, WIDTH], strides=[heads * WIDTH, 1], block_shape=[BLOCK, BLOCK_D],
    )


@triton.jit
def _row_block(
    a_in, b_in, timestamps_ptr, start, t0, first, n, heads, h, A_WIDTH: tl.constexpr, B_WIDTH: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BY_DESCRIPTOR: tl.constexpr = False,
):
    """Rows first .. first + BLOCK - 1 of a sequence of n rows at `start`: (their indices,
    which are live, their head-h rows of a and of b, their timestamps as float64 offsets
    from t0). A key block's a and b are K and V; a query block's, Q and dO. a_in and b_in
    are the tensors' pointers, or (BY_DESCRIPTOR) their head-h rows' descriptors
    (_head_rows_in), which read zeros where the pointers' loads mask."""
    idx, live, t = _block_times(timestamps_ptr, start, t0, first, n, BLOCK)
    if BY_DESCRIPTOR:
        a = a_in.load([first, 0])
        b = b_in.load([first, 0])
    else:
        a = _load_head_rows(a_in, start, idx, live, heads, h, A_WIDTH, BLOCK_A)
        b = _load_head_rows(b_in, start, idx, live, heads, h, B_WIDTH, BLOCK_B)
    return idx, live, a, b, t


@triton.jit
def _program_block(
    offsets_ptr, targets_ptr, timestamps_ptr, heads, BLOCK: tl.constexpr, HAS_TARGETS: tl.constexpr, GROUP: tl.constexpr = 1,
):
    """(this program's first row, (first) head, sequence, its sequence's start, length,
    history end and first timestamp); a program takes GROUP consecutive heads."""
    groups = heads // GROUP
    b = tl.program_id(1) // groups
    start, n, history_end, t0 = _sequence(offsets_ptr, targets_ptr, timestamps_ptr, b, HAS_TARGETS)
    return tl.program_id(0) * BLOCK, tl.program_id(1) % groups * GROUP, b, start, n, history_end, t0


@triton.jit
def _live_range(t, live):
    """(least, greatest) of t where live."""
    return tl.min(tl.where(live, t, float("inf")), axis=0), tl.max(tl.where(live, t, float("-inf")), axis=0)


@triton.jit
def _two_bucket_run(
    ext_ptr, ext_blocks, b, t, live, first, end, edges_ptr, num_buckets, BLOCK: tl.constexpr, FROM_START: tl.constexpr,
    TWO_BUCKET_TILES: tl.constexpr,
):
    """For a program's rows of sequence b (timestamps t where live) and the unmasked blocks
    of BLOCK rows they meet, rows `first` (a multiple of BLOCK, or `end`) to `end`: (the
    row where the run of those blocks whose tiles span two time buckets at most ends
    (FROM_START: the run from `first`) or starts (else: the run to `end`), the run empty
    without TWO_BUCKET_TILES; the rows' least and greatest timestamp; the sequence's first
    extremes entry)."""
    lo, hi = _live_range(t, live)
    entry = b * ext_blocks
    split = first if FROM_START else end
    if TWO_BUCKET_TILES:
        split = tl.minimum(_two_bucket_blocks(
            ext_ptr, entry, tl.cdiv(first, BLOCK), tl.cdiv(end, BLOCK), lo, hi, edges_ptr, num_buckets, BLOCK, FROM_START,
        ) * BLOCK, end)
    return split, lo, hi, entry


@triton.jit
def _key_ranges(m0, n, history_end, context_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the query rows m0 .. m0 + BLOCK_M - 1: (the end of the key blocks that every one
    of them attends to in full, the end of the keys any of them attends to)."""
    causal_end = tl.minimum(m0 + BLOCK_M, n)
    end = tl.where(m0 < context_len, tl.maximum(history_end, causal_end), tl.maximum(causal_end, 0))
    full = tl.minimum(m0 + 1, history_end) // BLOCK_N * BLOCK_N
    return full, end


@triton.jit
def _query_ranges(n0, n, history_end, context_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the key rows n0 .. n0 + BLOCK_N - 1: (the first query block that may attend to
    them, the first from which every block attends to all of them)."""
    # query rows before the block attend to it only from the context (rows < context_len)
    first = tl.where(context_len > 0, 0, (n0 // BLOCK_M) * BLOCK_M)
    full = tl.where(n0 + BLOCK_N <= history_end, tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, n)
    return first, tl.maximum(full, first)


@triton.jit
def _attend(acc, q, k, v, bias, allowed, scale, MASKED: tl.constexpr):
    """acc plus one head's tile: SiLU(q · kᵀ + bias) · scale (where allowed) · v."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee" if q.dtype == tl.float32 else "tf32") + bias
    a = s * _sigmoid(s, scale, v.dtype != tl.float32)
    if MASKED:
        a = tl.where(allowed, a, 0.0)
    return acc + tl.dot(a.to(v.dtype), v, input_precision="ieee" if v.dtype == tl.float32 else "tf32")
