"""The run sums of run_sum_kernels.py against their PyTorch twin (run_sum_reference.py):
runs of one lane, runs spanning several tiles (a hot id), rows wider than the output's
used columns, an empty call. On CPU the kernel runs under TRITON_INTERPRET=1."""
import pytest
import torch

from kernels.dynamic_embedding.run_sum_kernels import RUN_TILE, sum_runs
from kernels.dynamic_embedding.run_sum_reference import sum_runs_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def runs(lengths: list[int], dim: int, stride: int, seed: int):
    """(rows, order, run, out) on DEVICE: lanes in runs of these lengths over rows (a view
    of `stride`-wide rows) in a random order; out random (the sums add to it)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    rows = torch.randn(n, stride, generator=g).to(DEVICE)[:, :dim]  # sliced there: a copy to a GPU drops the stride
    order = torch.randperm(n, generator=g).to(DEVICE)
    run = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64)).to(DEVICE)
    out = torch.randn(len(lengths), dim, generator=g).to(DEVICE)
    return rows, order, run, out


@pytest.mark.parametrize("lengths, dim, stride, scale", [
    ([1] * 40, 16, 16, 1.0),  # every lane its own run
    ([3, 1, 2 * RUN_TILE + 5, 1, 7, RUN_TILE, 1], 16, 20, 0.5),  # runs across tiles, a tile's whole run
    ([1, 2, 5, 1, 1, 3 * RUN_TILE + 1], 50, 64, 1 / 3),  # a width past a power of two, a hot run at the end
    ([RUN_TILE - 1, 2], 128, 128, 1.0),
    ([], 8, 8, 1.0),
])
def test_sum_runs_matches_the_twin(lengths, dim, stride, scale):
    rows, order, run, out = runs(lengths, dim, stride, seed=len(lengths))
    want = out.cpu().clone()  # (on a CPU .cpu() is the same tensor)
    sum_runs_reference(rows.cpu(), order.cpu(), run.cpu(), want, scale)
    sum_runs(rows, order, run, out, scale)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
