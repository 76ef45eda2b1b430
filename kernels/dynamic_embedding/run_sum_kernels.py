"""A Triton kernel for the sharded collection's gradient sums: the rows of lanes in an
order where copies of one id are adjacent (a run), summed per run. Each program takes a
tile of lanes, sums each run's lanes within the tile by a segmented scan, and adds the
sum once into the run's output row: one add per run and tile, in place of one atomic add
per lane (`index_add_`). The PyTorch twin of the same signature is in run_sum_reference.py
(tests/test_run_sum_kernels.py holds them together).
"""
import torch
import triton
import triton.language as tl

from ..launch import launch, next_power_of_2

RUN_TILE = 32  # lanes a program sums
RUN_WARPS = 1  # (tilings timed: benchmarks/scaling.md)


@triton.jit
def _add_unless_new_run(a, a_start, b, b_start):
    """The segmented sum's step: b begins a run (b_start) or adds to a's."""
    return tl.where(b_start != 0, b, a + b), a_start | b_start


@triton.jit(do_not_specialize=["n"])
def _sum_runs_kernel(
    rows_ptr, row_stride, order_ptr, run_ptr, n, out_ptr, out_stride, dim, scale, TILE: tl.constexpr, DIM: tl.constexpr,
):
    """Lanes tile * TILE ..: lane p's row is rows[order[p]]; run[p], nondecreasing in p,
    is its output row. The last lane of each run in the tile adds the run's sum within
    the tile, times scale, to that row (an atomic add: a run may span tiles)."""
    p = tl.program_id(0) * TILE + tl.arange(0, TILE)
    live = p < n
    run = tl.load(run_ptr + p, mask=live, other=-1)
    starts = tl.load(run_ptr + p - 1, mask=live & (p > 0), other=-1) != run  # (a tile's first lane begins its scan anyway)
    ends = live & ((tl.load(run_ptr + p + 1, mask=p + 1 < n, other=-1) != run) | (tl.arange(0, TILE) == TILE - 1))
    lane = tl.load(order_ptr + p, mask=live, other=0)
    cols = tl.arange(0, DIM)
    inside = live[:, None] & (cols[None, :] < dim)
    g = tl.load(rows_ptr + lane[:, None].to(tl.int64) * row_stride + cols[None, :], mask=inside, other=0.0)
    flags = (starts[:, None] & (cols[None, :] >= 0)).to(tl.int32)
    sums, _ = tl.associative_scan((g, flags), 0, _add_unless_new_run)
    out = out_ptr + tl.maximum(run, 0)[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.atomic_add(out, sums * scale, mask=ends[:, None] & (cols[None, :] < dim), sem="relaxed")


def sum_runs(rows: torch.Tensor, order: torch.Tensor, run: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    """out[run[p]] += scale · rows[order[p]] for every lane p (each run's sum scaled once),
    where run (N,) is nondecreasing (each run's lanes adjacent) and order (N,) names each
    lane's row of rows (M, dim); rows and out float32 with unit column stride."""
    n = run.numel()
    if n == 0:
        return
    dim = rows.shape[1]
    launch(
        _sum_runs_kernel, (triton.cdiv(n, RUN_TILE),), rows, rows.stride(0), order, run, n, out, out.stride(0), dim, float(scale),
        TILE=RUN_TILE, DIM=next_power_of_2(dim), num_warps=RUN_WARPS,
    )
