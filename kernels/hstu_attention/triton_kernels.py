"""HSTU attention on jagged sequences as Triton kernels, with the signature of the twin in
reference.py (which states the computation and the masks).

Forward: a program per block of BLOCK_M query rows of one sequence and head (or of two
consecutive heads, where the head count is even and the device's shared memory holds both
heads' blocks) steps through the key blocks its rows may
attend to, computing the scores in float32 with the two biases looked up from their tables
inside the kernel (no (L, L) tensor in memory), and accumulates SiLU(scores) / max_seq_len
· V. The biases and the mask are the same for every head, and cost more per pair than the
products: two heads a program compute them once for both. The grid is sized by
max_seq_len, so no length is read on the host; programs past their sequence's end return
at once.
Backward: a kernel per key block recomputes the scores and gives dK and dV, writing each
tile's dS (the scores' gradient) into a buffer; from it dQ is a product with K and the
biases' gradients a sum over the heads per pair (score_grads.py), added by atomic adds
into copies of float32 tables that are summed after the launch (bias_grads.py). The
buffer holds up to SCORE_GRADS_BUFFER_BYTES, some sequences at a time; where one
sequence's dS would not fit, a kernel per query block recomputes the scores once more
for dQ and the biases' gradients, each head's on its own.

From PAIR_BIAS_TILES_MIN_LENGTH on and where the buffer fits (_pair_bias_tiles), a
prepass writes both biases of every attended pair once (bias_tiles.py), and the forward and the dK dV kernel read each tile's biases from it, so
their tiles do no per-pair bias work; the mask remains. Otherwise, and in the kernels that
need each pair's bucket (the biases' gradients), each kernel walks its tiles in three
loops: the tiles whose every pair is allowed (wholly
below the diagonal and inside the history) skip the mask, and of those, the run farthest
from the diagonal whose gaps span two time buckets at most takes the bucket from one
comparison per pair (time_buckets.py; from a length class of TWO_BUCKET_MIN_LENGTH); the
rest (the diagonal, the targets, the context prefix, a sequence's last partial block)
compute the mask. Timestamps enter as float64 offsets from the sequence's first one, exact
below 2^53 time units, so each pair's gap is one float64 subtraction that rounds to
float32 as the twin's int64 gap does.
"""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..autotune import TunedLaunches, autotuned
from ..launch import cdiv, next_power_of_2
from . import score_grads
from .bias_tiles import _pair_biases_slot, pair_biases
from .bias_grads import BIAS_GRAD_COPIES, _add_bias_grads, _bias_grad_copy
from .reference import time_bucket_edges
from .score_grads import _row_length, _score_grads_at, _score_grads_slot, score_grads_row_length
from .tiles import (
    _allowed, _attend, _biased_scores, _biases, _counted, _head_rows, _key_ranges, _load_head_rows, _program_block, _query_ranges,
    _row_block, _sigmoid, _two_bucket_run,
)
from .time_buckets import _tile_buckets, _tile_extremes, bucket_thresholds, timestamp_extremes

