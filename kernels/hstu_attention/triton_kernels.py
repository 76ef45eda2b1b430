"""HSTU attention on jagged sequences through Triton, with the signature of the twin in
reference.py (which states the computation and the masks): what runs and with which
buffers; the programs are in attention_kernels.py.

Forward: one launch of the forward kernel, two heads a program where they share per-pair
work (_pairs_heads) and the device's shared memory holds both heads' blocks. The biases
and the mask are the same for every head, and cost more per pair than the products: from
PAIR_BIAS_TILES_MIN_LENGTH on and where the buffer fits (_pair_bias_tiles), a prepass
writes both biases of every attended pair once (bias_tiles.py), and the forward and the dK
dV kernel read each tile's biases from it; otherwise each tile computes them (from a
length class of TWO_BUCKET_MIN_LENGTH with the two-bucket loop, time_buckets.py). Where
they read the prepass's biases, on GPUs with the Tensor Memory Accelerator, the forward
reads K and V, and the dK dV kernel Q and dO, through tensor descriptors
(_rows_by_descriptor).
Backward: the dK dV kernel writes each tile's dS into a buffer; from it dQ is a product
with K and the biases' gradients a sum over the heads per pair (score_grads.py), added by
atomic adds into copies of float32 tables that are summed after the launch
(bias_grads.py). The dS buffer holds up to SCORE_GRADS_BUFFER_BYTES, some sequences at a
time; where one sequence's dS would not fit, a kernel per query block recomputes the
scores once more for dQ and the biases' gradients, each head's on its own. The dK dV
kernel reads the pair biases from the forward's buffer, kept until then (KEEP_PAIR_BIASES,
within kept_biases.py's budget), or else from the prepass run again per chunk of sequences.
"""
import functools
import os
import weakref

import torch
import triton
from triton.runtime.errors import OutOfResources

from ..backend import device_memory as _device_memory  # (tests replace it here)
from ..launch import cdiv, next_power_of_2
from . import score_grads
from .attention_kernels import LARGEST_BLOCK, _backward_kv, _backward_q, _forward
from .bias_tiles import pair_biases
from .bias_grads import BIAS_GRAD_COPIES
from .kept_biases import keep
from .reference import time_bucket_edges
from .score_grads import score_grads_row_length
from .time_buckets import bucket_thresholds, timestamp_extremes

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
# prepass, timed").
PAIR_BIAS_TILES_ENV = "HSTU_PAIR_BIAS_TILES"
PAIR_BIAS_TILES = os.environ.get(PAIR_BIAS_TILES_ENV, "1") != "0"
PAIR_BIAS_TILES_MIN_LENGTH = 256
# The forward's pair biases are held until the backward, which reads them instead of
# running the prepass again: one prepass per layer and step less, for one buffer per layer
# held between the two (0.54 GB a layer at hstu-long's B16 N4096), within a budget of the
# device's memory (kept_biases.py). HSTU_KEEP_PAIR_BIASES=0 turns it off (a prepass again
# in each backward, no buffer held).
KEEP_PAIR_BIASES_ENV = "HSTU_KEEP_PAIR_BIASES"
KEEP_PAIR_BIASES = os.environ.get(KEEP_PAIR_BIASES_ENV, "1") != "0"
# Where the forward and the dK dV kernel read the prepass's biases, they read K's and V's
# blocks (the forward) and Q's and dO's (the dK dV kernel) through tensor descriptors of a
# head's rows (tiles._head_rows_in) on GPUs with the Tensor Memory Accelerator, where the
# rows' layout allows it (_rows_by_descriptor); HSTU_ROWS_BY_DESCRIPTOR=0 turns that off
# (pointer loads, as before Hopper). Only from ROWS_BY_DESCRIPTOR_MIN_HEAD_DIM: with the
# biases per tile (the paper presets' length 200), and at head dim 64, descriptors were
# slower (benchmarks/hstu_attention.md, "K and V through descriptors").
ROWS_BY_DESCRIPTOR_ENV = "HSTU_ROWS_BY_DESCRIPTOR"
ROWS_BY_DESCRIPTOR = os.environ.get(ROWS_BY_DESCRIPTOR_ENV, "1") != "0"
ROWS_BY_DESCRIPTOR_MIN_HEAD_DIM = 128
DESCRIPTOR_ALIGN = 16  # bytes: where a descriptor's tensor starts, and between its rows
MIN_HEAD_DIM = 16  # tl.dot's least inner size: smaller heads are padded with masked columns


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


def _time_tables(num_buckets: int, offsets: torch.Tensor, timestamps: torch.Tensor, max_seq_len: int) -> tuple:
    """What the kernels read to bucket gaps: time_bucket_edges as float32,
    time_buckets.bucket_thresholds as float64 (both made once per number of buckets and
    device), and, where two-bucket tiles run (_two_bucket_tiles), the sequences' timestamp
    extremes per block with their blocks per sequence (else the thresholds and 0, unread)."""
    edges, thresholds = _bucket_tables(num_buckets, timestamps.device)
    if not _two_bucket_tiles(max_seq_len):
        return edges, thresholds, thresholds, 0
    ext = _batch_extremes(offsets, timestamps, max_seq_len)
    return edges, thresholds, ext, ext.shape[1]


