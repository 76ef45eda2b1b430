"""HSTU (Hierarchical Sequential Transduction Units), the paper's research layer, on jagged
sequences.

A batch is jagged: item embeddings (total, D), the rows of every sequence one after the
other, their timestamps (total,) and offsets (B + 1,) (sequence b is rows offsets[b] to
offsets[b + 1]). Nothing is padded and no (B, L, L) tensor is made: the attention is
kernels.hstu_attention (Triton on CUDA, its PyTorch twin elsewhere), which looks the
relative position and time-gap biases up from their tables. Each block computes

    U, V, Q, K = split(SiLU(W · LayerNorm(x)))
    A = SiLU(Q Kᵀ + rab_pos + rab_time) / max_seq_len     causal, within each sequence
    y = x + W_o · Dropout(LayerNorm(A V) ⊙ U)

and the output is L2-normalized. Row t's output depends on rows 0..t of its sequence
only. The item embeddings come from outside (the dynamic table), so this module holds only
dense weights. Where the attention runs its Triton kernels, the last line's
Dropout(LayerNorm(A V) ⊙ U) is kernels.norm_mul_dropout, one kernel each way with its own
dropout mask made from a seed (HSTUConfig.norm_mul_dropout_kernel).

The work between two attentions is one function of tensors: one block's projection and
residual, then the next block's layer norm, projection, SiLU and split (next_block_input);
the model's ends are first_block_input (the scaled item rows, the position embedding,
dropout, then the first block's input) and last_block_output (the last residual, then the
L2 normalization). Without kernels.norm_mul_dropout, Dropout(LayerNorm(A V) ⊙ U) is
gated_norm, torch's ops. With HSTUConfig.compile_blocks each of them runs through
torch.compile (one compiled function for every block, the row count symbolic;
compiled.py): the norms, the casts autocast makes around them, SiLU, the split into
contiguous U, V, Q, K and the residual's sum become a few fused kernels instead of a pass
over memory each, and since a block's output x' and the next block's input are made in one
function, the two gradients of x' (the residual's and the layer norm's) are summed inside
its backward's kernels rather than by autograd after them.
"""
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import use_triton
from kernels.hstu_attention import hstu_attention
from kernels.layer_norm import layer_norm
from kernels.norm_mul_dropout import norm_mul_dropout

from .compiled import compiled, compiled_if
from .config import HSTUConfig


def valid_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """(B, L) bool: True at positions inside each sequence."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def positions_in_sequence(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) each row's place in its sequence (0 for the first row)."""
    lengths = offsets[1:] - offsets[:-1]
    starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=total)  # no host read
    return torch.arange(total, device=offsets.device) - starts


class RelativeBias(nn.Module):
    """Learned bias per relative position (j - i) and per log-scaled time gap bucket: the
    tables the attention kernel reads."""

    def __init__(self, max_seq_len: int, num_time_buckets: int):
        super().__init__()
        self.position = nn.Parameter(torch.empty(2 * max_seq_len - 1).normal_(0, 0.02))
        self.time = nn.Parameter(torch.empty(num_time_buckets + 1).normal_(0, 0.02))


def model_input(item_emb: torch.Tensor, at: torch.Tensor, positions: nn.Embedding, dropout: nn.Dropout) -> torch.Tensor:
    """The first block's input: Dropout(item_emb · √D + the position embedding of each row's
    place in its sequence, `at`)."""
    return dropout(item_emb * math.sqrt(item_emb.shape[1]) + positions(at))


