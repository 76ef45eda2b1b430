"""How the attention's backward kernels add a tile's score gradients (dS) into the two bias
tables' gradients: the position gradient by one atomic add per pair at its index (the
stored-dS kernel first sums the tiles of a band, score_grads.py), the time gradient by two
sums per tile where the tile spans two buckets at most (the stored-dS kernel sums a run
of such tiles of the same buckets first), else by runs of equal buckets along each row.
Both go into BIAS_GRAD_COPIES copies of each table, a program into copy (its linear id
mod BIAS_GRAD_COPIES), summed after the launch: with one copy, programs adding at the
same positions or buckets at once wait on each other's adds."""
import triton
import triton.language as tl

from .tiles import _allowed
from .time_buckets import _gap_bucket

BIAS_GRAD_COPIES = tl.constexpr(64)


@triton.jit
def _bias_grad_copy(max_seq_len, num_buckets):
    """The offset of this program's copy in the copies' tensor, whose rows hold both
    gradients (2 · max_seq_len - 1 position entries, then num_buckets + 1 time entries)."""
    linear = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    return linear % BIAS_GRAD_COPIES * (2 * max_seq_len + num_buckets)


@triton.jit
def _add_time_grads_by_runs(grad_ptr, ds, bucket, next_bucket):
    """Adds each time bucket's sum of ds into grad_ptr, a row's pairs taken as runs of
    equal buckets along the columns: a run's sum is the row's running sum at its last
    column less that at the column before its first, so where the bucket changes the
    running sum goes into the bucket that ends and out of the one that starts. bucket: -1
    where a pair is not counted (its ds is 0); next_bucket: the next column's, -2 past
    the tile's last. Where timestamps grow along a sequence a row's buckets fall in runs:
    a tile makes two atomic adds per run and row, however many buckets it spans."""
    run = tl.cumsum(ds, axis=1)
    change = bucket != next_bucket
    tl.atomic_add(grad_ptr + bucket, run, mask=change & (bucket >= 0), sem="relaxed")
    tl.atomic_add(grad_ptr + next_bucket, -run, mask=change & (next_bucket >= 0), sem="relaxed")


@triton.jit
def _add_bucket_pair_sums(grad_ptr, low, high, bucket, num_buckets):
    """Adds the sum of tile `low` into grad_ptr at `bucket` and that of `high` at `bucket` +
    1 (none where bucket < 0): summed along rows within each warp, then across warps in
    one reduction."""
    sums = tl.sum(tl.join(tl.sum(low, axis=1), tl.sum(high, axis=1)), axis=0)
    at = bucket + tl.arange(0, 2)
    # (not `(bucket >= 0) & ...`: Triton's interpreter gives a tensor `&` a scalar an integer type, no mask)
    tl.atomic_add(grad_ptr + at, sums, mask=tl.where(bucket >= 0, at <= num_buckets, False), sem="relaxed")


@triton.jit
def _add_two_bucket_grads(grad_ptr, ds, upper, bucket, num_buckets):
    """Adds the sums of ds over a tile's pairs of bucket `bucket` and of `bucket` + 1
    (upper) into grad_ptr."""
    _add_bucket_pair_sums(grad_ptr, tl.where(upper, 0.0, ds), tl.where(upper, ds, 0.0), bucket, num_buckets)


@triton.jit
def _add_bias_grads(
    position_grad_ptr, time_grad_ptr, ds, rel, bucket, counted, rows, cols, t_rows, n0, timestamps_ptr, start, t0, n,
    history_end, context_len, edges_ptr, num_buckets, tile_bucket, MASKED: tl.constexpr, TWO_BUCKETS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Adds a tile's ds (0 where a pair is not counted) into the gradients at this
    program's copy: rel and bucket as tiles._pair_buckets gives them, the time gradient
    as _add_time_grads adds it."""
    tl.atomic_add(position_grad_ptr + rel, ds, mask=counted, sem="relaxed")
    _add_time_grads(
        time_grad_ptr, ds, bucket, counted, rows, cols, t_rows, n0, timestamps_ptr, start, t0, n, history_end, context_len,
        edges_ptr, num_buckets, tile_bucket, MASKED, TWO_BUCKETS, BLOCK_N,
    )


@triton.jit
def _add_time_grads(
    time_grad_ptr, ds, bucket, counted, rows, cols, t_rows, n0, timestamps_ptr, start, t0, n, history_end, context_len,
    edges_ptr, num_buckets, tile_bucket, MASKED: tl.constexpr, TWO_BUCKETS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Adds a tile's ds (0 where a pair is not counted) into the time gradient at this
    program's copy: columns cols = n0 .. n0 + BLOCK_N - 1 (some below 0 where MASKED),
    bucket as tiles._pair_buckets gives it (TWO_BUCKETS: whether a pair is in tile_bucket +
    1, else tile_bucket), counted as tiles._allowed (MASKED) or the live rows."""
    if TWO_BUCKETS:  # (an unmasked tile: ds is 0 where not counted)
        _add_two_bucket_grads(time_grad_ptr, ds, bucket, tile_bucket, num_buckets)
    else:
        # each pair's next column's bucket (the tile's last column's next lies past it)
        after = cols + 1
        after_live = (after >= 0) & (after < n)
        t_after = (tl.load(timestamps_ptr + start + after, mask=after_live, other=t0) - t0).to(tl.float64)
        after_bucket = _gap_bucket(tl.abs(t_rows[:, None] - t_after[None, :]), edges_ptr, num_buckets)
        if MASKED:
            counted_after = _allowed(rows, after, n, history_end, context_len) & after_live[None, :]
        else:  # (every pair of a live row is counted)
            counted_after = counted
        after_bucket = tl.where(counted_after, after_bucket, -1)
        after_bucket = tl.where((after == n0 + BLOCK_N)[None, :], -2, after_bucket)
        _add_time_grads_by_runs(time_grad_ptr, ds, tl.where(counted, bucket, -1), after_bucket)
