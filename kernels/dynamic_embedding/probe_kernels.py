"""The probe of the Triton hash table: key hashing and digests, the table descriptors that
let one launch address many tables, and the find kernel.

Each slot carries a one-byte digest (the hash's top byte): a probe reads a bucket's
digests (bucket_size bytes, compared 8 at a time, the second half only for keys not in
the first) and loads full keys only where the digest matches. Rows are padded to a
multiple of ROW_ALIGN values so they start aligned.
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..launch import cdiv, launch_each, next_power_of_2, prepare
from .hashing import EMPTY_KEY


@triton.jit
def _hash(k):
    """MurmurHash3 fmix64 on int64 keys (as uint64); equals hashing.hash64."""
    h = k.to(tl.uint64, bitcast=True)
    h = h ^ (h >> 33)
    h = h * 0xFF51AFD7ED558CCD
    h = h ^ (h >> 33)
    h = h * 0xC4CEB9FE1A85EC53
    h = h ^ (h >> 33)
    return h


@triton.jit
def _digest(h):
    """One byte of the hash for the probe; 0 is kept for empty slots."""
    d = (h >> 56).to(tl.uint8)
    return tl.where(d == 0, 1, d).to(tl.uint8)


ROW_ALIGN = tl.constexpr(16)  # elements; a row's stride in a Triton table is a multiple
K_EMPTY_KEY = tl.constexpr(EMPTY_KEY)  # the reserved key (int64 min): an empty slot
K_ABOVE_ALL = tl.constexpr(2**63 - 1)  # int64 max: above every score and slot (a minimum over none)

# A table descriptor: int64 words that let one kernel address any of several tables (the
# tables of a collection): storage addresses (HEADS: the claim's per-bucket list heads;
# WAITS: the word where a claim on the descriptors whose first is this table's records
# that some key waits to evict), bucket mask and insertion mode
# (kernels may only read module globals that are constexpr)
_KEYS, _DIGESTS, _SCORES, _VALUES, _MARKS, _HEADS, _MASK, _MODE, _WAITS = (tl.constexpr(i) for i in range(9))
DESCRIPTOR_WORDS = tl.constexpr(9)
# insertion modes: a key whose bucket has no empty slot is refused (slot -1) under KEEP,
# reported as slot -2 under GROW (the caller grows the table), evicts under EVICT
READ_ONLY, GROW, EVICT, KEEP = 0, 1, 2, 3


@dataclass
class TableStack:
    """Tables addressed together: desc, their descriptors stacked ((T, DESCRIPTOR_WORDS):
    what the kernels read); tables, the same tables in the same order (what the twins
    read: keys, scores, digests, values)."""

    desc: torch.Tensor
    tables: list


@triton.jit
def _field(desc_ptr, t, word: tl.constexpr):
    return tl.load(desc_ptr + t * DESCRIPTOR_WORDS + word)


@triton.jit
def _lane_bucket(offs, live, query_ptr, tid_ptr, desc_ptr, MULTI: tl.constexpr):
    """(table, key, hash, bucket) of the keys at offs: key i is in table tid[i] (MULTI), else
    all are in table 0, whose fields are then scalars."""
    if MULTI:
        t = tl.load(tid_ptr + offs, mask=live, other=0).to(tl.int64)
    else:
        t = 0
    key = tl.load(query_ptr + offs, mask=live, other=0)
    h = _hash(key)
    return t, key, h, (h & _field(desc_ptr, t, _MASK).to(tl.uint64)).to(tl.int64)


# A probe reads a bucket's digests as 64-bit words, 8 columns each (byte j of word w is
# column 8w + j), and compares them a word at a time: per key, a bucket of 128 costs 16
# values in registers instead of 128, which doubles the claim kernel's occupancy.
LOW7 = tl.constexpr(0x7F7F7F7F7F7F7F7F)
BYTE_ONES = tl.constexpr(0x0101010101010101)


@triton.jit
def _digest_words(
    digests_base, bucket, live, BUCKET: tl.constexpr, ALIGN: tl.constexpr, CACHE: tl.constexpr, FIRST: tl.constexpr,
    WORDS: tl.constexpr, POLICY: tl.constexpr,
):
    """The digests of each lane's bucket as uint64 words, (BLOCK, max(BUCKET // 8, 1)), or
    WORDS words from word FIRST on if WORDS > 0. A bucket of fewer than 8 slots shares its
    word: its bytes are shifted to the bottom and the others zeroed (the table pads its
    digests to whole words). POLICY: the load's L2 eviction policy."""
    words_base = digests_base.to(tl.pointer_type(tl.uint64))
    if BUCKET >= 8:
        row = tl.multiple_of(words_base + bucket * (BUCKET // 8), ALIGN)  # ALIGN bytes
        cols = FIRST + tl.arange(0, WORDS if WORDS > 0 else BUCKET // 8)
        return tl.load(row[:, None] + cols[None, :], mask=live[:, None], other=0, cache_modifier=CACHE, eviction_policy=POLICY)
    else:
        first = bucket * BUCKET
        word = tl.load(words_base + first // 8, mask=live, other=0, cache_modifier=CACHE, eviction_policy=POLICY)
        word = (word >> ((first % 8) * 8).to(tl.uint64)) & ((1 << (8 * BUCKET)) - 1)
        return word[:, None]


@triton.jit
def _zero_bytes(words):
    """0x80 in each byte of words that is zero, else 0 (exact: no carry crosses a byte)."""
    return ~(((words & LOW7) + LOW7) | words | LOW7)


@triton.jit
def _bytes_equal(words, byte):
    """0x80 in each byte of words that equals the lane's byte, else 0."""
    return _zero_bytes(words ^ (byte.to(tl.uint64) * BYTE_ONES)[:, None])


@triton.jit
def _lowest_column(flags, BUCKET: tl.constexpr):
    """The lowest column flagged in flags (BLOCK, words), or BUCKET if none below it."""
    low = flags & (~flags + 1)  # the lowest set bit; its float's exponent is its position
    bit = (low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    col = tl.where(flags != 0, tl.arange(0, flags.shape[1])[None, :] * 8 + (bit >> 3), BUCKET)
    return tl.minimum(tl.min(col, axis=1), BUCKET)


@triton.jit
def _drop_column(flags, col):
    """flags without column col, which must be the lowest flagged of its word."""
    return tl.where(tl.arange(0, flags.shape[1])[None, :] == (col // 8)[:, None], flags & (flags - 1), flags)


@triton.jit
def _key_column(key_row, key, flags, BUCKET: tl.constexpr, CACHE: tl.constexpr):
    """The column of `key` in its bucket (BUCKET if absent), given the columns whose digest
    matches (flags, from _bytes_equal). Keys are loaded one per lane and candidate: the
    first two candidates at once, then one at a time for the rare bucket with more."""
    c1 = _lowest_column(flags, BUCKET)
    flags = _drop_column(flags, c1)
    c2 = _lowest_column(flags, BUCKET)
    k1 = tl.load(key_row + c1, mask=c1 < BUCKET, other=0, cache_modifier=CACHE)
    k2 = tl.load(key_row + c2, mask=c2 < BUCKET, other=0, cache_modifier=CACHE)
    col = tl.where((c1 < BUCKET) & (k1 == key), c1, tl.where((c2 < BUCKET) & (k2 == key), c2, BUCKET))
    pending = (col == BUCKET) & (c2 < BUCKET)
    last = c2
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        flags = _drop_column(flags, last)
        c = _lowest_column(flags, BUCKET)
        pending = pending & (c < BUCKET)
        k = tl.load(key_row + c, mask=pending, other=0, cache_modifier=CACHE)
        col = tl.where(pending & (k == key), c, col)
        pending = pending & (k != key)
        last = c
    return col


@triton.jit
def _find_column(
    digests_base, key_row, bucket, key, digest, live, BUCKET: tl.constexpr, ALIGN: tl.constexpr, CACHE: tl.constexpr,
    POLICY: tl.constexpr,
):
    """(the column of `key` in its bucket, BUCKET if absent; where it is absent, the
    bucket's lowest column with a zero digest, BUCKET if none). The digests are read in
    halves, the second only for keys not in the first: a key found in the first half
    moves 64 bytes of digests instead of 128 (a bucket of 128), and the claim kernel's
    first phase needs 72 registers instead of 94. POLICY: the digests' L2 eviction
    policy."""
    # the first half's words, or the whole bucket (WORDS 0) where it has fewer than 2 words
    words = _digest_words(digests_base, bucket, live, BUCKET, ALIGN, CACHE, 0, BUCKET // 16 if BUCKET >= 16 else 0, POLICY)
    col = _key_column(key_row, key, _bytes_equal(words, digest), BUCKET, CACHE)
    empty = _lowest_column(_zero_bytes(words), BUCKET)
    if BUCKET >= 16:
        rest = live & (col == BUCKET)
        if tl.max(rest.to(tl.int32), axis=0) > 0:
            words = _digest_words(digests_base, bucket, rest, BUCKET, ALIGN, CACHE, BUCKET // 16, BUCKET // 16, POLICY)
            c = _key_column(key_row + BUCKET // 2, key, _bytes_equal(words, digest), BUCKET, CACHE)
            col = tl.where(c < BUCKET, BUCKET // 2 + c, col)
            later = _lowest_column(_zero_bytes(words), BUCKET)
            empty = tl.where((empty == BUCKET) & (later < BUCKET), BUCKET // 2 + later, empty)
    return col, empty


@triton.jit
def _buf_rows(buf_ptr, lane, lanes, row_dim, TILE: tl.constexpr):
    """For lanes: the first TILE values of rows `lane` of buf (N, row_dim), (lanes, TILE)."""
    cols = tl.arange(0, TILE)[None, :]
    return tl.load(buf_ptr + lane[:, None].to(tl.int64) * row_dim + cols, mask=lanes[:, None] & (cols < row_dim))


@triton.jit
def _lane_rows(
    values_base, slot, row_stride, buf_ptr, offs, lanes, row_dim, TO_TABLE: tl.constexpr, DIM_BLOCK: tl.constexpr,
    CACHE: tl.constexpr, FIRST: tl.constexpr,
):
    """For lanes: values FIRST .. row_dim - 1 of the table row at `slot` to row offs of buf
    (N, row_dim), or back (TO_TABLE). CACHE: the table rows' load cache modifier."""
    row_ptr = tl.multiple_of(values_base + slot * row_stride, ROW_ALIGN)  # rows start 16-element aligned
    buf_row = buf_ptr + offs[:, None].to(tl.int64) * row_dim
    for c in range(FIRST, row_dim, DIM_BLOCK):
        cols = c + tl.arange(0, DIM_BLOCK)
        m = lanes[:, None] & (cols[None, :] < row_dim)
        if TO_TABLE:
            tl.store(row_ptr[:, None] + cols[None, :], tl.load(buf_row + cols[None, :], mask=m), mask=m)
        else:
            tl.store(buf_row + cols[None, :], tl.load(row_ptr[:, None] + cols[None, :], mask=m, cache_modifier=CACHE), mask=m)


@triton.jit(do_not_specialize=["n"])  # n changes from call to call (multi_table_kernels.py)
def _find_kernel(
    query_ptr, tid_ptr, n, count_ptr, desc_ptr, slot_ptr, out_ptr, out_dim, row_stride, score_ptr,
    BUCKET: tl.constexpr, BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr, GATHER: tl.constexpr,
    MULTI: tl.constexpr, ALIGN: tl.constexpr, COUNTED: tl.constexpr, FOUND: tl.constexpr, SCORED: tl.constexpr,
):
    """slot of each query key in its table (or -1); MULTI: table tid[i], else table 0.
    FOUND: slot_ptr (int8) gets whether each key is found instead.
    COUNTED: only the first count_ptr[0] keys (a device count) are looked up.
    GATHER: also copy the first out_dim values of found rows into out (rows of missing keys
    are left untouched). SCORED: score_ptr gets each key's stored score (0 if absent)."""
    if COUNTED:
        n = tl.load(count_ptr)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    t, key, h, bucket = _lane_bucket(offs, live, query_ptr, tid_ptr, desc_ptr, MULTI)
    digests_base = _field(desc_ptr, t, _DIGESTS).to(tl.pointer_type(tl.uint8))
    key_row = tl.multiple_of(_field(desc_ptr, t, _KEYS).to(tl.pointer_type(tl.int64)) + bucket * BUCKET, ALIGN)
    # the digests kept in L2: they are 1/8 of a key's traffic at dim 128
    col, _ = _find_column(digests_base, key_row, bucket, key, _digest(h), live, BUCKET, ALIGN, "", "evict_last")
    found = col < BUCKET
    slot = tl.where(found, bucket * BUCKET + col, -1)
    if FOUND:
        tl.store(slot_ptr + offs, found.to(tl.int8), mask=live)
    else:
        tl.store(slot_ptr + offs, slot, mask=live)
    if SCORED:
        score_base = _field(desc_ptr, t, _SCORES).to(tl.pointer_type(tl.int64))
        score = tl.load(score_base + slot, mask=live & found, other=0)
        tl.store(score_ptr + offs, score, mask=live)
    if GATHER:
        values_base = _field(desc_ptr, t, _VALUES).to(tl.pointer_type(out_ptr.dtype.element_ty))
        _lane_rows(values_base, slot, row_stride, out_ptr, offs, found, out_dim, False, DIM_BLOCK, "", 0)


def _grid(n: int, block: int) -> tuple[int]:
    return (max(1, cdiv(n, block)),)


# keys per block and warps of the probe: small programs keep more memory requests in flight
FIND_BLOCK, FIND_WARPS = 8, 2


@functools.cache
def _find_launch(
    n_args: int, bucket_size: int, out_dim: int, gather: bool, multi: bool, counted: bool, found: bool, scored: bool,
):
    """probe's launch of _find_kernel on n_args arguments, prepared."""
    return prepare(
        _find_kernel, n_args, BUCKET=bucket_size, BLOCK=FIND_BLOCK, DIM_BLOCK=min(128, next_power_of_2(max(out_dim, 1))),
        GATHER=gather, MULTI=multi, ALIGN=min(bucket_size, 16), COUNTED=counted, FOUND=found, SCORED=scored,
        num_warps=FIND_WARPS,
    )


def probe(
    stack: TableStack, keys: torch.Tensor, bucket_size: int, row_stride: int, tids: torch.Tensor | None = None,
    out: torch.Tensor | None = None, count: torch.Tensor | None = None, found_only: bool = False,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slots of keys (-1 if absent) in the tables of `stack` (key i in table tids[i], or all
    in table 0), or with found_only whether each is stored (bool). `out` (N, d) receives
    the first d values of found rows (rows `row_stride` values apart in the tables);
    `scores` (N,) int64 the stored scores (0 where absent). count: a device scalar; only
    the first `count` keys are looked up (the other slots and scores are left unset). The
    reserved key is never found. Twin: probe_reference.probe_reference."""
    n = keys.numel()
    slots = torch.empty(n, dtype=torch.bool if found_only else torch.int64, device=keys.device)
    if n == 0:
        return slots
    out_dim = out.shape[1] if out is not None else 0
    args = (
        keys, tids if tids is not None else keys, n, count if count is not None else keys, stack.desc,
        slots.view(torch.int8) if found_only else slots, out if out is not None else slots, out_dim, row_stride,
        scores if scores is not None else slots,
    )
    find = _find_launch(
        len(args), bucket_size, out_dim, out is not None, tids is not None, count is not None, found_only, scores is not None,
    )
    launch_each(args, ((_grid(n, FIND_BLOCK), find),))
    return slots
