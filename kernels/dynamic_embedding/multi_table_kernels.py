"""Kernels of a group of tables trained together (see table_group.py).

A call's lanes (one id of one table each) are numbered by segment, one per distinct
(table, id), through a scratch hash map: the tables are probed once per distinct id and
each lane gathers its segment's row. The update sorts the lanes by segment, so that the
lanes of one id lie together, then sums each segment's gradients and applies the
optimizer in one pass. Also here: initial rows made in the kernel, per-table counting and the
growth check (whether a growing table must grow).

Each operation is one launcher at the end of this file (a kernel or a few), as
table_group.py calls it; multi_table_reference.py holds its PyTorch twin, with the same
signature, and tests/test_multi_table_kernels.py holds the two against each other.

Rows are addressed as packed (table << SLOT_BITS) | slot; tables through descriptors.
The number of lanes, n, changes from call to call and is not specialized on: Triton would
compile another kernel the first time a call's n is divisible by 16, mid-training.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..launch import aligned_empty, cdiv, launch, next_power_of_2
from .claim_kernels import resident_grid
from .triton_optimizers import _load_rows, _step_rows, optimizer_args
from .counters import K_ADMISSION_REJECTIONS, K_ADMISSIONS, K_HITS, K_LOOKUPS, K_NUM_COUNTED, K_REJECTIONS
from .probe_kernels import K_EMPTY_KEY, ROW_ALIGN, _DIGESTS, _KEYS, _MASK, _SCORES, _VALUES, TableStack, _field, _hash

SLOT_BITS = tl.constexpr(40)  # packed (table, slot): the slot's bits
SLOT_MASK = tl.constexpr((1 << SLOT_BITS.value) - 1)

LANE_BLOCK, LANE_SUB = 256, 16  # ids per program of row initialisation (most skip), ids per embedding tile
GATHER_BLOCK, GATHER_WARPS = 16, 4  # lanes per program of the gather, and its warps
FRESH_PROGRAMS = 8  # per multiprocessor, of the initial embeddings of ids without a row
SCAN_BLOCK = 1024  # lanes or segments per program of the elementwise kernels (numbering, rows, counting)
# lanes per program of the numbering by distinct id, and its warps
DISTINCT_BLOCK, DISTINCT_WARPS = 32, 1
SEGMENTS_BLOCK = 256  # sorted lanes per program of finding where segments start
# lanes of one row beyond which the update sums them across programs first (fewer doubles
# the partial sums' memory for no gain)
LONG_SEGMENT = 8
# sorted lanes per program of the sum of long segments, and its warps: one warp sums a
# tile's lanes in registers
SUM_TILE, SUM_WARPS = 32, 1
# programs of the sum of long segments per multiprocessor, stepping through the tiles
SUM_PROGRAMS = 64
# embedding values per program of the update (rows: this / dim), and its warps
UPDATE_ELEMENTS, UPDATE_WARPS = 1024, 4
# programs of the update per multiprocessor, stepping through the segments' blocks (a grid
# sized for the lanes leaves most programs without segments)
UPDATE_PROGRAMS = 64
# (the measurements behind these: benchmarks/embedding_tuning.md)


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
    key_ptr, tid_ptr, slot_ptr, inserted_ptr, count_ptr, desc_ptr, seed_ptr, scale_ptr, dim, row_dim, row_stride,
    BLOCK: tl.constexpr, SUB: tl.constexpr, DIM_BLOCK: tl.constexpr,
):
    """Rows of the segments (count_ptr[0] of them) whose ids this call inserted: their
    initial embedding, optimizer state zero. A program checks BLOCK ids, then computes
    embeddings SUB ids at a time where one is new (most blocks have none)."""
    n = tl.load(count_ptr)
    base = tl.program_id(0) * BLOCK
    block = base + tl.arange(0, BLOCK)
    if tl.max(tl.load(inserted_ptr + block, mask=block < n, other=0), axis=0) != 0:  # most programs have no new key
        for sub in range(0, BLOCK, SUB):
            offs = base + sub + tl.arange(0, SUB)
            live = (offs < n) & (tl.load(inserted_ptr + offs, mask=offs < n, other=0) != 0)
            if tl.max(live.to(tl.int32), axis=0) > 0:
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
                    zero = tl.zeros([SUB, DIM_BLOCK], dtype=tl.float32)
                    tl.store(row[:, None] + cols[None, :], zero, mask=live[:, None] & (cols[None, :] < row_dim))


@triton.jit(do_not_specialize=["n"])
def _gather_kernel(number_ptr, rows_ptr, n, desc_ptr, out_ptr, dim, row_stride, BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr):
    """out[lane] = the embedding of the row of the lane's segment (rows[number[lane]]), for
    lanes whose id has a row (_fresh_rows_kernel does the others: apart, this kernel needs
    fewer registers, for more programs in flight)."""
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lane < n
    packed = tl.load(rows_ptr + tl.load(number_ptr + lane, mask=live, other=0), mask=live, other=-1)
    stored = packed >= 0
    values = _field(desc_ptr, tl.where(stored, packed >> SLOT_BITS, 0), _VALUES).to(tl.pointer_type(tl.float32))
    row = tl.multiple_of(values + (packed & SLOT_MASK) * row_stride, ROW_ALIGN)
    for c in range(0, dim, DIM_BLOCK):
        cols = c + tl.arange(0, DIM_BLOCK)
        m = stored[:, None] & (cols[None, :] < dim)
        tl.store(out_ptr + lane[:, None].to(tl.int64) * dim + cols[None, :], tl.load(row[:, None] + cols[None, :], mask=m), mask=m)


@triton.jit(do_not_specialize=["n"])
def _fresh_rows_kernel(
    number_ptr, rows_ptr, seg_key_ptr, seg_tid_ptr, n, rowless_ptr, seed_ptr, scale_ptr, out_ptr, dim,
    BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr,
):
    """out[lane] = the initial embedding of the lane's id where its segment has no row.
    Nothing to do unless rowless_ptr[0] is set (_segment_rows_kernel: some segment has
    none); programs step through the blocks of lanes."""
    n = tl.where(tl.load(rowless_ptr) != 0, n, 0)  # (an `if` would retype n where n == 1 is a constant)
    for block in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        lane = block * BLOCK + tl.arange(0, BLOCK)
        live = lane < n
        s = tl.load(number_ptr + lane, mask=live, other=0)
        fresh = live & (tl.load(rows_ptr + s, mask=live, other=0) < 0)
        if tl.max(fresh.to(tl.int32), axis=0) > 0:
            key = tl.load(seg_key_ptr + s, mask=fresh, other=0)
            t = tl.load(seg_tid_ptr + s, mask=fresh, other=0)
            seed, scale = tl.load(seed_ptr + t, mask=fresh, other=0), tl.load(scale_ptr + t, mask=fresh, other=0.0)
            for c in range(0, dim, DIM_BLOCK):
                cols = c + tl.arange(0, DIM_BLOCK)
                m = fresh[:, None] & (cols[None, :] < dim)
                tl.store(out_ptr + lane[:, None].to(tl.int64) * dim + cols[None, :], _initial_embedding(key, seed, scale, cols), mask=m)


@triton.jit(do_not_specialize=["map_mask", "n"])  # a mask of 1 would be a constant int, without .to
def _distinct_kernel(key_ptr, tid_ptr, n, map_ptr, map_mask, taker_ptr, first_ptr, BLOCK: tl.constexpr):
    """taker[lane]: the first lane seen with the lane's (table, id), the one that took its
    slot in a scratch open-addressing map (map_ptr: map_mask + 1 int32 slots, zeroed
    before, at most half full, that store the taker + 1); first[lane]: 1 if the lane is
    that taker, else 0."""
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lane < n
    key = tl.load(key_ptr + lane, mask=live, other=0)
    t = tl.load(tid_ptr + lane, mask=live, other=0)
    pos = (_hash(key ^ (t.to(tl.int64) << 57)) & map_mask.to(tl.uint64)).to(tl.int64)
    taker = lane
    active = live
    while tl.max(active.to(tl.int32), axis=0) > 0:
        held = tl.load(map_ptr + pos, mask=active, other=0, cache_modifier=".cg")  # through L2, where the swaps are
        empty = active & (held == 0)
        won = empty & False
        if tl.max(empty.to(tl.int32), axis=0) > 0:
            # lanes not taking a slot swap their own taker entry against a value it never holds
            old = tl.atomic_cas(
                tl.where(empty, map_ptr + pos, taker_ptr + lane), tl.where(empty, 0, -2), tl.where(empty, lane + 1, 0), sem="relaxed",
            )
            won = empty & (old == 0)
            held = tl.where(empty & ~won, old, held)
        other = active & ~won
        held = held - 1
        same = other & (tl.load(key_ptr + held, mask=other, other=0) == key) & (tl.load(tid_ptr + held, mask=other, other=-1) == t)
        taker = tl.where(same, held, taker)
        active = active & ~(won | same)
        pos = tl.where(active, (pos + 1) & map_mask, pos)
    tl.store(taker_ptr + lane, taker, mask=live)
    tl.store(first_ptr + lane, (taker == lane).to(tl.int32), mask=live)


@triton.jit(do_not_specialize=["n"])
def _number_kernel(number_ptr, ranks_ptr, key_ptr, tid_ptr, n, seg_key_ptr, seg_tid_ptr, count_ptr, BLOCK: tl.constexpr):
    """Segments numbered densely, in the order of their takers (_distinct_kernel): on entry
    number[lane] is the lane's taker and ranks the running count of takers up to each
    lane (inclusive), on exit number[lane] is its segment. Also each segment's id and
    table, and count[0], the number of segments."""
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lane < n
    taker = tl.load(number_ptr + lane, mask=live, other=0)
    seg = tl.load(ranks_ptr + taker, mask=live, other=0) - 1
    tl.store(number_ptr + lane, seg, mask=live)
    first = live & (taker == lane)
    tl.store(seg_key_ptr + seg, tl.load(key_ptr + lane, mask=first, other=0), mask=first)
    tl.store(seg_tid_ptr + seg, tl.load(tid_ptr + lane, mask=first, other=0), mask=first)
    last = lane == n - 1
    tl.store(count_ptr + tl.zeros_like(lane), tl.load(ranks_ptr + lane, mask=last, other=0), mask=last)


@triton.jit(do_not_specialize=["n"])
def _segments_kernel(seg_ptr, n, starts_ptr, partial_ptr, dim, LONG: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr):
    """For lanes sorted by segment (seg: each sorted lane's): starts[s], the sorted
    position of segment s's first lane; the partial sum of a segment of more than LONG
    lanes is zeroed."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    seg = tl.load(seg_ptr + i, mask=live, other=0)
    first = live & (tl.load(seg_ptr + i - 1, mask=live & (i > 0), other=-1) != seg)
    tl.store(starts_ptr + seg, i, mask=first)
    long = first & (tl.load(seg_ptr + i + LONG, mask=first & (i + LONG < n), other=-1) == seg)
    if tl.max(long.to(tl.int32), axis=0) > 0:
        cols = tl.arange(0, DIM)
        zero = tl.zeros([BLOCK, DIM], tl.float32)
        tl.store(partial_ptr + (i // LONG)[:, None].to(tl.int64) * dim + cols[None, :], zero, mask=long[:, None] & (cols[None, :] < dim))


# The update sums the first LONG lanes of a segment (the lanes of one row, contiguous in
# sorted order) in the program that updates its row. Lanes past those (hot ids: a power
# law gives some thousands of lanes) are summed first, tile by tile across programs, into
# a partial sum at index start // LONG, which differs between such segments since they
# start more than LONG apart. The adds are relaxed atomics: nothing is ordered by them
# (the update is a later launch).


@triton.jit
def _grad_rows(table, grad_ptrs_ptr, lane_start_ptr, dim, tables):
    """For lanes of these tables (a valid index everywhere): where row 0 of their table's
    gradients would be if lanes were numbered from 0 across the group, so that lane l's
    gradient starts at the result + l * dim (lane l of table t is row l - lane_start[t]
    of the gradient tensor at address grad_ptrs[t]). Of `tables` gradient tensors: a
    row of table t + tables (a host tier, tiers.Tiers) takes table t's."""
    table = table % tables
    grads = tl.load(grad_ptrs_ptr + table).to(tl.pointer_type(tl.float32))
    return grads - tl.load(lane_start_ptr + table) * dim


@triton.jit(do_not_specialize=["n"])
def _long_segment_sum_kernel(
    order_ptr, seg_ptr, starts_ptr, rows_ptr, n, grad_ptrs_ptr, lane_start_ptr, grad_tables, partial_ptr, dim,
    LONG: tl.constexpr, TILE: tl.constexpr, DIM: tl.constexpr,
):
    """Adds the gradients of the lanes in tiles of TILE sorted positions that lie more
    than LONG lanes into their segment to the segment's partial sum (one atomic add per
    segment piece). Programs step through the tiles."""
    for tile in range(tl.program_id(0), tl.cdiv(n, TILE), tl.num_programs(0)):
        i = tile * TILE + tl.arange(0, TILE)
        seg = tl.load(seg_ptr + i, mask=i < n, other=-1)
        late = (i < n) & (tl.load(seg_ptr + i - LONG, mask=(i < n) & (i >= LONG), other=-2) == seg)
        if tl.max(late.to(tl.int32), axis=0) > 0:  # (many tiles have no such lane)
            packed = tl.load(rows_ptr + seg, mask=late, other=-1)
            late = late & (packed >= 0)
            begin = tl.load(starts_ptr + seg, mask=late, other=0)
            cols = tl.arange(0, DIM)
            lane = tl.load(order_ptr + i, mask=i < n, other=0)
            grads = _grad_rows(tl.maximum(packed, 0) >> SLOT_BITS, grad_ptrs_ptr, lane_start_ptr, dim, grad_tables)
            g = tl.load(grads[:, None] + lane[:, None] * dim + cols[None, :], mask=late[:, None] & (cols[None, :] < dim), other=0.0)
            # one add per segment piece in the tile: most tiles of a hot id hold one piece
            pending = late
            while tl.max(pending.to(tl.int32), axis=0) > 0:
                first = tl.min(tl.where(pending, seg, n), axis=0)
                piece = pending & (seg == first)
                out = partial_ptr + tl.max(tl.where(piece, begin, 0), axis=0) // LONG * dim + cols
                tl.atomic_add(out, tl.sum(tl.where(piece[:, None], g, 0.0), axis=0), mask=cols < dim, sem="relaxed")
                pending = pending & ~piece


@triton.jit(do_not_specialize=["n"])
def _segment_update_kernel(
    order_ptr, starts_ptr, rows_ptr, count_ptr, n, grad_ptrs_ptr, lane_start_ptr, grad_tables, partial_ptr, desc_ptr, dim,
    row_stride, lr, beta1, beta2, eps, weight_decay, max_norm,
    OPT: tl.constexpr, CLIP: tl.constexpr, LONG: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
):
    """One optimizer step for each of BLOCK segments (distinct rows) with the sum of its
    lanes' gradients: its first LONG lanes added here in sorted order (order[i]: the lane
    at sorted position i), then the partial sum of the rest if any. Segments: starts[s]
    (_segments_kernel) and rows[s] (_segment_rows_kernel), count_ptr[0] of them; rowless
    ones (rows < 0) are skipped. All lanes of a segment share its table. Programs step
    through the blocks of segments (the count is on the device, the grid is not sized by
    it)."""
    count = tl.load(count_ptr)
    for block in range(tl.program_id(0), tl.cdiv(count, BLOCK), tl.num_programs(0)):
        s = block * BLOCK + tl.arange(0, BLOCK)
        packed = tl.load(rows_ptr + s, mask=s < count, other=-1)
        live = packed >= 0
        if tl.max(live.to(tl.int32), axis=0) > 0:
            t = tl.where(live, packed >> SLOT_BITS, 0)
            begin = tl.load(starts_ptr + s, mask=live, other=0)
            end = tl.load(starts_ptr + s + 1, mask=live & (s + 1 < count), other=n)
            long = live & (end - begin > LONG)
            length = tl.where(live, tl.minimum(end - begin, LONG), 0)
            cols = tl.arange(0, DIM)
            values = _field(desc_ptr, t, _VALUES).to(tl.pointer_type(tl.float32))
            row_ptr = tl.multiple_of(values + (packed & SLOT_MASK) * row_stride, ROW_ALIGN)  # rows start aligned
            w, first, second, per_row = _load_rows(row_ptr, live, cols, dim, OPT)  # in flight while the sum runs
            g = tl.load(partial_ptr + (begin // LONG)[:, None] * dim + cols[None, :], mask=long[:, None] & (cols[None, :] < dim), other=0.0)
            # the address of each segment's gradients computed once, and its next lane loaded
            # while this one's gradient is
            grads = _grad_rows(t, grad_ptrs_ptr, lane_start_ptr, dim, grad_tables)
            lane = tl.load(order_ptr + begin, mask=length > 0, other=0)
            for j in range(0, tl.max(length, axis=0)):
                on = j < length
                following = tl.load(order_ptr + begin + j + 1, mask=j + 1 < length, other=0)
                g += tl.load(grads[:, None] + lane[:, None] * dim + cols[None, :], mask=on[:, None] & (cols[None, :] < dim), other=0.0)
                lane = following
            _step_rows(row_ptr, live, g, cols, dim, w, first, second, per_row, lr, beta1, beta2, eps, weight_decay, max_norm, OPT, CLIP)


@triton.jit
def _segment_rows_kernel(
    seg_tid_ptr, slot_ptr, count_ptr, rows_ptr, rowless_ptr, counts_ptr, inserting_ptr, tables,
    BLOCK: tl.constexpr, COUNT: tl.constexpr, TRAIN: tl.constexpr,
):
    """For a block of segments (distinct ids of a table): rows[s], the packed row of
    slot[s] in its table (-1 if none), and rowless[0] set if some segment has none.
    COUNT: adds them to their tables' counters (counts[t, :]): lookups, hits (ids with a
    row; the claim took off those it inserted) and, when training a table that inserts,
    rejections (ids left without a row)."""
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = s < tl.load(count_ptr)
    t = tl.load(seg_tid_ptr + s, mask=live, other=-1).to(tl.int64)
    slot = tl.load(slot_ptr + s, mask=live, other=-1)
    stored = live & (slot >= 0)
    tl.store(rows_ptr + s, tl.where(stored, (t << SLOT_BITS) | slot, -1), mask=live)
    if tl.max((live & ~stored).to(tl.int32), axis=0) > 0:
        tl.store(rowless_ptr, 1)
    if COUNT:
        if tl.max(live.to(tl.int32), axis=0) > 0:  # (programs past the count skip the tables' loop)
            for table in range(0, tables):
                mine = live & (t == table)
                lookups = tl.sum(mine.to(tl.int64), axis=0)
                if lookups > 0:
                    hits = tl.sum((mine & stored).to(tl.int64), axis=0)
                    tl.atomic_add(counts_ptr + table * K_NUM_COUNTED + K_LOOKUPS, lookups, sem="relaxed")
                    tl.atomic_add(counts_ptr + table * K_NUM_COUNTED + K_HITS, hits, sem="relaxed")
                    if TRAIN:
                        tl.atomic_add(counts_ptr + table * K_NUM_COUNTED + K_REJECTIONS, (lookups - hits) * tl.load(inserting_ptr + table), sem="relaxed")


@triton.jit(do_not_specialize=["n"])
def _growth_check_kernel(seg_tid_ptr, slot_ptr, count_ptr, n, desc_ptr, growing_ptr, bucket_size, out_ptr, BLOCK: tl.constexpr):
    """Program (b, 0): the segments of block b (of the first count_ptr[0]) that a full
    bucket left without a slot (slot -2), added to out[t, 0] of their table t. Program
    (b, 1 + g): the stored keys in block b of the slots of table growing[g], added to
    out[t, 1]."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    if j == 0:
        live = offs < tl.minimum(tl.load(count_ptr), n)
        slot = tl.load(slot_ptr + offs, mask=live, other=0)
        full = live & (slot == -2)
        if tl.max(full.to(tl.int32), axis=0) > 0:  # (rare: a bucket is full just before a growth)
            t = tl.load(seg_tid_ptr + offs, mask=full, other=0).to(tl.int64)
            tl.atomic_add(out_ptr + t * 2, full.to(tl.int64), mask=full, sem="relaxed")
    else:
        t = tl.load(growing_ptr + j - 1).to(tl.int64)
        capacity = (_field(desc_ptr, t, _MASK) + 1) * bucket_size
        if b * BLOCK < capacity:
            keys = _field(desc_ptr, t, _KEYS).to(tl.pointer_type(tl.int64))
            key = tl.load(keys + offs, mask=offs < capacity, other=K_EMPTY_KEY)
            stored = tl.sum((key != K_EMPTY_KEY).to(tl.int64), axis=0)
            if stored > 0:
                tl.atomic_add(out_ptr + t * 2 + 1, stored, sem="relaxed")


@triton.jit(do_not_specialize=["n"])
def _gate_kernel(tid_ptr, counted_ptr, uses_ptr, count_ptr, n, admits_ptr, threshold_ptr, seen_ptr, barred_ptr, BLOCK: tl.constexpr):
    """Before a claim, for a block of segments (n entries, the first count_ptr[0] used):
    seen[s], the id's count (counted: its counter row's score, plus uses: its copies in
    the call), and barred[s], set where the id's table admits (admits[t]) and the count is
    below the table's threshold: the claim may find such an id but not insert it."""
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = s < n
    live = s < tl.load(count_ptr)
    t = tl.load(tid_ptr + s, mask=live, other=0).to(tl.int64)
    seen = tl.load(counted_ptr + s, mask=live, other=0) + tl.load(uses_ptr + s, mask=live, other=0)
    gated = live & (tl.load(admits_ptr + t, mask=live, other=0) != 0)
    barred = gated & (seen < tl.load(threshold_ptr + t, mask=live, other=0))
    tl.store(seen_ptr + s, seen, mask=inside)
    tl.store(barred_ptr + s, barred.to(tl.int8), mask=inside)


@triton.jit(do_not_specialize=["n"])
def _admit_kernel(
    key_ptr, tid_ptr, slot_ptr, inserted_ptr, found_ptr, seen_ptr, count_ptr, n, admits_ptr, threshold_ptr, cdesc_ptr,
    counts_ptr, claim_key_ptr, tables, BLOCK: tl.constexpr,
):
    """After a claim barred by _gate_kernel, for a block of segments (n entries, the first
    count_ptr[0] used): a segment whose id was not stored before the claim (inserted by it,
    or left without a slot) in a table that admits (admits[t]) is new. A new id whose count
    (seen) is at the table's threshold was admitted: its counter slot (found, < 0 if
    absent; cdesc: the counter tables) is emptied (key, score, digest). One below it was
    refused: claim_key[s] = the id, for the claim that stores counts (every other
    claim_key is the reserved key, which the claim skips). Counts per table: admissions,
    admission rejections, and rejections less the refused ids (the lookup's count of ids
    without a row counts them)."""
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = s < n
    live = s < tl.load(count_ptr)
    t = tl.load(tid_ptr + s, mask=live, other=0).to(tl.int64)
    was_stored = (tl.load(slot_ptr + s, mask=live, other=-1) >= 0) & (tl.load(inserted_ptr + s, mask=live, other=0) == 0)
    new = live & ~was_stored & (tl.load(admits_ptr + t, mask=live, other=0) != 0)
    admitted = new & (tl.load(seen_ptr + s, mask=live, other=0) >= tl.load(threshold_ptr + t, mask=live, other=0))
    refused = new & ~admitted
    key = tl.load(key_ptr + s, mask=live, other=0)
    tl.store(claim_key_ptr + s, tl.where(refused, key, K_EMPTY_KEY), mask=inside)
    found = tl.load(found_ptr + s, mask=admitted, other=-1)
    clear = admitted & (found >= 0)
    tl.store(_field(cdesc_ptr, t, _KEYS).to(tl.pointer_type(tl.int64)) + found, tl.full([BLOCK], K_EMPTY_KEY, tl.int64), mask=clear)
    tl.store(_field(cdesc_ptr, t, _SCORES).to(tl.pointer_type(tl.int64)) + found, tl.zeros([BLOCK], tl.int64), mask=clear)
    tl.store(_field(cdesc_ptr, t, _DIGESTS).to(tl.pointer_type(tl.uint8)) + found, tl.zeros([BLOCK], tl.uint8), mask=clear)
    if tl.max(new.to(tl.int32), axis=0) > 0:
        for table in range(0, tables):
            took = tl.sum((admitted & (t == table)).to(tl.int64), axis=0)
            left = tl.sum((refused & (t == table)).to(tl.int64), axis=0)
            if took + left > 0:
                tl.atomic_add(counts_ptr + table * K_NUM_COUNTED + K_ADMISSIONS, took, sem="relaxed")
                tl.atomic_add(counts_ptr + table * K_NUM_COUNTED + K_ADMISSION_REJECTIONS, left, sem="relaxed")
                tl.atomic_add(counts_ptr + table * K_NUM_COUNTED + K_REJECTIONS, -left, sem="relaxed")


# ---- the operations, as table_group.py calls them (twins: multi_table_reference.py) -------

@dataclass
class Gradients:
    """A group's gradients: tensors, each member's (lanes, dim) float32 rows, contiguous;
    ptrs, their addresses on the device (what the kernels read); lane_bounds, where each
    member's lanes begin in the group's lane order (T + 1 values)."""

    tensors: list
    ptrs: torch.Tensor
    lane_bounds: torch.Tensor


def number_segments(keys: torch.Tensor, tids: torch.Tensor):
    """Numbers N lanes (keys, of tables tids) by segment, one per distinct (table, id):
    (number (N,) int32, count (1,) int32, seg_keys, seg_tids, rows, rowless). The per-
    segment tensors have N entries, the first count[0] used; rows (N,) int64 (unset) and
    rowless (1,) int32 (zeroed) are segment_rows' outputs, allocated with the others (each
    allocation costs host time the device waits for). A segment's number is the rank of
    its taker, the lane that took its slot in a scratch map (_distinct_kernel)."""
    n = keys.numel()
    size = next_power_of_2(2 * n)  # the map at most half full
    scratch = torch.zeros(size + 2, dtype=torch.int32, device=keys.device)
    count, rowless = scratch[size : size + 1], scratch[size + 1 : size + 2]
    number, first = aligned_empty(2, n, torch.int32, keys.device)
    launch(
        _distinct_kernel, (cdiv(n, DISTINCT_BLOCK),),
        keys, tids, n, scratch, size - 1, number, first, BLOCK=DISTINCT_BLOCK, num_warps=DISTINCT_WARPS,
    )
    ranks = torch.cumsum(first, 0, dtype=torch.int32)  # int32 as counted: no conversion pass
    seg_keys, seg_tids, rows = aligned_empty(3, n, torch.int64, keys.device)
    launch(_number_kernel, (cdiv(n, SCAN_BLOCK),), number, ranks, keys, tids, n, seg_keys, seg_tids, count, BLOCK=SCAN_BLOCK)
    return number, count, seg_keys, seg_tids, rows, rowless


def segment_rows(seg_tids, slots, count, rows, rowless, counts, inserting, counted: bool | None) -> None:
    """rows[s]: the packed row (table << SLOT_BITS | slot) of each of the count[0] segments
    at slots[s] in its table, -1 where none; rowless[0] set if some segment has none.
    counted True / False (a training lookup or not): also adds the lookup to counts (T,
    NUM_COUNTED): lookups, hits, and when training ids without a row as rejections of
    tables that insert (inserting[t]); None: nothing is counted."""
    launch(
        _segment_rows_kernel, (cdiv(slots.numel(), SCAN_BLOCK),),
        seg_tids, slots, count, rows, rowless, counts, inserting, counts.shape[0],
        BLOCK=SCAN_BLOCK, COUNT=counted is not None, TRAIN=bool(counted),
    )


def growth_checks(seg_tids, slots, count, stack: TableStack, growing, bucket_size: int, max_capacity: int) -> torch.Tensor:
    """(T, 2) int64, after a claim of the count[0] segments: per table, its segments left
    without a slot by a full bucket (slot -2), and for the tables in growing (member
    indices, a tensor on the device) the keys stored, every slot of the table counted
    (max_capacity: the largest capacity among them; 0 for the others)."""
    n = slots.numel()
    out = torch.zeros(stack.desc.shape[0], 2, dtype=torch.int64, device=slots.device)
    launch(
        _growth_check_kernel, (max(cdiv(n, SCAN_BLOCK), cdiv(max_capacity, SCAN_BLOCK), 1), 1 + growing.numel()),
        seg_tids, slots, count, n, stack.desc, growing, bucket_size, out, BLOCK=SCAN_BLOCK,
    )
    return out


def init_rows(keys, tids, slots, inserted, count, stack: TableStack, seeds, scales, dim: int, whole_rows: bool = False) -> None:
    """The rows of the segments (of count[0]) a claim inserted: their initial embedding
    (seeds[t], scales[t] of their table), then zeros to the row's end; whole_rows: to its
    stride (whole 64-byte lines, as host memory takes them fastest)."""
    n = keys.numel()
    table = stack.tables[0]
    launch(
        _init_rows_kernel, (cdiv(n, LANE_BLOCK),),
        keys, tids, slots, inserted.view(torch.int8), count, stack.desc, seeds, scales, dim,
        table.row_stride if whole_rows else table.row_dim, table.row_stride,
        BLOCK=LANE_BLOCK, SUB=LANE_SUB, DIM_BLOCK=min(64, next_power_of_2(dim)),
    )


def gather_embeddings(number, rows, seg_keys, seg_tids, rowless, stack: TableStack, seeds, scales, out) -> None:
    """out (N, dim)[lane] = the embedding of the row of the lane's segment, or where the
    segment has none (rowless[0] is then set) its id's initial embedding: two kernels, the
    second a no-op unless rowless."""
    n, dim = out.shape
    dim_block = min(128, next_power_of_2(dim))
    launch(
        _gather_kernel, (cdiv(n, GATHER_BLOCK),),
        number, rows, n, stack.desc, out, dim, stack.tables[0].row_stride, BLOCK=GATHER_BLOCK, DIM_BLOCK=dim_block,
        num_warps=GATHER_WARPS,
    )
    launch(
        _fresh_rows_kernel, resident_grid(cdiv(n, GATHER_BLOCK), out.device, FRESH_PROGRAMS),
        number, rows, seg_keys, seg_tids, n, rowless, seeds, scales, out, dim, BLOCK=GATHER_BLOCK, DIM_BLOCK=dim_block,
        num_warps=GATHER_WARPS,
    )


def admission_gate(tids, counted, uses, count, admits, thresholds):
    """Before the claim of the count[0] segments (_gate_kernel): (seen, barred), N entries
    each: each id's count (counted, its counter row's score, plus uses), and whether the
    claim may not insert it (its table admits and the count is below its threshold)."""
    n = tids.numel()
    seen = torch.empty(n, dtype=torch.int64, device=tids.device)
    barred = torch.empty(n, dtype=torch.bool, device=tids.device)
    launch(
        _gate_kernel, (cdiv(n, SCAN_BLOCK),),
        tids, counted, uses, count, n, admits, thresholds, seen, barred.view(torch.int8), BLOCK=SCAN_BLOCK,
    )
    return seen, barred


def admit(keys, tids, slots, inserted, found, seen, count, admits, thresholds, counter_stack: TableStack, counts):
    """Admission of the count[0] segments after their claim (_admit_kernel): claim_keys, N
    entries. A segment not stored before the claim (inserted by it, or slot < 0) in a table
    that admits is new; its count is seen (admission_gate's). At the table's threshold it
    was admitted and its counter slot (found) is emptied; below it, refused (claim_key: its
    id, for the claim that stores the counts; else the reserved key). counts: per table
    admissions, admission rejections, and rejections less the refused ids."""
    n = keys.numel()
    claim_keys = torch.empty(n, dtype=torch.int64, device=keys.device)
    launch(
        _admit_kernel, (cdiv(n, SCAN_BLOCK),),
        keys, tids, slots, inserted.view(torch.int8), found, seen, count, n, admits, thresholds, counter_stack.desc,
        counts, claim_keys, counts.shape[0], BLOCK=SCAN_BLOCK,
    )
    return claim_keys


def update_segments(number, rows, count, grads: Gradients, stack: TableStack, dim: int, optimizer) -> None:
    """One optimizer step for each of the count[0] segments that has a row, with the sum of
    its lanes' gradients: the lanes sorted by segment (stable: a segment's gradients are
    summed in lane order, long segments' tails first into partial sums), then summed and
    applied in one kernel."""
    n = number.numel()
    device = number.device
    seg, order = torch.sort(number, stable=True)
    starts = torch.empty(n, dtype=torch.int64, device=device)
    partial = torch.empty(n // LONG_SEGMENT + 1, dim, dtype=torch.float32, device=device)
    dim_block = next_power_of_2(dim)
    launch(
        _segments_kernel, (cdiv(n, SEGMENTS_BLOCK),), seg, n, starts, partial, dim, LONG=LONG_SEGMENT, BLOCK=SEGMENTS_BLOCK, DIM=dim_block,
    )
    block = max(1, min(64, UPDATE_ELEMENTS // dim_block))  # segments per program
    launch(
        _long_segment_sum_kernel, resident_grid(cdiv(n, SUM_TILE), device, SUM_PROGRAMS),
        order, seg, starts, rows, n, grads.ptrs, grads.lane_bounds, len(grads.tensors), partial, dim,
        LONG=LONG_SEGMENT, TILE=SUM_TILE, DIM=dim_block, num_warps=SUM_WARPS,
    )
    launch(
        _segment_update_kernel, resident_grid(cdiv(n, block), device, UPDATE_PROGRAMS),
        order, starts, rows, count, n, grads.ptrs, grads.lane_bounds, len(grads.tensors), partial, stack.desc, dim,
        stack.tables[0].row_stride, **optimizer_args(optimizer), LONG=LONG_SEGMENT, BLOCK=block, DIM=dim_block,
        num_warps=UPDATE_WARPS,
    )