# blocks of query and key rows, warps and pipeline stages, tuned per head dims and length
CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
    for m, n, w, st in ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3))
]
INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
LARGEST_BLOCK = max(max(c.kwargs.values()) for c in CONFIGS)  # the timestamp extremes cover a sequence in such blocks
# Tiles spanning two time buckets at most take a loop of their own (time_buckets.py) where
# max_seq_len's power of two (the tuning key's length class) is at least this: shorter
# sequences have few tiles far enough from the diagonal, and the prepass and the
# per-program scan cost them more than those tiles save.
TWO_BUCKET_MIN_LENGTH = 1024
# The backward stores each tile's dS and takes dQ and the biases' gradients from it
# (score_grads.py), the sequences run through a buffer of at most this many bytes, and at
# most 1 / SCORE_GRADS_MEMORY_SHARE of the GPU's memory, as many sequences at a time as fit
# (one pass where all do: a pass per few sequences leaves the GPU part idle at the end of
# each); a batch whose one sequence's dS (heads · max_seq_len² entries) does not fit is
# recomputed from the scores instead. 4 GiB holds B32 N4096 H4 in bfloat16.
SCORE_GRADS_BUFFER_BYTES = 4 << 30
SCORE_GRADS_MEMORY_SHARE = 16
DESCRIPTOR_STORE_MIN_CAPABILITY = 9  # the Tensor Memory Accelerator's: Hopper on
# The forward and the dK dV kernel read both biases of each pair from a prepass's buffer
# (bias_tiles.py) from PAIR_BIAS_TILES_MIN_LENGTH on, where it fits the stored dS's budget
# (_pair_bias_tiles); otherwise each tile computes them (the two-bucket tiles and the
# rest). HSTU_PAIR_BIAS_TILES=0 turns the prepass off. Below that length the prepass's
# launch costs more than it saves (benchmarks/hstu_attention.md, "Both biases from a
# prepass, read as tiles").
PAIR_BIAS_TILES_ENV = "HSTU_PAIR_BIAS_TILES"
PAIR_BIAS_TILES = os.environ.get(PAIR_BIAS_TILES_ENV, "1") != "0"
PAIR_BIAS_TILES_MIN_LENGTH = 256
TUNING_KEY = ["DQK", "DV", "length_class"]  # length_class: max_seq_len's power of two
MIN_HEAD_DIM = 16  # tl.dot's least inner size: smaller heads are padded with masked columns


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
def _forward_tile(
    acc, acc2, q, q2, rows, t_rows, n0, k_ptr, v_ptr, timestamps_ptr, start, t0, n, history_end, heads, h,
    position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, threshold, low, high, biases_in, m0,
    MASKED: tl.constexpr, TWO_BUCKETS: tl.constexpr, PAIR: tl.constexpr, BIAS_TILES: tl.constexpr,
    BY_DESCRIPTOR: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The tile of key rows n0 .. n0 + BLOCK_N - 1 added into head h's acc, and (PAIR) head
    h + 1's acc2: the biases and the mask are the heads' own, computed once for both, or
    (BIAS_TILES) read from the prepass's tile (bias_tiles.py): biases_in is the sequence's
    descriptor (BY_DESCRIPTOR), else its block's pointer."""
    cols, col_live, k, v, t_cols = _row_block(k_ptr, v_ptr, timestamps_ptr, start, t0, n0, n, heads, h, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV)
    if BIAS_TILES:
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
        k2 = _load_head_rows(k_ptr, start, cols, col_live, heads, h + 1, DQK, BLOCK_DQK)
        v2 = _load_head_rows(v_ptr, start, cols, col_live, heads, h + 1, DV, BLOCK_DV)
        acc2 = _attend(acc2, q2, k2, v2, bias, allowed, scale, MASKED)
    return acc, acc2


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, offsets_ptr, timestamps_ptr, targets_ptr, position_ptr, time_ptr, edges_ptr,
    thresholds_ptr, ext_ptr, ext_blocks, biases_ptr, heads, max_seq_len, num_buckets, context_len, scale, length_class,
    HAS_TARGETS: tl.constexpr, TWO_BUCKET_TILES: tl.constexpr, PAIR: tl.constexpr, BIAS_TILES: tl.constexpr,
    BY_DESCRIPTOR: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The output of a block of query rows of one head, or (PAIR) of two consecutive heads,
    which share the tiles' biases and masks; BIAS_TILES: the biases read from biases_ptr,
    the prepass's buffer (bias_tiles.py), through a descriptor of the sequence's block
    where BY_DESCRIPTOR."""
    m0, h, b, start, n, history_end, t0 = _program_block(
        offsets_ptr, targets_ptr, timestamps_ptr, heads, BLOCK_M, HAS_TARGETS, 2 if PAIR else 1,
    )
    if m0 >= n:
        return
    biases_in = biases_ptr
    if BIAS_TILES:
        biases_in = _biases_in(biases_ptr, b, n, max_seq_len, BY_DESCRIPTOR, BLOCK_M, BLOCK_N)
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
                acc, acc2, q, q2, rows, t_rows, n0, k_ptr, v_ptr, timestamps_ptr, start, t0, n, history_end, heads, h,
                position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, threshold, low, high, biases_in,
                m0, False, True, PAIR, BIAS_TILES, BY_DESCRIPTOR, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
            )
    for n0 in range(split, full, BLOCK_N):
        acc, acc2 = _forward_tile(
            acc, acc2, q, q2, rows, t_rows, n0, k_ptr, v_ptr, timestamps_ptr, start, t0, n, history_end, heads, h,
            position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, 0.0, 0.0, 0.0, biases_in, m0,
            False, False, PAIR, BIAS_TILES, BY_DESCRIPTOR, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
        )
    for n0 in range(full, end, BLOCK_N):
        acc, acc2 = _forward_tile(
            acc, acc2, q, q2, rows, t_rows, n0, k_ptr, v_ptr, timestamps_ptr, start, t0, n, history_end, heads, h,
            position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, 0.0, 0.0, 0.0, biases_in, m0,
            True, False, PAIR, BIAS_TILES, BY_DESCRIPTOR, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
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
    dk_acc, dv_acc, k, v, cols, col_live, t_cols, m0, n0, q_ptr, do_ptr, ds_out, timestamps_ptr, start, t0, n, history_end,
    heads, h, b, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, threshold, low, high,
    biases_in, MASKED: tl.constexpr, TWO_BUCKETS: tl.constexpr, STORE_DS: tl.constexpr, BY_DESCRIPTOR: tl.constexpr,
    BIAS_TILES: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dK and dV plus the query rows m0 .. m0 + BLOCK_M - 1's share; (STORE_DS) the tile's
    dS into ds_out: the sequence's descriptor (BY_DESCRIPTOR), else the buffer's pointer;
    (BIAS_TILES) the biases read through biases_in as the forward reads them."""
    rows, row_live, q, do, t_rows = _row_block(q_ptr, do_ptr, timestamps_ptr, start, t0, m0, n, heads, h, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV)
    if BIAS_TILES:
        s = tl.dot(q, tl.trans(k), input_precision="ieee" if q.dtype == tl.float32 else "tf32") + _tile_biases(
            biases_in, rows, cols, m0, n0, n, max_seq_len, BY_DESCRIPTOR,
        )
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
    BY_DESCRIPTOR: tl.constexpr, BIAS_TILES: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dK and dV of a block of key rows: Σ over the query rows that attend to them; and
    (STORE_DS) each tile's dS written into ds_ptr's buffer (score_grads.py), through a
    tensor descriptor of the sequence's block of it where BY_DESCRIPTOR; BIAS_TILES: the
    biases read from biases_ptr, the pair biases' buffer (bias_tiles.py), through a
    descriptor where BY_DESCRIPTOR."""
    n0, h, b, start, n, history_end, t0 = _program_block(offsets_ptr, targets_ptr, timestamps_ptr, heads, BLOCK_N, HAS_TARGETS)
    if n0 >= n:
        return
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
            dk_acc, dv_acc, k, v, cols, col_live, t_cols, m0, n0, q_ptr, do_ptr, ds_out, timestamps_ptr, start, t0, n,
            history_end, heads, h, b, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, 0.0, 0.0, 0.0,
            biases_in, True, False, STORE_DS, BY_DESCRIPTOR, BIAS_TILES, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV,
        )
    # the unmasked query blocks: the rest, then those to the last whose tiles span two buckets at most
    split, lo, hi, entry = _two_bucket_run(
        ext_ptr, ext_blocks, b, t_cols, col_live, full, n, edges_ptr, num_buckets, BLOCK_M, False, TWO_BUCKET_TILES,
    )
    for m0 in range(full, split, BLOCK_M):
        dk_acc, dv_acc = _backward_kv_tile(
            dk_acc, dv_acc, k, v, cols, col_live, t_cols, m0, n0, q_ptr, do_ptr, ds_out, timestamps_ptr, start, t0, n,
            history_end, heads, h, b, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, 0.0, 0.0, 0.0,
            biases_in, False, False, STORE_DS, BY_DESCRIPTOR, BIAS_TILES, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV,
        )
    if TWO_BUCKET_TILES:
        last = (tl.cdiv(n, BLOCK_M) - 1) * BLOCK_M  # (the last query block: no extremes are read past it)
        q_lo, q_hi = _tile_extremes(ext_ptr, entry, tl.minimum(split, last), BLOCK_M)  # (a tile ahead, as the forward)
        for m0 in range(split, n, BLOCK_M):
            _, threshold, low, high = _tile_buckets(q_lo, q_hi, lo, hi, thresholds_ptr, time_ptr, edges_ptr, num_buckets)
            q_lo, q_hi = _tile_extremes(ext_ptr, entry, tl.minimum(m0 + BLOCK_M, last), BLOCK_M)
            dk_acc, dv_acc = _backward_kv_tile(
                dk_acc, dv_acc, k, v, cols, col_live, t_cols, m0, n0, q_ptr, do_ptr, ds_out, timestamps_ptr, start, t0, n,
                history_end, heads, h, b, position_ptr, time_ptr, edges_ptr, max_seq_len, num_buckets, context_len, scale, threshold, low, high,
                biases_in, False, True, STORE_DS, BY_DESCRIPTOR, BIAS_TILES, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV,
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
_forward = TunedLaunches(autotuned(_forward_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY + ["PAIR", "BIAS_TILES"]))
_backward_kv = TunedLaunches(autotuned(_backward_kv_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY + ["STORE_DS", "BIAS_TILES"]))
# (adds into the biases' gradients: zeroed before each trial)
_backward_q = TunedLaunches(autotuned(
    _backward_q_kernel, CONFIGS, INTERPRETER_CONFIG, TUNING_KEY, reset_to_zero=["position_grad_ptr", "time_grad_ptr"]
))


def _grid(rows_block: str, programs: int, max_seq_len: int):
    """The grid of a launch: blocks of rows_block rows over max_seq_len, one column per
    sequence and head."""
    return lambda meta: (cdiv(max_seq_len, meta[rows_block]), programs)


def _two_bucket_tiles(max_seq_len: int) -> bool:
    return next_power_of_2(max_seq_len) >= TWO_BUCKET_MIN_LENGTH


_tables: dict = {}  # (num_buckets, device): the bucket edges and thresholds there (_time_tables)


def _bucket_tables(num_buckets: int, device: torch.device) -> tuple:
    """(time_bucket_edges as float32, time_buckets.bucket_thresholds as float64) on device,
    made once per number of buckets and device."""
    key = (num_buckets, device)
    if key not in _tables:
        _tables[key] = (
            torch.tensor(time_bucket_edges(num_buckets), dtype=torch.float32, device=device),
            torch.tensor(bucket_thresholds(num_buckets), dtype=torch.float64, device=device),
        )
    return _tables[key]


def _time_tables(
    num_buckets: int, offsets: torch.Tensor, timestamps: torch.Tensor, max_seq_len: int, two_buckets: bool | None = None,
) -> tuple:
    """What the kernels read to bucket gaps: time_bucket_edges as float32,
    time_buckets.bucket_thresholds as float64 (both made once per number of buckets and
    device), and, where two-bucket tiles run (two_buckets; None: _two_bucket_tiles), the
    sequences' timestamp extremes per block with their blocks per sequence (else the
    thresholds and 0, unread)."""
    edges, thresholds = _bucket_tables(num_buckets, timestamps.device)
    if not (_two_bucket_tiles(max_seq_len) if two_buckets is None else two_buckets):
        return edges, thresholds, thresholds, 0
    ext = timestamp_extremes(offsets, timestamps, max_seq_len, LARGEST_BLOCK)
    return edges, thresholds, ext, ext.shape[1]


# (device, dtype, BLOCK_DQK, BLOCK_DV) where no tiling of the forward with two heads a
# program fits the device's shared memory (every head dim above 128 on an H100; head dim
# 128 on GPUs of about 100 KB a block): those run one head a program
_unpaired: set = set()


def _launch_shape(q, v, offsets, max_seq_len):
    """(heads, sequences × heads, the head dims and their blocks as the kernels' constants)."""
    dqk, dv = q.shape[2], v.shape[2]
    dims = dict(
        DQK=dqk, DV=dv, BLOCK_DQK=max(MIN_HEAD_DIM, next_power_of_2(dqk)), BLOCK_DV=max(MIN_HEAD_DIM, next_power_of_2(dv))
    )
    return q.shape[1], (offsets.numel() - 1) * q.shape[1], dims


def hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0,
) -> torch.Tensor:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    heads, programs, dims = _launch_shape(q, v, offsets, max_seq_len)
    out = v.new_empty(v.shape)
    if out.numel() and programs:
        num_buckets = time_bias.numel() - 1
        tiled = _pair_bias_tiles(offsets.numel() - 1, max_seq_len, q.dtype, q.device)
        two_buckets = not tiled and _two_bucket_tiles(max_seq_len)
        tables = _time_tables(num_buckets, offsets, timestamps, max_seq_len, two_buckets)
        biases, by_descriptor = position_bias, False  # (unread without the tiles)
        if tiled:
            biases = pair_biases(offsets, timestamps, position_bias, time_bias, max_seq_len, tables[0], q.dtype, num_targets, context_len)
            by_descriptor = _descriptor_stores(q.device)
            if by_descriptor and q.is_cuda:  # (the descriptor's scratch, as the backward's)
                triton.set_allocator(_descriptor_scratch)
        args = (q, k, v, out, offsets, timestamps, num_targets if num_targets is not None else offsets, position_bias, time_bias,
                *tables, biases, heads, max_seq_len, num_buckets, context_len, 1.0 / max_seq_len, next_power_of_2(max_seq_len))
        common = dict(
            HAS_TARGETS=num_targets is not None, TWO_BUCKET_TILES=two_buckets, BIAS_TILES=tiled,
            BY_DESCRIPTOR=by_descriptor, **dims,
        )
        # two heads a program, which share the per-pair bias work, where the head count is
        # even and the device's shared memory holds both heads' key and value blocks
        unpaired_key = (q.device, q.dtype, dims["BLOCK_DQK"], dims["BLOCK_DV"])
        if heads % 2 == 0 and unpaired_key not in _unpaired:
            try:
                _forward(_grid("BLOCK_M", programs // 2, max_seq_len), args, dict(common, PAIR=True))
                return out
            except OutOfResources:  # raised before the kernel runs: nothing written
                _unpaired.add(unpaired_key)
        try:
            _forward(_grid("BLOCK_M", programs, max_seq_len), args, dict(common, PAIR=False))
        except OutOfResources as e:
            device = torch.cuda.get_device_name(q.device) if q.is_cuda else str(q.device)
            raise RuntimeError(
                f"hstu_attention: head dims {q.shape[2]} (q, k) and {v.shape[2]} (v) need more shared memory than "
                f"{device} has for any tile of the forward ({e})"
            ) from e
    return out


def hstu_attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0, bias_grads: bool = True,
):
    """(dq, dk, dv, d position_bias, d time_bias); the biases' gradients are float32 (None
    without bias_grads)."""
    q, k, v, grad = q.contiguous(), k.contiguous(), v.contiguous(), grad.contiguous()
    heads, programs, dims = _launch_shape(q, v, offsets, max_seq_len)
    # every row belongs to a sequence, whose programs write it whole
    dq, dk, dvv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # the copies of both biases' gradients as the rows of one tensor, zeroed and summed once
    bias_sizes = [position_bias.numel(), time_bias.numel()]
    copies = torch.zeros(BIAS_GRAD_COPIES if bias_grads else 1, sum(bias_sizes), dtype=torch.float32, device=q.device)
    position_grad, time_grad = copies.split(bias_sizes, dim=1)
    if q.shape[0] and programs:
        num_buckets = time_bias.numel() - 1
        tables = _time_tables(num_buckets, offsets, timestamps, max_seq_len)
        common = dict(HAS_TARGETS=num_targets is not None, TWO_BUCKET_TILES=_two_bucket_tiles(max_seq_len), **dims)
        sizes = (heads, max_seq_len, num_buckets, context_len, 1.0 / max_seq_len, next_power_of_2(max_seq_len))
        sequences = offsets.numel() - 1
        chunk = _score_grads_chunk(sequences, heads, max_seq_len, q.dtype, q.device)
        if chunk == 0:  # dQ and the biases' gradients recomputed from the scores
            targets = num_targets if num_targets is not None else offsets
            _backward_kv(
                _grid("BLOCK_N", programs, max_seq_len),
                (q, k, v, grad, dk, dvv, dk, offsets, timestamps, targets, position_bias, time_bias, *tables, position_bias, *sizes),
                dict(STORE_DS=False, BY_DESCRIPTOR=False, BIAS_TILES=False, **common),
            )
            _backward_q(
                _grid("BLOCK_M", programs, max_seq_len),
                (q, k, v, grad, dq, offsets, timestamps, targets, position_bias, time_bias, tables[0], position_grad,
                 time_grad, *tables[1:], *sizes),
                dict(BIAS_GRADS=bias_grads, **common),
            )
        else:  # from the tiles' stored dS, `chunk` sequences at a time (score_grads.py)
            ds = q.new_empty(chunk, heads, max_seq_len, score_grads_row_length(max_seq_len))
            by_descriptor = _descriptor_stores(q.device)
            if by_descriptor and q.is_cuda:  # (per thread: the backward may run on autograd's own)
                triton.set_allocator(_descriptor_scratch)
            # the forward's biases, made again per chunk: a chunk's pair biases are the size
            # of one head's dS in the buffer, so they fit wherever the buffer does
            tiled = _pair_bias_tiles(chunk, max_seq_len, q.dtype, q.device)
            for first in range(0, sequences, chunk):
                part = _some_sequences(first, min(sequences, first + chunk), offsets, num_targets, tables)
                part_offsets, part_targets, part_tables = part
                biases = position_bias  # (unread)
                if tiled:
                    biases = pair_biases(part_offsets, timestamps, position_bias, time_bias, max_seq_len, tables[0], q.dtype,
                                         part_targets, context_len)
                _backward_kv(
                    _grid("BLOCK_N", (part_offsets.numel() - 1) * heads, max_seq_len),
                    (q, k, v, grad, dk, dvv, ds, part_offsets, timestamps, part_targets if part_targets is not None else
                     part_offsets, position_bias, time_bias, *part_tables, biases, *sizes),
                    dict(common, STORE_DS=True, BY_DESCRIPTOR=by_descriptor, BIAS_TILES=tiled,
                         TWO_BUCKET_TILES=common["TWO_BUCKET_TILES"] and not tiled),
                )
                _launch_dq(ds, k, dq, part_offsets, timestamps, max_seq_len, part_targets, context_len)
                if bias_grads:
                    _launch_bias_grads(
                        ds, part_offsets, timestamps, max_seq_len, num_buckets, part_targets, context_len, part_tables,
                        position_grad, time_grad,
                    )
    if not bias_grads:
        return dq, dk, dvv, None, None
    return dq, dk, dvv, *copies.sum(0).split(bias_sizes)


def _pair_bias_tiles(sequences: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the forward (or the backward, per chunk of sequences) reads its biases from
    the prepass's buffer (bias_tiles.py): with PAIR_BIAS_TILES on, from
    PAIR_BIAS_TILES_MIN_LENGTH on, where the buffer, laid out as the stored dS of one head,
    holds all of the sequences within the stored dS's budget (_score_grads_chunk); else
    each tile computes them."""
    return (
        PAIR_BIAS_TILES and max_seq_len >= PAIR_BIAS_TILES_MIN_LENGTH
        and _score_grads_chunk(sequences, 1, max_seq_len, dtype, device) == sequences
    )


def _score_grads_chunk(sequences: int, heads: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> int:
    """How many sequences the backward runs through the stored dS buffer at a time: 0,
    none (it recomputes dQ and the biases' gradients), where one sequence's dS is larger
    than the buffer may be (SCORE_GRADS_BUFFER_BYTES, and on a GPU a share of its memory)."""
    budget = SCORE_GRADS_BUFFER_BYTES
    if device.type == "cuda":
        budget = min(budget, _device_memory(device) // SCORE_GRADS_MEMORY_SHARE)
    return min(sequences, budget // (heads * max_seq_len * score_grads_row_length(max_seq_len) * dtype.itemsize))


@functools.cache
def _descriptor_stores(device: torch.device) -> bool:
    """Whether the dK dV kernel stores dS through tensor descriptors: on GPUs with the
    Tensor Memory Accelerator, and under the interpreter (so that CI runs that path)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device)[0] >= DESCRIPTOR_STORE_MIN_CAPABILITY


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the tensor descriptors a kernel makes, which Triton asks for at
    each launch of such a kernel (freed after it: later work on the stream comes after)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _score_grads_buffer(ds: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """ds (B, H, max_seq_len, max_seq_len) in the kernels' layout, rows of
    score_grads_row_length(max_seq_len) entries: itself if a view of such a buffer, else a
    copy (the padding unset)."""
    b, h = ds.shape[:2]
    row = score_grads_row_length(max_seq_len)
    if ds.stride() == (h * max_seq_len * row, max_seq_len * row, row, 1):
        return ds
    padded = ds.new_empty(b, h, max_seq_len, row)
    padded[..., :max_seq_len] = ds
    return padded


@functools.cache
def _device_memory(device: torch.device) -> int:
    """The GPU's memory in bytes."""
    return torch.cuda.get_device_properties(device).total_memory


def _some_sequences(first: int, last: int, offsets: torch.Tensor, num_targets: torch.Tensor | None, tables: tuple):
    """(offsets, num_targets, _time_tables) of sequences first .. last - 1 alone: views, so
    that a launch over them sees a batch of those (the tensors themselves for all of them,
    the common case, which makes no views)."""
    if first == 0 and last == offsets.numel() - 1:
        return offsets, num_targets, tables
    edges, thresholds, ext, ext_blocks = tables
    if ext_blocks:  # (else ext is a placeholder, unread)
        ext = ext[first:last]
    return offsets[first:last + 1], None if num_targets is None else num_targets[first:last], (edges, thresholds, ext, ext_blocks)


def _launch_dq(ds, k, dq, offsets, timestamps, max_seq_len, num_targets, context_len) -> None:
    heads, dqk = k.shape[1], k.shape[2]
    score_grads._dq(
        lambda meta: (cdiv(max_seq_len, meta["BLOCK_M"]), (offsets.numel() - 1) * heads),
        (ds, k, dq, offsets, timestamps, num_targets if num_targets is not None else offsets, heads, max_seq_len,
         context_len, next_power_of_2(max_seq_len)),
        dict(HAS_TARGETS=num_targets is not None, DQK=dqk, BLOCK_DQK=max(MIN_HEAD_DIM, next_power_of_2(dqk))),
    )


def _launch_bias_grads(
    ds, offsets, timestamps, max_seq_len, num_buckets, num_targets, context_len, tables, position_grad, time_grad,
) -> None:
    """Adds into the copies position_grad and time_grad (views of the rows of one tensor)."""
    score_grads._bias_grads(
        lambda meta: (cdiv(max_seq_len, meta["BLOCK_M"]), offsets.numel() - 1),
        (ds, offsets, timestamps, num_targets if num_targets is not None else offsets, tables[0], position_grad,
         time_grad, *tables[1:], max_seq_len, num_buckets, context_len, next_power_of_2(max_seq_len)),
        dict(HAS_TARGETS=num_targets is not None, TWO_BUCKET_TILES=_two_bucket_tiles(max_seq_len), HEADS=ds.shape[1]),
    )


def dq_from_score_grads(
    ds: torch.Tensor, k: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0,
) -> torch.Tensor:
    """(total, H, dqk) dQ from ds (B, H, max_seq_len, max_seq_len), each sequence's dS,
    read only where a row attends (reference.dq_from_score_grads states it)."""
    dq = torch.empty_like(k)
    if k.shape[0] and offsets.numel() > 1:
        _launch_dq(_score_grads_buffer(ds, max_seq_len), k.contiguous(), dq, offsets, timestamps, max_seq_len, num_targets, context_len)
    return dq


def bias_grads_from_score_grads(
    ds: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor, max_seq_len: int, num_buckets: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d position_bias, d time_bias), float32, from ds as dq_from_score_grads reads it
    (reference.bias_grads_from_score_grads states it)."""
    sizes = [2 * max_seq_len - 1, num_buckets + 1]
    copies = torch.zeros(BIAS_GRAD_COPIES, sum(sizes), dtype=torch.float32, device=ds.device)
    if timestamps.numel() and offsets.numel() > 1:
        _launch_bias_grads(
            _score_grads_buffer(ds, max_seq_len), offsets, timestamps, max_seq_len, num_buckets, num_targets, context_len,
            _time_tables(num_buckets, offsets, timestamps, max_seq_len), *copies.split(sizes, dim=1),
        )
    return tuple(copies.sum(0).split(sizes))
