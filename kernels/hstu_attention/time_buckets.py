"""The time bias's bucket inside the attention kernels (triton_kernels.py), per pair and per
tile.

Per pair (_time_bucket): the twin's bucket of a float32 gap, from the hardware's
approximate log2, made exact near bucket edges by comparing the gap with the edge.

Per tile: a tile whose gaps all fall in one or two consecutive buckets needs no log. Its
gaps lie between the least and the greatest distance of its rows' timestamps to its
columns' ones, which come from the extremes of each block of EXTREMES_BLOCK rows (a
prepass, timestamp_extremes); if the buckets of those two distances are b and b + 1 at
most, each pair's bucket is b, or b + 1 where its exact float64 gap reaches the least
whole gap of bucket b + 1 (bucket_thresholds). Far from the diagonal, with timestamps
growing along a sequence, most tiles are such tiles: the kernels run the blocks that are
(the longest run of them from the far end, _two_bucket_blocks) in a loop of their own.
"""
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..autotune import interpreting
from ..launch import cdiv, launch
from .reference import TIME_BUCKET_LOG, time_bucket_edges

EXTREMES_BLOCK = tl.constexpr(32)  # rows per entry of the extremes (divides every BLOCK_M and BLOCK_N)
EXTREMES_PER_PROGRAM = 8  # entries the prepass computes per program
SCAN_CHUNK = tl.constexpr(64)  # blocks _two_bucket_blocks classifies at a time
# On a GPU, the hardware's approximate log2 (tl.log2 is a polynomial of a dozen multiplies
# per pair; the bucket is then made exact). The interpreter has none.
_FAST_MATH = tl.constexpr(not interpreting())
_LOG2_TO_BUCKET = tl.constexpr(math.log(2) / TIME_BUCKET_LOG)  # log(gap) / TIME_BUCKET_LOG = log2(gap) · this
# log2(gap) · _LOG2_TO_BUCKET is within 1e-5 of the exact value (the approximate log2 and
# float32 rounding): a pair this close to a whole number is placed by its bucket's edge
_NEAR_EDGE = tl.constexpr(1e-3)
_ROUNDER = tl.constexpr(1.5 * 2**23)  # x + this keeps round(x) in the sum's low bits (|x| < 2^22)
_ROUNDER_BITS = tl.constexpr(0x4B400000)  # the float32 bits of _ROUNDER
_EXACT_BELOW = 2**53  # gaps float64 holds exactly


@triton.jit
def _whole(x):
    """(x rounded to the nearest whole number as float32, and as int32) for |x| < 2^22:
    adding 1.5 · 2^23 leaves the rounded value in the low bits of the sum, whose bits less
    the constant's are the integer; two adds and an integer subtraction, where floor and
    float-to-int conversions run on the multiprocessor's quarter-rate unit."""
    y = x + _ROUNDER
    return y - _ROUNDER, y.to(tl.int32, bitcast=True) - _ROUNDER_BITS


@triton.jit
def _time_bucket(gap, edges_ptr, num_buckets):
    """The twin's bucket of float32 gaps >= 1: floor of an approximate log, and where that
    is near a whole number r, by comparing the gap with bucket r's least gap (edges_ptr:
    reference.time_bucket_edges in float32). Away from whole numbers, rounding x - 0.5 is
    the floor."""
    if _FAST_MATH:
        x = libdevice.fast_log2f(gap) * _LOG2_TO_BUCKET
    else:
        x = tl.log2(gap) * _LOG2_TO_BUCKET
    nearest, r = _whole(x)
    near = tl.abs(x - nearest) < _NEAR_EDGE
    edge = tl.load(edges_ptr + tl.minimum(r, num_buckets + 1), mask=near, other=0.0)
    bucket = tl.where(near, r - (gap < edge).to(tl.int32), _whole(x - 0.5)[1])
    return tl.minimum(bucket, num_buckets)


@triton.jit
def _gap_bucket(gap, edges_ptr, num_buckets):
    """The bucket of float64 gaps (>= 0), as the twin buckets its int64 ones."""
    return _time_bucket(tl.maximum(gap.to(tl.float32), 1.0), edges_ptr, num_buckets)


