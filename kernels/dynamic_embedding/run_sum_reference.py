"""PyTorch twin of run_sum_kernels.py, with the same signature."""
import torch


def sum_runs_reference(parts: list[torch.Tensor], order: torch.Tensor, run: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    """out[run[p]] += scale · (the sum of run p's rows) for every run, lane p's row being
    row order[p] of the parts laid end to end, in out's first columns (sums one lane at a
    time, in lane order)."""
    rows = []  # (part, row) of each lane of the parts laid end to end
    for i, x in enumerate(parts):
        rows += [(i, r) for r in range(x.shape[0])]
    sums = {}
    for p in range(run.numel()):
        i, r = rows[int(order[p])]
        x = torch.zeros(out.shape[1], dtype=out.dtype, device=out.device)
        x[: parts[i].shape[1]] = parts[i][r]
        key = int(run[p])
        sums[key] = sums[key] + x if key in sums else x
    for key, total in sums.items():
        out[key] += scale * total
