"""HSTU (Hierarchical Sequential Transduction Units), the paper's research layer.

Sequences arrive padded on the right: embeddings (B, L, D), timestamps (B, L) and lengths
(B,). Each block computes

    U, V, Q, K = split(SiLU(W · LayerNorm(x)))
    A = SiLU(Q Kᵀ + rab_pos + rab_time) / max_seq_len     causal, padded keys masked
    y = x + W_o · Dropout(LayerNorm(A V) ⊙ U)

and the output is L2-normalized. The item embeddings come from outside (the dynamic
table), so this module holds only dense weights.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.hstu_attention import TIME_BUCKET_LOG

from .config import HSTUConfig


def valid_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """(B, L) bool: True at positions inside each sequence."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


class _GatherBias(torch.autograd.Function):
    """table[index] for a small table and a large index. The backward sums gradients with
    one index_add_, where the default (index_put_ with accumulate) sorts the whole index."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.size = table.numel()
        return table[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        table_grad = grad.new_zeros(ctx.size).index_add_(0, index.reshape(-1), grad.reshape(-1))
        return table_grad, None


def bias_indices(timestamps: torch.Tensor, max_seq_len: int, num_time_buckets: int):
    """Shared by every block: relative position index (L, L) into a (2·max_len − 1) table,
    and log-scaled time gap bucket (B, L, L) into a (num_time_buckets + 1) table."""
    L = timestamps.shape[1]
    pos = torch.arange(L, device=timestamps.device)
    rel = (pos[None, :] - pos[:, None]).clamp(-(max_seq_len - 1), max_seq_len - 1) + max_seq_len - 1
    # times relative to each sequence's first fit float32 (a gap's rounding is far below
    # its bucket's width); the (B, L, L) work is done in place
    base = timestamps[:, :1]
    times = (timestamps - base).float()
    gap = times[:, :, None] - times[:, None, :]
    bucket = gap.abs_().clamp_(min=1).log_().mul_(1 / TIME_BUCKET_LOG).to(torch.int64).clamp_(0, num_time_buckets)
    return rel, bucket


class RelativeBias(nn.Module):
    """Learned bias per relative position (j - i) and per log-scaled time gap bucket."""

    def __init__(self, max_seq_len: int, num_time_buckets: int):
        super().__init__()
        self.position = nn.Parameter(torch.empty(2 * max_seq_len - 1).normal_(0, 0.02))
        self.time = nn.Parameter(torch.empty(num_time_buckets + 1).normal_(0, 0.02))

    def forward(self, rel: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
        return self.position[rel][None] + _GatherBias.apply(self.time, bucket)  # (B, L, L)


class HSTUBlock(nn.Module):
    def __init__(self, c: HSTUConfig):
        super().__init__()
        self.heads, self.dqk, self.dv = c.num_heads, c.attention_dim, c.linear_dim
        self.max_seq_len = c.max_seq_len
        self.input_norm = nn.LayerNorm(c.embedding_dim)
        # initialized as the paper's reference implementation: small U, V, Q, K projections
        # (std 0.02, no bias) and a Xavier output projection
        self.uvqk = nn.Linear(c.embedding_dim, c.num_heads * (2 * c.linear_dim + 2 * c.attention_dim), bias=False)
        nn.init.normal_(self.uvqk.weight, 0, 0.02)
        self.attn_norm = nn.LayerNorm(c.num_heads * c.linear_dim)
        self.output = nn.Linear(c.num_heads * c.linear_dim, c.embedding_dim)
        nn.init.xavier_uniform_(self.output.weight)
        self.dropout = nn.Dropout(c.dropout)
        self.bias = RelativeBias(c.max_seq_len, c.num_time_buckets)

    def forward(self, x: torch.Tensor, bias_index: tuple, mask: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        H, dqk, dv = self.heads, self.dqk, self.dv
        u, v, q, k = F.silu(self.uvqk(self.input_norm(x))).split([H * dv, H * dv, H * dqk, H * dqk], dim=-1)
        q = q.view(B, L, H, dqk).transpose(1, 2)  # (B, H, L, dqk)
        k = k.view(B, L, H, dqk).transpose(1, 2)
        v = v.view(B, L, H, dv).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) + self.bias(*bias_index)[:, None]  # (B, H, L, L)
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None] & mask[:, None, :]  # (B, L, L): past, valid keys
        attn = F.silu(scores) / self.max_seq_len * allowed[:, None]
        out = (attn @ v).transpose(1, 2).reshape(B, L, H * dv)
        return x + self.output(self.dropout(self.attn_norm(out) * u))


class HSTU(nn.Module):
    """Dense part of the model: input scaling + positions, HSTU blocks, L2-normalized output."""

    def __init__(self, c: HSTUConfig):
        super().__init__()
        self.config = c
        self.positions = nn.Embedding(c.max_seq_len, c.embedding_dim)
        nn.init.xavier_normal_(self.positions.weight)
        self.input_dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(HSTUBlock(c) for _ in range(c.num_blocks))

    def forward(self, item_emb: torch.Tensor, timestamps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """item_emb (B, L, D), timestamps (B, L), lengths (B,) → (B, L, D), unit norm."""
        B, L, D = item_emb.shape
        mask = valid_mask(lengths, L)
        x = item_emb * math.sqrt(D) + self.positions.weight[:L][None]
        x = self.input_dropout(x) * mask[..., None]
        bias_index = bias_indices(timestamps, self.config.max_seq_len, self.config.num_time_buckets)
        for block in self.blocks:
            x = block(x, bias_index, mask) * mask[..., None]
        return F.normalize(x, dim=-1)