@triton.jit
def _extremes_kernel(offsets_ptr, timestamps_ptr, ext_ptr, blocks, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """ext[b, k] = (least, greatest) timestamp of rows k · ROWS .. k · ROWS + ROWS - 1 of
    sequence b, as float64 offsets from its first timestamp ((+inf, -inf) where no row is
    live); GROUP entries a program."""
    b = tl.program_id(1)
    start = tl.load(offsets_ptr + b)
    n = tl.load(offsets_ptr + b + 1) - start
    k = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    rows = k[:, None] * ROWS + tl.arange(0, ROWS)[None, :]
    live = rows < n
    t0 = tl.load(timestamps_ptr + start, mask=n > 0, other=0)
    t = (tl.load(timestamps_ptr + start + rows, mask=live, other=t0) - t0).to(tl.float64)
    at = ext_ptr + (b * blocks + k) * 2
    tl.store(at, tl.min(tl.where(live, t, float("inf")), axis=1), mask=k < blocks)
    tl.store(at + 1, tl.max(tl.where(live, t, float("-inf")), axis=1), mask=k < blocks)


def timestamp_extremes(offsets: torch.Tensor, timestamps: torch.Tensor, max_seq_len: int, span: int) -> torch.Tensor:
    """(B, blocks, 2) float64: each block of EXTREMES_BLOCK rows of each sequence, its least
    and greatest timestamp less the sequence's first ((+inf, -inf) for a block past the
    sequence's end); blocks cover max_seq_len rounded up to a multiple of span."""
    sequences, blocks = offsets.numel() - 1, cdiv(max_seq_len, span) * span // EXTREMES_BLOCK.value
    ext = torch.empty(sequences, blocks, 2, dtype=torch.float64, device=offsets.device)
    if ext.numel():
        launch(
            _extremes_kernel, (cdiv(blocks, EXTREMES_PER_PROGRAM), sequences),
            offsets, timestamps, ext, blocks, GROUP=EXTREMES_PER_PROGRAM, ROWS=EXTREMES_BLOCK,
        )
    return ext


def bucket_thresholds(num_buckets: int) -> list[float]:
    """For b = 0 .. num_buckets + 1, the least whole gap whose bucket is b or more: the
    least whole number that float32 rounds to bucket b's edge or above (edges past 2^53,
    where float64 gaps are not exact, as they are; none for bucket 0, never reached past
    the last)."""
    edges = torch.tensor(time_bucket_edges(num_buckets)[1 : num_buckets + 1], dtype=torch.float32)
    exact = edges.double() < _EXACT_BELOW
    lo = torch.zeros(num_buckets, dtype=torch.int64)
    hi = torch.where(exact, edges.double(), 0).to(torch.int64)
    while bool((lo < hi).any()):  # bisection: float32 rounding of whole numbers is monotone
        mid = (lo + hi) // 2
        reaches = mid.to(torch.float32) >= edges
        hi, lo = torch.where(reaches, mid, hi), torch.where(reaches, lo, mid + 1)
    least = torch.where(exact, lo.double(), edges.double())
    return [0.0, *least.tolist(), math.inf]


@triton.jit
def _block_extremes(ext_ptr, entry, live, PER_BLOCK: tl.constexpr):
    """(least, greatest) timestamp of the blocks whose first extremes entry is `entry` (of
    PER_BLOCK entries each), where live."""
    lo = tl.load(ext_ptr + entry * 2, mask=live, other=0.0)
    hi = tl.load(ext_ptr + entry * 2 + 1, mask=live, other=0.0)
    for s in tl.static_range(1, PER_BLOCK):
        lo = tl.minimum(lo, tl.load(ext_ptr + (entry + s) * 2, mask=live, other=0.0))
        hi = tl.maximum(hi, tl.load(ext_ptr + (entry + s) * 2 + 1, mask=live, other=0.0))
    return lo, hi


@triton.jit
def _distances(lo_a, hi_a, lo_b, hi_b):
    """(least, greatest) |x - y| for x in [lo_a, hi_a] and y in [lo_b, hi_b]."""
    least = tl.maximum(tl.maximum(lo_b - hi_a, lo_a - hi_b), 0.0)
    return least, tl.maximum(hi_a - lo_b, hi_b - lo_a)


@triton.jit
def _two_bucket_blocks(
    ext_ptr, seq_entry, first, end, lo, hi, edges_ptr, num_buckets, BLOCK: tl.constexpr, FROM_START: tl.constexpr,
):
    """Of the blocks first .. end - 1 of BLOCK rows of a sequence (its extremes from entry
    seq_entry), paired with rows whose timestamps lie in [lo, hi]: FROM_START, the end of
    the run of blocks from `first` whose tiles span two buckets at most; else the start of
    such a run that ends at `end`."""
    PER_BLOCK: tl.constexpr = BLOCK // EXTREMES_BLOCK
    split = end if FROM_START else first
    for c in range(first, end, SCAN_CHUNK):
        j = c + tl.arange(0, SCAN_CHUNK)
        live = j < end
        b_lo, b_hi = _block_extremes(ext_ptr, seq_entry + j * PER_BLOCK, live, PER_BLOCK)
        least, most = _distances(lo, hi, tl.where(live, b_lo, lo), tl.where(live, b_hi, hi))
        wide = live & (_gap_bucket(most, edges_ptr, num_buckets) - _gap_bucket(least, edges_ptr, num_buckets) > 1)
        if FROM_START:
            split = tl.minimum(split, tl.min(tl.where(wide, j, end), axis=0))
        else:
            split = tl.maximum(split, tl.max(tl.where(wide, j + 1, first), axis=0))
    return split


@triton.jit
def _tile_extremes(ext_ptr, entry, first, BLOCK: tl.constexpr):
    """(least, greatest) timestamp of the block of BLOCK rows from row `first` of the
    sequence whose extremes start at entry `entry`."""
    at = entry + first // EXTREMES_BLOCK
    return _block_extremes(ext_ptr, at, at >= 0, BLOCK // EXTREMES_BLOCK)


@triton.jit
def _rows_extremes(ext_ptr, entry, first, last, live, BLOCK: tl.constexpr):
    """(least, greatest) timestamp of the blocks that hold rows first .. last (at most
    BLOCK rows, first >= 0) of the sequence whose extremes start at entry `entry`, for
    tensors first and last of such ranges, where live ((+inf, -inf) elsewhere)."""
    at = first // EXTREMES_BLOCK
    lo = tl.load(ext_ptr + (entry + at) * 2, mask=live, other=float("inf"))
    hi = tl.load(ext_ptr + (entry + at) * 2 + 1, mask=live, other=float("-inf"))
    for s in tl.static_range(1, (BLOCK - 1) // EXTREMES_BLOCK + 2):  # (the blocks BLOCK rows may meet)
        meets = live & (at + s <= last // EXTREMES_BLOCK)
        lo = tl.minimum(lo, tl.load(ext_ptr + (entry + at + s) * 2, mask=meets, other=float("inf")))
        hi = tl.maximum(hi, tl.load(ext_ptr + (entry + at + s) * 2 + 1, mask=meets, other=float("-inf")))
    return lo, hi


@triton.jit
def _tile_bucket(b_lo, b_hi, lo, hi, thresholds_ptr, edges_ptr, num_buckets):
    """For the tile of a block whose timestamps lie in [b_lo, b_hi] (_tile_extremes) against
    rows whose timestamps lie in [lo, hi], a tile that spans two buckets at most
    (_two_bucket_blocks): (its lower bucket b, the least whole gap of bucket b + 1 as
    float64)."""
    least, _ = _distances(lo, hi, b_lo, b_hi)
    bucket = _gap_bucket(least, edges_ptr, num_buckets)
    return bucket, tl.load(thresholds_ptr + bucket + 1)


@triton.jit
def _tile_buckets(b_lo, b_hi, lo, hi, thresholds_ptr, time_ptr, edges_ptr, num_buckets):
    """_tile_bucket, and the biases of b and of b + 1."""
    bucket, threshold = _tile_bucket(b_lo, b_hi, lo, hi, thresholds_ptr, edges_ptr, num_buckets)
    low = tl.load(time_ptr + bucket).to(tl.float32)
    high = tl.load(time_ptr + tl.minimum(bucket + 1, num_buckets)).to(tl.float32)
    return bucket, threshold, low, high
