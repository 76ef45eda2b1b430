"""A Triton kernel for the sharded collection's gradient sums: the rows of lanes in an
order where copies of one id are adjacent (a run), summed per run. Each program takes a
tile of lanes, sums each run's lanes within the tile by a segmented scan, and adds the
sum once into the run's output row: one add per run and tile, in place of one atomic add
per lane (`index_add_`). The lanes' rows are read where they lie, in each table's own
gradient tensor (through a table of their addresses), not from a stacked copy. The
PyTorch twin of the same signature is in run_sum_reference.py
(tests/test_run_sum_kernels.py holds them together).
"""
from itertools import accumulate

import torch
import triton
import triton.language as tl

from ..launch import launch, next_power_of_2
from .table_group import to_device_nowait

RUN_TILE = 32  # lanes a program sums
RUN_WARPS = 1  # (tilings timed: benchmarks/scaling.md)
# the parts' table: int64 words, each a run of T values (one per part): addresses, row
# strides, widths, first lanes (kernels may only read module globals that are constexpr)
_PTRS, _STRIDES, _DIMS, _STARTS = (tl.constexpr(i) for i in range(4))


@triton.jit
def _add_unless_new_run(a, a_start, b, b_start):
    """The segmented sum's step: b begins a run (b_start) or adds to a's."""
    return tl.where(b_start != 0, b, a + b), a_start | b_start


@triton.jit(do_not_specialize=["n"])
def _sum_runs_kernel(
    parts_ptr, parts, order_ptr, run_ptr, n, out_ptr, out_stride, scale, TILE: tl.constexpr, DIM: tl.constexpr,
):
    """Lanes tile * TILE ..: lane p's row is row order[p] of the parts laid end to end
    (parts_ptr: the parts' table, _PTRS.. _STARTS); run[p], nondecreasing in p, is its
    output row. The last lane of each run in the tile adds the run's sum within the tile,
    times scale, to that row (an atomic add: a run may span tiles)."""
    p = tl.program_id(0) * TILE + tl.arange(0, TILE)
    live = p < n
    run = tl.load(run_ptr + p, mask=live, other=-1)
    starts = tl.load(run_ptr + p - 1, mask=live & (p > 0), other=-1) != run  # (a tile's first lane begins its scan anyway)
    ends = live & ((tl.load(run_ptr + p + 1, mask=p + 1 < n, other=-1) != run) | (tl.arange(0, TILE) == TILE - 1))
    lane = tl.load(order_ptr + p, mask=live, other=0)
    part = tl.zeros([TILE], tl.int32)
    for t in range(1, parts):
        part += (lane >= tl.load(parts_ptr + _STARTS * parts + t)).to(tl.int32)
    base = tl.load(parts_ptr + _PTRS * parts + part).to(tl.pointer_type(tl.float32))
    row = lane - tl.load(parts_ptr + _STARTS * parts + part)
    width = tl.load(parts_ptr + _DIMS * parts + part)
    cols = tl.arange(0, DIM)
    inside = live[:, None] & (cols[None, :] < width[:, None])
    g = tl.load(base[:, None] + row[:, None] * tl.load(parts_ptr + _STRIDES * parts + part)[:, None] + cols[None, :],
                mask=inside, other=0.0)
    flags = (starts[:, None] & (cols[None, :] >= 0)).to(tl.int32)
    sums, _ = tl.associative_scan((g, flags), 0, _add_unless_new_run)
    out = out_ptr + tl.maximum(run, 0)[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.atomic_add(out, sums * scale, mask=ends[:, None] & (cols[None, :] < out_stride), sem="relaxed")


def sum_runs(parts: list[torch.Tensor], order: torch.Tensor, run: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    """out[run[p]] += scale · (row order[p] of the parts laid end to end) for every lane p
    (each run's sum scaled once), where run (N,) is nondecreasing (each run's lanes
    adjacent) and order (N,) names each lane's row; parts: float32 (M_t, dim_t) tensors
    with unit column stride, dim_t at most out's width (narrower rows add to their first
    dim_t columns); out (distinct, width) float32, contiguous."""
    n = run.numel()
    if n == 0:
        return
    starts = list(accumulate((x.shape[0] for x in parts[:-1]), initial=0))
    words = [x.data_ptr() for x in parts] + [x.stride(0) for x in parts] + [x.shape[1] for x in parts] + starts
    table = to_device_nowait(words, torch.int64, out.device)
    launch(
        _sum_runs_kernel, (triton.cdiv(n, RUN_TILE),), table, len(parts), order, run, n, out, out.shape[1], float(scale),
        TILE=RUN_TILE, DIM=next_power_of_2(out.shape[1]), num_warps=RUN_WARPS,
    )
