"""Full-ranking evaluation, the HSTU paper's protocol.

For every user the model's output at the last history position scores every item of the
catalog (all items of the dataset); items already in the history are excluded, and the
held-out next item's rank gives HR@K, NDCG@K and MRR. The most-popular baseline (items
ranked by their count in the training split) is scored on the same users in the same run.
A tie in score counts in the target's favour, for the model and the baseline alike.
"""
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .data import Sequences, pad_batch
from .hstu import HSTU

KS = (10, 50, 200)


def ranking_metrics(ranks: torch.Tensor, ks=KS) -> dict[str, float]:
    """ranks: 0-based rank of each user's target among the candidates."""
    r = ranks.to(torch.float64)
    out = {}
    for k in ks:
        hit = r < k
        out[f"hr@{k}"] = hit.double().mean().item()
        out[f"ndcg@{k}"] = torch.where(hit, 1.0 / torch.log2(r + 2), torch.zeros_like(r)).mean().item()
    out["mrr"] = (1.0 / (r + 1)).mean().item()
    return out


def target_ranks(scores: torch.Tensor, target: torch.Tensor, exclude: torch.Tensor) -> torch.Tensor:
    """scores (U, M); target (U,) column index; exclude (U, M) bool → rank of the target
    among candidates not excluded (the target itself is never excluded)."""
    exclude = exclude.clone()
    exclude[torch.arange(len(target)), target] = False
    target_score = scores.gather(1, target[:, None])
    return ((scores > target_score) & ~exclude).sum(1)


@torch.no_grad()
def evaluate(
    model: HSTU,
    item_table,
    data_dir: str | Path,
    split: str = "test",
    batch_size: int = 256,
    device: torch.device | str = "cpu",
) -> dict[str, dict[str, float]]:
    """{"model": metrics, "most_popular": metrics} over every user of `split`
    (valid or test; the last item of each sequence is the target)."""
    data_dir = Path(data_dir)
    max_len = model.config.max_seq_len
    users = Sequences(data_dir / f"{split}.parquet", max_len + 1)  # model input + target
    full = Sequences(data_dir / f"{split}.parquet", np.iinfo(np.int64).max)  # whole history
    catalog = torch.from_numpy(users.all_items())  # sorted item ids
    train_items = torch.from_numpy(Sequences(data_dir / "train.parquet", 1).items)
    popularity = torch.zeros(len(catalog), dtype=torch.float64)
    popularity.index_add_(0, torch.searchsorted(catalog, train_items), torch.ones(len(train_items), dtype=torch.float64))

    item_emb = F.normalize(item_table.lookup(catalog.to(device), train=False), dim=-1)  # (M, D)
    model_ranks, popular_ranks = [], []
    for start in range(0, len(users), batch_size):
        batch = pad_batch([users[i] for i in range(start, min(start + batch_size, len(users)))])
        ids, ts, lengths = batch["item_ids"], batch["timestamps"], batch["lengths"]
        B, L = ids.shape
        target = torch.searchsorted(catalog, ids[torch.arange(B), lengths - 1])
        hist_len = lengths - 1
        hist_mask = torch.arange(L)[None, :] < hist_len[:, None]
        exclude = torch.zeros(B, len(catalog), dtype=torch.bool)  # the whole history, not just the window
        for b in range(B):
            exclude[b, torch.searchsorted(catalog, torch.from_numpy(full[start + b][0][:-1]))] = True

        seq_mask = hist_mask.to(device)
        emb = torch.zeros(B, L, model.config.embedding_dim, device=device)
        emb[seq_mask] = item_table.lookup(ids[hist_mask].to(device), train=False)
        # the last column holds only targets or padding: the model sees L - 1 positions
        out = model(emb[:, :-1], ts[:, :-1].to(device), hist_len.to(device))  # (B, L-1, D)
        user = out[torch.arange(B, device=device), (hist_len - 1).clamp(min=0).to(device)]
        scores = (user @ item_emb.T).cpu()
        model_ranks.append(target_ranks(scores, target, exclude))
        popular_ranks.append(target_ranks(popularity.expand(B, -1), target, exclude))
    return {
        "model": ranking_metrics(torch.cat(model_ranks)) | {"users": len(users)},
        "most_popular": ranking_metrics(torch.cat(popular_ranks)) | {"users": len(users)},
    }
