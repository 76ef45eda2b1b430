"""HSTU's training losses: softmax cross-entropy on cosine similarity, over shared sampled
negatives or over the whole catalog.

The catalog softmax is the costly one: its (positions × items) logits are hundreds of
megabytes per step on a catalog of ten thousand items. `catalog_softmax_loss` never holds
them (kernels.softmax_cross_entropy: blocks of positions on a CPU, one on-chip pass of
Triton kernels on a GPU). `sampled_softmax_loss` holds them once, in the products' dtype
(kernels.sampled_softmax).
"""
import math

import torch
import torch.nn.functional as F

from kernels.sampled_softmax import sampled_softmax_cross_entropy
from kernels.softmax_cross_entropy import softmax_cross_entropy

from .compiled import compiled_if


def sampled_softmax_loss(
    out: torch.Tensor,
    target_emb: torch.Tensor,
    target_ids: torch.Tensor,
    negative_emb: torch.Tensor,
    negative_ids: torch.Tensor,
    temperature: float,
    real_rows: int | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """Cross-entropy of each target against shared sampled negatives, on cosine similarity.

    out (P, D) normalized outputs, target_emb (P, D), negative_emb (N, D); a negative equal
    to the position's own target is masked out. Equal to F.cross_entropy of
    [out · t, out · negativesᵀ (masked)] / temperature against label 0, without its
    float32 copies of the (P, N) logits (kernels.sampled_softmax). real_rows: the loss of
    the first real_rows rows alone, the rest padding that passes no gradient. compile: the
    per-position work before the logits (scaled_queries) through torch.compile, the same
    values in a fused kernel or two where eager torch makes a pass per operation.
    """
    queries, positive = compiled_if(compile, scaled_queries)(out, target_emb, temperature)
    return sampled_softmax_cross_entropy(
        queries, F.normalize(negative_emb, dim=-1), positive, negative_ids, target_ids, real_rows=real_rows,
    )


def scaled_queries(out: torch.Tensor, target_emb: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out / temperature, each position's logit of its own target: out · normalize(t) /
    temperature), out (P, D) normalized outputs, target_emb (P, D)."""
    return out / temperature, (out * F.normalize(target_emb, dim=-1)).sum(-1) / temperature


def catalog_softmax_loss(out: torch.Tensor, item_emb: torch.Tensor, target_index: torch.Tensor, temperature: float) -> torch.Tensor:
    """Cross-entropy of each position's target over every item of the catalog (the full
    softmax), on cosine similarity. out (P, D) normalized outputs, item_emb (M, D) the
    catalog's rows, target_index (P,) each target's row in it. Equal to
    F.cross_entropy((out / temperature) @ normalize(item_emb).T, target_index), without
    holding the logits (kernels.softmax_cross_entropy)."""
    return softmax_cross_entropy(out / temperature, F.normalize(item_emb, dim=-1), target_index)


def padded_catalog_softmax_loss(
    out: torch.Tensor, item_emb: torch.Tensor, target_index: torch.Tensor, temperature: float, real_rows: torch.Tensor,
) -> torch.Tensor:
    """catalog_softmax_loss of out's first real_rows rows, where out (R, D) and target_index
    (R,) are a batch padded to R rows (the fixed shapes of a CUDA graph) and real_rows is a
    () integer tensor on the device (the host reads nothing back). The padding rows' queries
    are zeroed: every logit of such a row is 0, so its loss is log M (M items) and it passes
    no gradient (to out, through the zeros, nor to the items, whose gradient is weighted
    by the query), and the mean over R rows is turned into the mean over the real ones."""
    rows, items = out.shape[0], item_emb.shape[0]
    live = torch.arange(rows, device=out.device) < real_rows
    q = torch.where(live[:, None], out, 0.0) / temperature
    mean = softmax_cross_entropy(q, F.normalize(item_emb, dim=-1), target_index)
    real = real_rows.to(mean.dtype)
    return (mean * rows - (rows - real) * math.log(items)) / real