# Calls on the same batch share its timestamp extremes (_batch_extremes); False: each call
# makes its own (a setting to compare the two: benchmarks/alternation.py)
REUSE_BATCH_EXTREMES = True
# the last batch's timestamp extremes: (offsets and timestamps as weak references, their
# version counters, max_seq_len, the extremes), or None
_last_extremes = None


def _batch_extremes(offsets: torch.Tensor, timestamps: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """timestamp_extremes(offsets, timestamps, max_seq_len, LARGEST_BLOCK), made once for a
    batch: every block of a model, forward and backward, reads the same ones. The last
    call's are returned while offsets and timestamps are the same tensors, unchanged since
    (their version counters, which in-place writes advance), at the same max_seq_len; not
    kept for inference tensors (no version counter) or while a CUDA graph is captured (its
    memory must come from the graph's pool). Writes that bypass the version counters (a
    kernel writing through a pointer, `.data`) are not seen: the batch's tensors must not
    be written that way between calls."""
    global _last_extremes
    keep = REUSE_BATCH_EXTREMES and not (offsets.is_inference() or timestamps.is_inference()) and not (
        timestamps.is_cuda and torch.cuda.is_current_stream_capturing()
    )
    if keep and _last_extremes is not None:
        last_offsets, last_timestamps, versions, length, ext = _last_extremes
        if (last_offsets() is offsets and last_timestamps() is timestamps and length == max_seq_len
                and versions == (offsets._version, timestamps._version)):
            return ext
    ext = timestamp_extremes(offsets, timestamps, max_seq_len, LARGEST_BLOCK)
    if keep:
        _last_extremes = (weakref.ref(offsets), weakref.ref(timestamps), (offsets._version, timestamps._version), max_seq_len, ext)
    return ext


# (device, dtype, BLOCK_DQK, BLOCK_DV) where no tiling of the forward with two heads a
# program fits the device's shared memory (every head dim above 128 on an H100; head dim
# 128 on GPUs of about 100 KB a block): those run one head a program
_unpaired: set = set()


def _pairs_heads(heads: int, rows_by_descriptor: bool) -> bool:
    """Whether the forward runs two heads a program (where the device's shared memory holds
    both heads' key and value blocks): where the head count is even, and K and V come
    through pointers. With K and V through descriptors the biases come from the prepass's
    tiles (_rows_by_descriptor's rule), so there is no per-pair work for two heads to
    share, and one head a program takes fewer registers and runs faster
    (benchmarks/hstu_attention.md, "K and V through descriptors")."""
    return heads % 2 == 0 and not rows_by_descriptor


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
    return attention_forward(q, k, v, offsets, timestamps, position_bias, time_bias, max_seq_len, num_targets, context_len)[0]


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0, keep_biases: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hstu_attention's output, the prepass's pair biases where the forward read them,
    keep_biases asks to keep them for a backward, KEEP_PAIR_BIASES allows it and they fit
    kept_biases's budget; else None)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    heads, programs, dims = _launch_shape(q, v, offsets, max_seq_len)
    out, kept = v.new_empty(v.shape), None
    if out.numel() and programs:
        num_buckets = time_bias.numel() - 1
        tiled = _pair_bias_tiles(offsets.numel() - 1, max_seq_len, q.dtype, q.device)
        # (the two-bucket tiles run in the prepass where the biases come from it, else in the forward)
        two_buckets = not tiled and _two_bucket_tiles(max_seq_len)
        tables = _time_tables(num_buckets, offsets, timestamps, max_seq_len)
        biases, by_descriptor = position_bias, False  # (unread without the tiles)
        if tiled:
            biases = pair_biases(offsets, timestamps, position_bias, time_bias, max_seq_len, tables, q.dtype, num_targets, context_len)
            by_descriptor = _descriptor_stores(q.device)
            if by_descriptor and q.is_cuda:  # (the descriptors' scratch, as the backward's)
                triton.set_allocator(_descriptor_scratch)
            if keep_biases and KEEP_PAIR_BIASES:
                kept = keep(biases)
        rows_by_descriptor = tiled and _rows_by_descriptor(q, k, v)  # (implies by_descriptor)
        args = (q, k, v, out, offsets, timestamps, num_targets if num_targets is not None else offsets, position_bias, time_bias,
                *tables, biases, heads, max_seq_len, num_buckets, context_len, 1.0 / max_seq_len, next_power_of_2(max_seq_len))
        common = dict(
            HAS_TARGETS=num_targets is not None, TWO_BUCKET_TILES=two_buckets, BIAS_TILES=tiled,
            BY_DESCRIPTOR=by_descriptor, ROWS_BY_DESCRIPTOR=rows_by_descriptor, **dims,
        )
        unpaired_key = (q.device, q.dtype, dims["BLOCK_DQK"], dims["BLOCK_DV"])
        paired = False
        if _pairs_heads(heads, rows_by_descriptor) and unpaired_key not in _unpaired:
            try:
                _forward(_grid("BLOCK_M", programs // 2, max_seq_len), args, dict(common, PAIR=True))
                paired = True
            except OutOfResources:  # raised before the kernel runs: nothing written
                _unpaired.add(unpaired_key)
        if not paired:
            try:
                _forward(_grid("BLOCK_M", programs, max_seq_len), args, dict(common, PAIR=False))
            except OutOfResources as e:
                device = torch.cuda.get_device_name(q.device) if q.is_cuda else str(q.device)
                raise RuntimeError(
                    f"hstu_attention: head dims {q.shape[2]} (q, k) and {v.shape[2]} (v) need more shared memory than "
                    f"{device} has for any tile of the forward ({e})"
                ) from e
    return out, kept


def hstu_attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0, bias_grads: bool = True,
    kept_biases: torch.Tensor | None = None,
):
    """(dq, dk, dv, d position_bias, d time_bias); the biases' gradients are float32 (None
    without bias_grads). kept_biases: the forward's pair biases (attention_forward), read
    in place of the prepass's again."""
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
                dict(STORE_DS=False, BY_DESCRIPTOR=False, BIAS_TILES=False, ROWS_BY_DESCRIPTOR=False, **common),
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
            tiled = reads_pair_biases(max_seq_len)
            rows_by_descriptor = tiled and _rows_by_descriptor(q, grad)
            for first in range(0, sequences, chunk):
                part = _some_sequences(first, min(sequences, first + chunk), offsets, num_targets, tables)
                part_offsets, part_targets, part_tables = part
                biases = position_bias  # (unread)
                if tiled and kept_biases is not None:  # (a chunk's sequences' blocks: a view)
                    biases = kept_biases[first:first + part_offsets.numel() - 1]
                elif tiled:
                    biases = pair_biases(part_offsets, timestamps, position_bias, time_bias, max_seq_len, part_tables, q.dtype,
                                         part_targets, context_len)
                _backward_kv(
                    _grid("BLOCK_N", (part_offsets.numel() - 1) * heads, max_seq_len),
                    (q, k, v, grad, dk, dvv, ds, part_offsets, timestamps, part_targets if part_targets is not None else
                     part_offsets, position_bias, time_bias, *part_tables, biases, *sizes),
                    dict(common, STORE_DS=True, BY_DESCRIPTOR=by_descriptor, BIAS_TILES=tiled, ROWS_BY_DESCRIPTOR=rows_by_descriptor,
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


def reads_pair_biases(max_seq_len: int) -> bool:
    """Whether the forward and the dK dV kernel read their biases from the prepass's buffer
    (bias_tiles.py) at this length: with PAIR_BIAS_TILES on, from PAIR_BIAS_TILES_MIN_LENGTH
    on. The forward also needs the buffer to fit (_pair_bias_tiles); the backward's chunks
    always do."""
    return PAIR_BIAS_TILES and max_seq_len >= PAIR_BIAS_TILES_MIN_LENGTH


def _pair_bias_tiles(sequences: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the forward reads its biases from the prepass's buffer: where
    reads_pair_biases and the buffer, laid out as the stored dS of one head, holds all of
    the sequences within the stored dS's budget (_score_grads_chunk); else each tile
    computes them."""
    return reads_pair_biases(max_seq_len) and _score_grads_chunk(sequences, 1, max_seq_len, dtype, device) == sequences


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


def _rows_by_descriptor(*tensors: torch.Tensor) -> bool:
    """Whether a kernel that reads the prepass's biases reads these (total, heads, width)
    tensors' blocks through descriptors of a head's rows (ROWS_BY_DESCRIPTOR): on GPUs with
    the Tensor Memory Accelerator (and under the interpreter, so that CI runs that path),
    where every one is contiguous, of ROWS_BY_DESCRIPTOR_MIN_HEAD_DIM columns a head or
    more, and each head's rows start at multiples of DESCRIPTOR_ALIGN bytes."""
    return ROWS_BY_DESCRIPTOR and _descriptor_stores(tensors[0].device) and all(
        t.is_contiguous() and t.shape[2] >= ROWS_BY_DESCRIPTOR_MIN_HEAD_DIM and t.data_ptr() % DESCRIPTOR_ALIGN == 0
        and t.shape[2] * t.element_size() % DESCRIPTOR_ALIGN == 0
        for t in tensors
    )


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
        score_grads.band_grid(max_seq_len, offsets.numel() - 1, context_len > 0),
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
