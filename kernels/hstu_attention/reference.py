"""HSTU attention on jagged sequences in plain PyTorch: the twin of triton_kernels.py and
the test oracle.

For each sequence (rows offsets[b] to offsets[b + 1] of q, k, v) and head:

    A[i, j] = SiLU(q_i · k_j + position_bias[j - i] + time_bias[bucket(|t_i - t_j|)]) / max_seq_len
    out_i   = Σ_j A[i, j] · allowed(i, j) · v_j

position_bias has 2 · max_seq_len - 1 entries (j - i clamped to ±(max_seq_len - 1));
time_bias has num_buckets + 1, and bucket(gap) = floor(log(max(gap, 1)) / TIME_BUCKET_LOG)
clamped to [0, num_buckets], made exact: the bucket is the number of edges ceil(exp(b ·
TIME_BUCKET_LOG)), b = 1 .. num_buckets, at or below the gap, both rounded to float32.
A sequence of n rows whose last T = num_targets[b] are targets (candidates) and whose
first C = context_len are a context prefix allows:

    context row i < C:        every history row j < n - T (both ways)
    history row C <= i < n-T: j <= i (causal)
    target row i >= n - T:    every history row, and itself (targets do not see each other)

Scores are computed in float32 (float64 for float64 inputs); the output has v's dtype.
Sequences are sorted by length and run as LENGTH_GROUPS padded batches, each padded only
to its own longest sequence: a loop per sequence is slower on a CPU than the padding.
"""
import math

import torch
import torch.nn.functional as F

TIME_BUCKET_LOG = 0.301  # time gaps are bucketed by log(gap) / this (about log 2: doublings)
LENGTH_GROUPS = 4  # padded batches of similar lengths the sequences are run in
EXTREMES_BLOCK = 32  # rows per block of timestamp_extremes (time_buckets.EXTREMES_BLOCK)


def _allowed(lengths: torch.Tensor, num_targets: torch.Tensor, context_len: int, width: int) -> torch.Tensor:
    """(G, width, width) bool for G sequences of these lengths padded to width: whether
    row i attends to row j (never to or from padding)."""
    i = torch.arange(width, device=lengths.device)[None, :, None]
    j = torch.arange(width, device=lengths.device)[None, None, :]
    n, history_end = lengths[:, None, None], (lengths - num_targets)[:, None, None]
    in_history = j < history_end
    pairs = torch.where(i < context_len, in_history, torch.where(i < history_end, j <= i, in_history | (j == i)))
    return pairs & (i < n) & (j < n)


def allowed_pairs(n: int, num_targets: int, context_len: int, device) -> torch.Tensor:
    """(n, n) bool: whether row i of a sequence of n rows attends to row j."""
    return _allowed(torch.tensor([n], device=device), torch.tensor([num_targets], device=device), context_len, n)[0]


def time_bucket_edges(num_buckets: int) -> list[int]:
    """The least gap of each bucket b = 0 .. num_buckets + 1: the least whole number whose
    log is at least b · TIME_BUCKET_LOG."""
    return [math.ceil(math.exp(b * TIME_BUCKET_LOG)) for b in range(num_buckets + 2)]


