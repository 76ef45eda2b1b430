"""HSTU's training losses: softmax cross-entropy on cosine similarity, over shared sampled
negatives or over the whole catalog.

The catalog softmax is the costly one: its (positions × items) logits are hundreds of
megabytes per step on a catalog of ten thousand items. `catalog_softmax_loss` never holds
them (kernels.softmax_cross_entropy: blocks of positions on a CPU, one on-chip pass of
Triton kernels on a GPU). `sampled_softmax_loss` holds them once, in the products' dtype
(kernels.sampled_softmax).
"""
import torch
import torch.nn.functional as F

from kernels.sampled_softmax import sampled_softmax_cross_entropy
from kernels.softmax_cross_entropy import softmax_cross_entropy


def sampled_softmax_loss(
    out: torch.Tensor,
    target_emb: torch.Tensor,
    target_ids: torch.Tensor,
    negative_emb: torch.Tensor,
    negative_ids: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Cross-entropy of each target against shared sampled negatives, on cosine similarity.

    out (P, D) normalized outputs, target_emb (P, D), negative_emb (N, D); a negative equal
    to the position's own target is masked out. Equal to F.cross_entropy of
    [out · t, out · negativesᵀ (masked)] / temperature against label 0, without its
    float32 copies of the (P, N) logits (kernels.sampled_softmax).
    """
    positive = (out * F.normalize(target_emb, dim=-1)).sum(-1)
    return sampled_softmax_cross_entropy(
        out / temperature, F.normalize(negative_emb, dim=-1), positive / temperature, negative_ids, target_ids,
    )


def catalog_softmax_loss(out: torch.Tensor, item_emb: torch.Tensor, target_index: torch.Tensor, temperature: float) -> torch.Tensor:
    """Cross-entropy of each position's target over every item of the catalog (the full
    softmax), on cosine similarity. out (P, D) normalized outputs, item_emb (M, D) the
    catalog's rows, target_index (P,) each target's row in it. Equal to
    F.cross_entropy((out / temperature) @ normalize(item_emb).T, target_index), without
    holding the logits (kernels.softmax_cross_entropy)."""
    return softmax_cross_entropy(out / temperature, F.normalize(item_emb, dim=-1), target_index)
