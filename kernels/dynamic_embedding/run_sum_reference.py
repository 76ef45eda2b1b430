"""PyTorch twin of run_sum_kernels.py, with the same signature."""
import torch


def sum_runs_reference(rows: torch.Tensor, order: torch.Tensor, run: torch.Tensor, out: torch.Tensor) -> None:
    """out[run[p]] += rows[order[p]] for every lane p (adds one lane at a time, in lane order)."""
    for p in range(run.numel()):
        out[run[p]] += rows[order[p]]