def time_buckets(timestamps: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """(..., n, n) int64 bucket of |t_i - t_j| for timestamps (..., n) of one sequence each."""
    gap = (timestamps[..., :, None] - timestamps[..., None, :]).abs_().to(torch.float32)
    edges = torch.tensor(time_bucket_edges(num_buckets)[1:num_buckets + 1], dtype=torch.float32, device=gap.device)
    return torch.bucketize(gap, edges, right=True)  # the edges at or below each gap


def timestamp_extremes(offsets: torch.Tensor, timestamps: torch.Tensor, max_seq_len: int, span: int) -> torch.Tensor:
    """(B, blocks, 2) float64: the least and greatest timestamp, less its sequence's first,
    of each block of EXTREMES_BLOCK rows of each sequence ((+inf, -inf) past its end);
    blocks cover max_seq_len rounded up to a multiple of span. The twin of
    time_buckets.timestamp_extremes, the attention kernels' prepass."""
    sequences, blocks = offsets.numel() - 1, -(-max_seq_len // span) * span // EXTREMES_BLOCK
    out = torch.empty(sequences, blocks, 2, dtype=torch.float64)
    out[..., 0], out[..., 1] = math.inf, -math.inf
    for b, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if end == start:
            continue
        rows = (timestamps[start:end] - timestamps[start]).double().cpu()
        for k, block in enumerate(rows.split(EXTREMES_BLOCK)):
            out[b, k] = torch.stack([block.min(), block.max()])
    return out.to(offsets.device)


def gather(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] (rows of table by an index of any shape)."""
    return table.index_select(0, index.reshape(-1)).view(*index.shape, *table.shape[1:])


def hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_bias: torch.Tensor, time_bias: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0,
) -> torch.Tensor:
    """(total, H, dv): q, k (total, H, dqk), v (total, H, dv) of jagged sequences."""
    compute = torch.promote_types(q.dtype, torch.float32)  # float32 at least
    lengths = offsets[1:] - offsets[:-1]
    targets = num_targets if num_targets is not None else torch.zeros_like(lengths)
    out = torch.zeros(v.shape, dtype=compute, device=v.device)
    for group in torch.argsort(lengths, stable=True).tensor_split(LENGTH_GROUPS):
        width = int(lengths[group].max()) if group.numel() else 0
        if width == 0:
            continue
        position = torch.arange(width, device=q.device)
        valid = position[None, :] < lengths[group, None]  # (G, width)
        rows = torch.where(valid, offsets[group, None] + position[None, :], 0)
        # gathers by index_select, whose backward adds by index (indexing's sorts its index)
        qg, kg, vg = (gather(x.to(compute), rows).transpose(1, 2) for x in (q, k, v))  # (G, H, width, d)
        rel = (position[None, :] - position[:, None]).clamp(-(max_seq_len - 1), max_seq_len - 1) + max_seq_len - 1
        buckets = time_buckets(timestamps[rows], time_bias.numel() - 1)
        bias = gather(position_bias.to(compute), rel) + gather(time_bias.to(compute), buckets)  # (G, width, width)
        scores = qg @ kg.transpose(-1, -2) + bias[:, None]
        allowed = _allowed(lengths[group], targets[group], context_len, width)
        attention = F.silu(scores) / max_seq_len * allowed[:, None]
        result = (attention @ vg).transpose(1, 2)  # (G, width, H, dv)
        out = out.index_copy(0, rows[valid], result[valid])
    if not out.requires_grad and v.requires_grad:  # no rows attended: zeros that depend on v
        return v * 0
    return out.to(v.dtype)


def _attended_score_grads(ds: torch.Tensor, b: int, n: int, num_targets: torch.Tensor | None, context_len: int):
    """(H, n, n) float: sequence b's dS where its rows attend, 0 elsewhere (where ds is
    never written, whatever it holds)."""
    targets = int(num_targets[b]) if num_targets is not None else 0
    return torch.where(allowed_pairs(n, targets, context_len, ds.device), ds[b, :, :n, :n].double(), 0.0)


def dq_from_score_grads(
    ds: torch.Tensor, k: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor, max_seq_len: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0,
) -> torch.Tensor:
    """(total, H, dqk): dQ_i = Σ_j dS[b, h, i, j] · k_j over the rows j that row i of
    sequence b attends to; ds (B, H, max_seq_len, max_seq_len) holds each sequence's score
    gradients, read nowhere else. The twin of triton_kernels.dq_from_score_grads."""
    dq = torch.zeros(k.shape, dtype=torch.float64, device=k.device)
    for b, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if end > start:
            d = _attended_score_grads(ds, b, end - start, num_targets, context_len)
            dq[start:end] = torch.einsum("hij,jhd->ihd", d, k[start:end].double())
    return dq.to(k.dtype)


def bias_grads_from_score_grads(
    ds: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor, max_seq_len: int, num_buckets: int,
    num_targets: torch.Tensor | None = None, context_len: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d position_bias, d time_bias), float32: every head's dS of each attended pair
    added at the pair's position index (j - i clamped as hstu_attention's) and its time
    bucket. ds as dq_from_score_grads reads it. The twin of
    triton_kernels.bias_grads_from_score_grads."""
    d_position = torch.zeros(2 * max_seq_len - 1, dtype=torch.float64, device=ds.device)
    d_time = torch.zeros(num_buckets + 1, dtype=torch.float64, device=ds.device)
    for b, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if end == start:
            continue
        d = _attended_score_grads(ds, b, end - start, num_targets, context_len).sum(0)
        position = torch.arange(end - start, device=ds.device)
        rel = (position[None, :] - position[:, None]).clamp(-(max_seq_len - 1), max_seq_len - 1) + max_seq_len - 1
        d_position.index_add_(0, rel.reshape(-1), d.reshape(-1))
        d_time.index_add_(0, time_buckets(timestamps[start:end], num_buckets).reshape(-1), d.reshape(-1))
    return d_position.float(), d_time.float()


def pair_biases(
    offsets: torch.Tensor, timestamps: torch.Tensor, position_bias: torch.Tensor, time_bias: torch.Tensor,
    max_seq_len: int, tables: tuple, dtype: torch.dtype, num_targets: torch.Tensor | None = None, context_len: int = 0,
) -> torch.Tensor:
    """(sequences, max_seq_len, max_seq_len rounded up to 8) of dtype: position_bias[j - i]
    + time_bias[bucket(|t_i - t_j|)] of every pair (i, j) of each sequence, in float32 then
    rounded to dtype, the rest 0. The twin of bias_tiles.pair_biases, which writes the
    pairs its readers attend to (and may leave others unwritten); tables, num_targets and
    context_len do not change the values."""
    row = -(-max_seq_len // 8) * 8
    out = torch.zeros(offsets.numel() - 1, max_seq_len, row, dtype=dtype, device=offsets.device)
    num_buckets = time_bias.numel() - 1
    for b, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        n = end - start
        if n == 0:
            continue
        position = torch.arange(n, device=offsets.device)
        rel = (position[None, :] - position[:, None]).clamp(-(max_seq_len - 1), max_seq_len - 1) + max_seq_len - 1
        bias = position_bias.float()[rel] + time_bias.float()[time_buckets(timestamps[start:end], num_buckets)]
        out[b, :n, :n] = bias.to(dtype)
    return out
