"""SASRec (Kang and McAuley, "Self-Attentive Sequential Recommendation", ICDM 2018), the
baseline the HSTU paper compares against, with its published MovieLens settings.

Items are numbered by their place in a sorted catalog (1..M; 0 pads). Each block is

    x = LayerNorm(x) + causal self-attention(LayerNorm(x), x)
    x = x' + FFN(LayerNorm(x')) where FFN = Dropout(W2 · ReLU(Dropout(W1 ·)))

over scaled item embeddings plus learned positions; the last LayerNorm's output at a
position scores every item by a dot product with the (shared) item embedding. Training is
binary cross-entropy of each next item against one negative drawn uniformly from the
items the user has not interacted with.
"""
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .hstu import valid_mask


@dataclass(frozen=True)
class SASRecConfig:
    num_items: int  # catalog size M (index 0 is padding)
    hidden_dim: int = 50
    num_blocks: int = 2
    num_heads: int = 1
    max_seq_len: int = 200
    dropout: float = 0.2
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.98)
    batch_size: int = 128
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "SASRecConfig":
        return SASRecConfig(**(dict(d) | {"betas": tuple(d["betas"])}))


def catalog_indices(catalog: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Raw ids → SASRec's item indices: the place in the sorted catalog plus one (1..M), 0
    for ids not in it (and padding)."""
    pos = torch.searchsorted(catalog, ids).clamp(max=len(catalog) - 1)
    return torch.where(catalog[pos] == ids, pos + 1, 0)


class SASRecBlock(nn.Module):
    def __init__(self, c: SASRecConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(c.hidden_dim, eps=1e-8)
        self.attn = nn.MultiheadAttention(c.hidden_dim, c.num_heads, dropout=c.dropout, batch_first=True)
        self.ffn_norm = nn.LayerNorm(c.hidden_dim, eps=1e-8)
        self.ffn = nn.Sequential(
            nn.Linear(c.hidden_dim, c.hidden_dim), nn.Dropout(c.dropout), nn.ReLU(),
            nn.Linear(c.hidden_dim, c.hidden_dim), nn.Dropout(c.dropout),
        )

    def forward(self, x: torch.Tensor, causal: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.attn_norm(x)
        x = q + self.attn(q, x, x, attn_mask=causal, need_weights=False)[0]
        y = self.ffn_norm(x)
        return (y + self.ffn(y)) * mask[..., None]


class SASRec(nn.Module):
    def __init__(self, c: SASRecConfig):
        super().__init__()
        self.config = c
        self.items = nn.Embedding(c.num_items + 1, c.hidden_dim, padding_idx=0)
        self.positions = nn.Embedding(c.max_seq_len, c.hidden_dim)
        self.dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(SASRecBlock(c) for _ in range(c.num_blocks))
        self.out_norm = nn.LayerNorm(c.hidden_dim, eps=1e-8)
        for name, p in self.named_parameters():  # Xavier, as the published code
            if p.dim() > 1:
                nn.init.xavier_normal_(p)
        with torch.no_grad():
            self.items.weight[0].zero_()

    def forward(self, items: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """items (B, L) catalog indices (0 past each length) → hidden states (B, L, d)."""
        B, L = items.shape
        mask = valid_mask(lengths, L)
        x = self.items(items) * self.config.hidden_dim**0.5 + self.positions.weight[:L][None]
        x = self.dropout(x) * mask[..., None]
        causal = torch.ones(L, L, dtype=torch.bool, device=items.device).triu(1)  # True: not allowed
        for block in self.blocks:
            x = block(x, causal, mask)
        return self.out_norm(x)

    def user_vectors(self, items: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The state after each history's last item, (B, d)."""
        h = self.forward(items, lengths)
        return h[torch.arange(len(lengths), device=items.device), (lengths - 1).clamp(min=0)]

    def item_vectors(self) -> torch.Tensor:
        """(M, d): item i of the catalog is row i (padding dropped)."""
        return self.items.weight[1:]


def negatives_outside_history(items: torch.Tensor, num_items: int, history: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """For each position of items (B, L), a catalog index in 1..num_items drawn uniformly
    among those not in the row's history (B, num_items + 1) bool; redrawn until outside."""
    draw = lambda n: torch.randint(1, num_items + 1, (n,), generator=generator).to(items.device)  # noqa: E731
    neg = draw(items.numel()).view_as(items)
    rows = torch.arange(items.shape[0], device=items.device)[:, None].expand_as(items)
    for _ in range(100):  # a user who saw nearly every item could loop long; a few tries suffice
        bad = history[rows, neg]
        if not bad.any():
            break
        neg[bad] = draw(int(bad.sum()))
    return neg


def bce_loss(hidden: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor, item_emb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid positions of −log σ(h·e_pos) − log(1 − σ(h·e_neg))."""
    h = hidden[mask]
    pos = (h * item_emb[positives[mask]]).sum(-1)
    neg = (h * item_emb[negatives[mask]]).sum(-1)
    return F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos)) + F.binary_cross_entropy_with_logits(neg, torch.zeros_like(neg))
