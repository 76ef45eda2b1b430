"""HSTU attention on jagged sequences in plain PyTorch: the twin of triton_kernels.py and
the test oracle.

For each sequence (rows offsets[b] to offsets[b + 1] of q, k, v) and head:

    A[i, j] = SiLU(q_i · k_j + position_bias[j - i] + time_bias[bucket(|t_i - t_j|)]) / max_seq_len
    out_i   = Σ_j A[i, j] · allowed(i, j) · v_j

position_bias has 2 · max_seq_len - 1 entries (j - i clamped to ±(max_seq_len - 1));
time_bias has num_buckets + 1, and bucket(gap) = floor(log(max(gap, 1)) / TIME_BUCKET_LOG)
clamped to [0, num_buckets]. A sequence of n rows whose last T = num_targets[b] are targets
(candidates) and whose first C = context_len are a context prefix allows:

    context row i < C:        every history row j < n - T (both ways)
    history row C <= i < n-T: j <= i (causal)
    target row i >= n - T:    every history row, and itself (targets do not see each other)

Scores are computed in float32 (float64 for float64 inputs); the output has v's dtype.
"""
import torch
import torch.nn.functional as F

TIME_BUCKET_LOG = 0.301  # time gaps are bucketed by log(gap) / this (about log 2: doublings)


def allowed_pairs(n: int, num_targets: int, context_len: int, device) -> torch.Tensor:
    """(n, n) bool: whether row i attends to row j."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    history_end = n - num_targets
    in_history = j < history_end
    return torch.where(
        i < context_len, in_history, torch.where(i < history_end, j <= i, in_history | (j == i))
    )


def time_buckets(timestamps: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """(n, n) int64 bucket of |t_i - t_j| for one sequence's timestamps (n,)."""
    gap = (timestamps[:, None] - timestamps[None, :]).abs().clamp(min=1).to(torch.float32)
    return torch.floor(torch.log(gap) / TIME_BUCKET_LOG).to(torch.int64).clamp(0, num_buckets)


def hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0,
) -> torch.Tensor:
    """(total, H, dv): q, k (total, H, dqk), v (total, H, dv) of jagged sequences."""
    outs = []
    compute = torch.promote_types(q.dtype, torch.float32)  # float32 at least
    bounds = offsets.tolist()
    targets = num_targets.tolist() if num_targets is not None else [0] * (len(bounds) - 1)
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        n = end - start
        if n == 0:
            continue
        qb, kb, vb = (x[start:end].transpose(0, 1).to(compute) for x in (q, k, v))  # (H, n, d)
        position = torch.arange(n, device=q.device)
        rel = (position[None, :] - position[:, None]).clamp(-(max_seq_len - 1), max_seq_len - 1) + max_seq_len - 1
        bias = position_bias.to(compute)[rel] + time_bias.to(compute)[time_buckets(timestamps[start:end], time_bias.numel() - 1)]
        scores = qb @ kb.transpose(1, 2) + bias  # (H, n, n)
        attention = F.silu(scores) / max_seq_len * allowed_pairs(n, targets[b], context_len, q.device)
        outs.append((attention @ vb).transpose(0, 1).to(v.dtype))
    if not outs:  # every sequence empty: v has no rows
        return v * 0
    return torch.cat(outs)
