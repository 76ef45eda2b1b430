"""Kernels of a group of tables trained together (see collection.py): initial rows made
in the kernel, gathers, and the gradient sum over ids sorted by their row.

Rows are addressed as packed (table << SLOT_BITS) | slot; tables through descriptors.
"""
import triton
import triton.language as tl

from .triton_optimizers import SLOT_BITS
from .triton_table import _VALUES, _field, _hash


@triton.jit
def _initial_embedding(key, seed, scale, cols):
    """hashing.uniform_from_keys(key, ., seed) mapped to (-scale, scale), as
    DynamicEmbedding.initial_rows does in float64, then float32: (BLOCK, len(cols))."""
    h = _hash(key ^ seed)
    mixed = _hash((h[:, None] + cols[None, :].to(tl.uint64)).to(tl.int64, bitcast=True))
    u = ((mixed >> 11) & ((1 << 53) - 1)).to(tl.float64) * (1.0 / (1 << 53))
    return ((2.0 * u - 1.0) * scale[:, None]).to(tl.float32)


@triton.jit
def _init_rows_kernel(
    key_ptr, tid_ptr, slot_ptr, inserted_ptr, n, desc_ptr, seed_ptr, scale_ptr, dim, row_dim, row_stride,
    BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr,
):
    """Rows of keys this call inserted: their initial embedding, optimizer state zero."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = (offs < n) & (tl.load(inserted_ptr + offs, mask=offs < n, other=0) != 0)
    if tl.max(live.to(tl.int32), axis=0) > 0:  # most programs have no new key
        key = tl.load(key_ptr + offs, mask=live, other=0)
        t = tl.load(tid_ptr + offs, mask=live, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + offs, mask=live, other=0)
        row = _field(desc_ptr, t, _VALUES).to(tl.pointer_type(tl.float32)) + slot * row_stride
        seed, scale = tl.load(seed_ptr + t, mask=live, other=0), tl.load(scale_ptr + t, mask=live, other=0.0)
        for c in range(0, dim, DIM_BLOCK):
            cols = c + tl.arange(0, DIM_BLOCK)
            value = _initial_embedding(key, seed, scale, cols)
            tl.store(row[:, None] + cols[None, :], value, mask=live[:, None] & (cols[None, :] < dim))
        for c in range(dim, row_dim, DIM_BLOCK):
            cols = c + tl.arange(0, DIM_BLOCK)
            zero = tl.zeros([BLOCK, DIM_BLOCK], dtype=tl.float32)
            tl.store(row[:, None] + cols[None, :], zero, mask=live[:, None] & (cols[None, :] < row_dim))


@triton.jit
def _gather_kernel(
    key_ptr, tid_ptr, slot_ptr, todo_ptr, n, desc_ptr, seed_ptr, scale_ptr, out_ptr, dim, row_stride,
    BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr,
):
    """out[i] = the embedding of key i's row where todo[i]; keys without a row (slot < 0)
    get their initial embedding."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = (offs < n) & (tl.load(todo_ptr + offs, mask=offs < n, other=0) != 0)
    if tl.max(live.to(tl.int32), axis=0) > 0:  # most programs were served by the probe
        key = tl.load(key_ptr + offs, mask=live, other=0)
        t = tl.load(tid_ptr + offs, mask=live, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + offs, mask=live, other=-1)
        stored = live & (slot >= 0)
        row = _field(desc_ptr, t, _VALUES).to(tl.pointer_type(tl.float32)) + slot * row_stride
        seed, scale = tl.load(seed_ptr + t, mask=live, other=0), tl.load(scale_ptr + t, mask=live, other=0.0)
        unstored = tl.max((live & ~stored).to(tl.int32), axis=0) > 0
        for c in range(0, dim, DIM_BLOCK):
            cols = c + tl.arange(0, DIM_BLOCK)
            in_dim = cols[None, :] < dim
            value = tl.load(row[:, None] + cols[None, :], mask=stored[:, None] & in_dim)
            if unstored:
                value = tl.where(stored[:, None], value, _initial_embedding(key, seed, scale, cols))
            tl.store(out_ptr + offs[:, None].to(tl.int64) * dim + cols[None, :], value, mask=live[:, None] & in_dim)


@triton.jit
def _same_segment(s1, v1, s2, v2):
    return s2, tl.where(s1 == s2, v1 + v2, v2)


@triton.jit
def _zero_split_segments_kernel(seg_ptr, n, sums_ptr, dim, TILE: tl.constexpr, BOUNDS: tl.constexpr, DIM: tl.constexpr):
    """Zeroes the sum of each segment that crosses a tile boundary (summed with atomics);
    BOUNDS boundaries per program."""
    b = (tl.program_id(0) * BOUNDS + tl.arange(0, BOUNDS) + 1) * TILE
    s = tl.load(seg_ptr + b, mask=b < n, other=-1)
    split = (b < n) & (tl.load(seg_ptr + b - 1, mask=b < n, other=-2) == s)
    cols = tl.arange(0, DIM)
    zero = tl.zeros([BOUNDS, DIM], tl.float32)
    tl.store(sums_ptr + s[:, None] * dim + cols[None, :], zero, mask=split[:, None] & (cols[None, :] < dim))


