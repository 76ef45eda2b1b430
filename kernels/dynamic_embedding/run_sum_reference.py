"""PyTorch twin of run_sum_kernels.py, with the same signature."""
import torch


def sum_runs_reference(rows: torch.Tensor, order: torch.Tensor, run: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    """out[run[p]] += scale · (the sum of run p's rows rows[order[p]]) for every run (sums one
    lane at a time, in lane order)."""
    sums = {}
    for p in range(run.numel()):
        r = int(run[p])
        sums[r] = sums[r] + rows[order[p]] if r in sums else rows[order[p]].clone()
    for r, total in sums.items():
        out[r] += scale * total
