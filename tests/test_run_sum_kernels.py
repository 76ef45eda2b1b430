"""The run sums of run_sum_kernels.py against their PyTorch twin (run_sum_reference.py):
runs of one lane, runs spanning several tiles (a hot id), rows wider than the output's
used columns, an empty call. On CPU the kernel runs under TRITON_INTERPRET=1."""
import pytest
import torch

from kernels.dynamic_embedding.run_sum_kernels import RUN_TILE, sum_runs
from kernels.dynamic_embedding.run_sum_reference import sum_runs_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def runs(lengths: list[int], dim: int, stride: int, widths: list[int], seed: int):
    """(parts, order, run, out) on DEVICE: lanes in runs of these lengths over the rows of
    len(widths) parts laid end to end (about equal numbers of rows; part t's rows a view of
    the first widths[t] of `stride` columns, the last part's possibly empty) in a random
    order; out (runs, dim) random (the sums add to it)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    rows = torch.randn(n, stride, generator=g).to(DEVICE)  # sliced there: a copy to a GPU drops the stride
    bounds = [n * t // len(widths) for t in range(len(widths))] + [n]
    parts = [rows[a:b, :w] for a, b, w in zip(bounds, bounds[1:], widths)]
    order = torch.randperm(n, generator=g).to(DEVICE)
    run = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64)).to(DEVICE)
    out = torch.randn(len(lengths), dim, generator=g).to(DEVICE)
    return parts, order, run, out


@pytest.mark.parametrize("lengths, dim, stride, widths, scale", [
    ([1] * 40, 16, 16, [16], 1.0),  # every lane its own run
    ([3, 1, 2 * RUN_TILE + 5, 1, 7, RUN_TILE, 1], 16, 20, [16, 16, 16], 0.5),  # runs across tiles, a tile's whole run
    ([1, 2, 5, 1, 1, 3 * RUN_TILE + 1], 50, 64, [50, 7, 50, 33], 1 / 3),  # widths past powers of two, narrower parts
    ([RUN_TILE - 1, 2], 128, 128, [128, 64], 1.0),
    ([2, 1], 8, 8, [8, 8, 8, 8], 1.0),  # empty parts (3 rows over 4 parts)
    ([], 8, 8, [8], 1.0),
])
def test_sum_runs_matches_the_twin(lengths, dim, stride, widths, scale):
    parts, order, run, out = runs(lengths, dim, stride, widths, seed=len(lengths))
    want = out.cpu().clone()  # (on a CPU .cpu() is the same tensor)
    sum_runs_reference([x.cpu() for x in parts], order.cpu(), run.cpu(), want, scale)
    sum_runs(parts, order, run, out, scale)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