@triton.jit
def _segment_sum_kernel(
    order_ptr, seg_ptr, tid_ptr, n, grad_ptrs_ptr, lane_start_ptr, sums_ptr, dim,
    TILE: tl.constexpr, DIM: tl.constexpr,
):
    """sums[s] = sum of the gradients of the lanes in segment s, lanes taken in sorted
    order (order[i]: the lane at sorted position i; seg[i]: its segment, non-decreasing).
    A lane's gradient is row (lane - lane_start[t]) of table t's gradient tensor. A
    segment inside one tile is summed in registers and stored; a longer one is summed per
    tile and added atomically (its row was zeroed first)."""
    start = tl.program_id(0) * TILE
    i = start + tl.arange(0, TILE)
    live = i < n
    lane = tl.load(order_ptr + i, mask=live, other=0)
    seg = tl.load(seg_ptr + i, mask=live, other=-1)
    t = tl.load(tid_ptr + lane, mask=live, other=0).to(tl.int64)
    grads = tl.load(grad_ptrs_ptr + t, mask=live, other=0).to(tl.pointer_type(tl.float32))
    row = lane - tl.load(lane_start_ptr + t, mask=live, other=0)
    cols = tl.arange(0, DIM)
    m = live[:, None] & (cols[None, :] < dim)
    g = tl.load(grads[:, None] + row[:, None] * dim + cols[None, :], mask=m, other=0.0)
    _, acc = tl.associative_scan((tl.broadcast_to(seg[:, None], (TILE, DIM)), g), 0, _same_segment)
    next_seg = tl.load(seg_ptr + i + 1, mask=i + 1 < n, other=-1)
    before = tl.load(seg_ptr + start - 1, mask=start > 0, other=-1)
    ends = live & ((next_seg != seg) | (i == start + TILE - 1))
    whole = (next_seg != seg) & (seg != before)
    out = sums_ptr + seg[:, None] * dim + cols[None, :]
    tl.store(out, acc, mask=m & (ends & whole)[:, None])
    tl.atomic_add(out, acc, mask=m & (ends & ~whole)[:, None])


@triton.jit
def _pack_kernel(key_ptr, tid_ptr, slot_ptr, n, packed_ptr, BLOCK: tl.constexpr):
    """The sort key of each lane: (table << SLOT_BITS) | slot for a lane with a row; else
    the sign bit, the table in bits 56-62 and the key's low 56 bits, so rowless lanes sort
    first, by table."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    t = tl.load(tid_ptr + offs, mask=live, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + offs, mask=live, other=0)
    key = tl.load(key_ptr + offs, mask=live, other=0)
    rowless = (key & ((1 << 56) - 1)) | (t << 56) | (-9223372036854775807 - 1)
    tl.store(packed_ptr + offs, tl.where(slot >= 0, (t << SLOT_BITS) | slot, rowless), mask=live)


@triton.jit
def _lower_bound(ptr, n, value):
    """First position of the sorted ptr[0:n] whose value is >= value."""
    lo = tl.zeros([], dtype=tl.int64)
    hi = lo + n
    for _ in range(64):
        mid = (lo + hi) // 2
        below = (lo < hi) & (tl.load(ptr + mid, mask=lo < hi, other=value) < value)
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where((lo < hi) & ~below, mid, hi)
    return lo


@triton.jit
def _segments_before(seg_ptr, p):
    """Distinct rows among the first p sorted lanes (seg counts from 0)."""
    return tl.where(p > 0, tl.load(seg_ptr + p - 1, mask=p > 0, other=0) + 1, 0)


@triton.jit
def _count_kernel(ordered_ptr, seg_ptr, n, bounds_ptr, counts_ptr, inserting_ptr, tables, TRAIN: tl.constexpr):
    """Program t adds table t's distinct ids of this lookup to counts[t]: lookups, hits
    (stored ids; the claim took off those it inserted) and, when training a table that
    inserts, rejections (ids left without a row). Its lanes lie between binary-searched
    positions of the sorted sort keys: bounds[t] and bounds[t + 1] for rowless lanes,
    bounds[tables + 1 + t] and the next for stored ones."""
    t = tl.program_id(0)
    rowless = _segments_before(seg_ptr, _lower_bound(ordered_ptr, n, tl.load(bounds_ptr + t + 1))) - _segments_before(
        seg_ptr, _lower_bound(ordered_ptr, n, tl.load(bounds_ptr + t)))
    stored = _segments_before(seg_ptr, _lower_bound(ordered_ptr, n, tl.load(bounds_ptr + tables + 2 + t))) - _segments_before(
        seg_ptr, _lower_bound(ordered_ptr, n, tl.load(bounds_ptr + tables + 1 + t)))
    row = counts_ptr + t * 5
    tl.store(row, tl.load(row) + rowless + stored)
    tl.store(row + 1, tl.load(row + 1) + stored)
    if TRAIN:
        tl.store(row + 3, tl.load(row + 3) + rowless * tl.load(inserting_ptr + t))