def block_input(
    x: torch.Tensor, norm: nn.LayerNorm, uvqk_weight: torch.Tensor, heads: int, dqk: int, dv: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's projections of x (total, D): U (total, heads · dv), then V (total, heads,
    dv), Q and K (total, heads, dqk), each contiguous as the attention kernels and
    kernels.norm_mul_dropout read them (compiled, each is written by its own fused kernel, and
    SiLU's whole output is never stored)."""
    total = x.shape[0]
    u, v, q, k = F.silu(F.linear(norm(x), uvqk_weight)).split([heads * dv, heads * dv, heads * dqk, heads * dqk], dim=-1)
    return u.contiguous(), v.reshape(total, heads, dv).contiguous(), q.reshape(total, heads, dqk).contiguous(), k.reshape(total, heads, dqk).contiguous()


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x's rows scaled to unit L2 norm: the model's output."""
    return F.normalize(x, dim=-1)


def projected_residual(x: torch.Tensor, h: torch.Tensor, output: nn.Linear) -> torch.Tensor:
    """x + W_o · h: a block's output from Dropout(LayerNorm(A V) ⊙ U), h."""
    return x + output(h)


def gated_norm(attention: torch.Tensor, u: torch.Tensor, norm: nn.LayerNorm, dropout: nn.Dropout) -> torch.Tensor:
    """Dropout(LayerNorm(A V) ⊙ U) by torch's ops: attention (total, heads, dv) is the
    attention's output, u (total, heads · dv) block_input's U."""
    return dropout(norm(attention.reshape(u.shape)) * u)


def first_block_input(
    item_emb: torch.Tensor, at: torch.Tensor, positions: nn.Embedding, dropout: nn.Dropout,
    norm: nn.LayerNorm, uvqk_weight: torch.Tensor, heads: int, dqk: int, dv: int,
) -> tuple[torch.Tensor, ...]:
    """(x, U, V, Q, K): the first block's input x (model_input) and its projections
    (block_input)."""
    x = model_input(item_emb, at, positions, dropout)
    return (x, *block_input(x, norm, uvqk_weight, heads, dqk, dv))


def next_block_input(
    x: torch.Tensor, h: torch.Tensor, output: nn.Linear, norm: nn.LayerNorm, uvqk_weight: torch.Tensor,
    heads: int, dqk: int, dv: int,
) -> tuple[torch.Tensor, ...]:
    """(x', U, V, Q, K): a block's output x' = projected_residual(x, h) and the next block's
    projections of it (block_input)."""
    y = projected_residual(x, h, output)
    return (y, *block_input(y, norm, uvqk_weight, heads, dqk, dv))


def last_block_output(x: torch.Tensor, h: torch.Tensor, output: nn.Linear) -> torch.Tensor:
    """The model's output: the last block's projected_residual, rows at unit norm."""
    return unit_rows(projected_residual(x, h, output))


class KernelLayerNorm(nn.LayerNorm):
    """nn.LayerNorm (its weights and state keys) computed by kernels.layer_norm."""

    backend = "auto"  # kernels.layer_norm's backend ("triton" on a CPU: Triton's interpreter, for tests)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.backend)


class HSTUBlock(nn.Module):
    """One block's weights, and its work from the projections U, V, Q, K to h =
    Dropout(LayerNorm(A V) ⊙ U) (`attend`); the model joins the blocks through
    next_block_input."""

    def __init__(self, c: HSTUConfig):
        super().__init__()
        self.heads, self.dqk, self.dv = c.num_heads, c.attention_dim, c.linear_dim
        self.max_seq_len = c.max_seq_len
        self.compile = c.compile_blocks
        norm = KernelLayerNorm if c.layer_norm_kernel else nn.LayerNorm
        self.input_norm = norm(c.embedding_dim)
        # initialized as the paper's reference implementation: small U, V, Q, K projections
        # (std 0.02, no bias) and a Xavier output projection
        self.uvqk = nn.Linear(c.embedding_dim, c.num_heads * (2 * c.linear_dim + 2 * c.attention_dim), bias=False)
        nn.init.normal_(self.uvqk.weight, 0, 0.02)
        self.attn_norm = norm(c.num_heads * c.linear_dim)
        self.output = nn.Linear(c.num_heads * c.linear_dim, c.embedding_dim)
        nn.init.xavier_uniform_(self.output.weight)
        self.dropout = nn.Dropout(c.dropout)
        self.bias = RelativeBias(c.max_seq_len, c.num_time_buckets)
        self.norm_mul_dropout = c.norm_mul_dropout_kernel

    def projections(self) -> tuple:
        """block_input's arguments after x: this block's layer norm, projection weight and
        head sizes."""
        return self.input_norm, self.uvqk.weight, self.heads, self.dqk, self.dv

    def attend(
        self, u: torch.Tensor, v: torch.Tensor, q: torch.Tensor, k: torch.Tensor, timestamps: torch.Tensor,
        offsets: torch.Tensor, backend: str,
    ) -> torch.Tensor:
        """h = Dropout(LayerNorm(A V) ⊙ U) (total, heads · dv), A V the attention of Q, K, V."""
        out = hstu_attention(q, k, v, offsets, timestamps, self.bias.position, self.bias.time, self.max_seq_len, backend=backend)
        if self.norm_mul_dropout and use_triton(backend, u.device, "attention"):
            # (its own kernels, outside torch.compile)
            p = self.dropout.p if self.training else 0.0
            return norm_mul_dropout(out.reshape(u.shape), u, self.attn_norm.weight, self.attn_norm.bias, self.attn_norm.eps, p, backend)
        return compiled_if(self.compile, gated_norm)(out, u, self.attn_norm, self.dropout)


class HSTU(nn.Module):
    """Dense part of the model: input scaling + positions, HSTU blocks, L2-normalized output.
    `attention_backend` picks the attention's implementation ("auto": Triton on CUDA)."""

    def __init__(self, c: HSTUConfig, attention_backend: str = "auto"):
        super().__init__()
        if c.num_blocks < 1:
            raise ValueError(f"HSTU needs at least one block, got num_blocks={c.num_blocks}")
        self.config = c
        self.attention_backend = attention_backend
        self.positions = nn.Embedding(c.max_seq_len, c.embedding_dim)
        nn.init.xavier_normal_(self.positions.weight)
        self.input_dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(HSTUBlock(c) for _ in range(c.num_blocks))

    def forward(self, item_emb: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """item_emb (total, D), timestamps (total,), offsets (B + 1,) int64 of sequences no
        longer than max_seq_len → (total, D), unit norm."""
        if self.config.compile_model:  # (sizes that vary: the rows, their timestamps and the sequences' count)
            return compiled(model_forward, (0, 1, 2), data_dependent_sizes=True)(item_emb, timestamps, offsets, self)
        return model_forward(item_emb, timestamps, offsets, self)


def model_forward(item_emb: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor, model: HSTU) -> torch.Tensor:
    """HSTU.forward's work: the blocks between the model's input and output; with
    compile_blocks the work between two attention calls through torch.compile (unless
    compile_model compiles this whole: compiled_if)."""
    # (compiled, the jagged arguments are the first two: the rows, and h)
    call = functools.partial(compiled_if, model.config.compile_blocks)
    at = positions_in_sequence(offsets, item_emb.shape[0])
    blocks = list(model.blocks)
    x, u, v, q, k = call(first_block_input)(item_emb, at, model.positions, model.input_dropout, *blocks[0].projections())
    for block, following in zip(blocks[:-1], blocks[1:]):
        h = block.attend(u, v, q, k, timestamps, offsets, model.attention_backend)
        x, u, v, q, k = call(next_block_input)(x, h, block.output, *following.projections())
    h = blocks[-1].attend(u, v, q, k, timestamps, offsets, model.attention_backend)
    return call(last_block_output)(x, h, blocks[-1].output)
