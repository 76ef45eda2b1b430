"""Full-ranking evaluation, the HSTU paper's protocol, for every ranker alike.

For each user of a split, the last item of the sequence is the target and the items before
it the history. A ranker scores every item of the catalog (all items of the dataset) after
the history; items already in the history are excluded, as `recommend` excludes them when
serving, and the target's rank gives HR@K, NDCG@K and MRR. A target that is itself in the
history (a repeat) is excluded with it and counts as a miss: ranked among the history's
other items alone it would be told apart by being the one left in. Items scored equal to
the target are ordered at random: each metric is its expectation over that order (so a
ranker that scores every item alike gets a random ranker's metrics, not a perfect one). A
NaN score ranks ahead of the target where another item has it, and a NaN target is a miss
(a diverged model scores nothing). The rankers of one run (the model, SASRec,
most-popular) are scored on the same users in the same pass.

Validation during training uses the same code on the `valid` split, over a fixed sample
of users where the split is large, each rank of a process group taking its share.
"""
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.jagged import offsets_from_lengths

from .data import Sequences, pad_batch
from .hstu import valid_mask
from .sasrec import catalog_indices

KS = (10, 50, 200)


MISS = float("inf")  # the rank of a target that cannot be hit (in the history, or scored NaN)


def ranking_metrics(ranks: torch.Tensor, ties: torch.Tensor | None = None, ks=KS) -> dict[str, float]:
    """ranks: each user's count of candidates ranked ahead of the target (0: first; MISS:
    no place); ties: of candidates scored equal to it (none where not given)."""
    sums, n = metric_sums(ranks, ties, ks), ranks.numel()
    return {k: v / max(n, 1) for k, v in sums.items()}


def metric_sums(ranks: torch.Tensor, ties: torch.Tensor | None = None, ks=KS) -> dict[str, float]:
    """Per-user metrics summed (so that shares of users add up): hr@k, ndcg@k, mrr, each
    the mean over the target's places ranks .. ranks + ties (the ties in random order);
    0 for a MISS."""
    first = ranks.to(torch.float64)
    places = 1 + (torch.zeros_like(first) if ties is None else ties.to(torch.float64))
    end = first + places  # one past the last place
    gain = 1.0 / torch.log2(torch.arange(max(ks) + 1, dtype=torch.float64) + 2)  # place r: 1 / log2(r + 2)
    gains = torch.cat([torch.zeros(1, dtype=torch.float64), gain.cumsum(0)])  # gains[n]: places 0 .. n - 1
    out = {}
    for k in ks:
        lo, hi = first.clamp(max=k), end.clamp(max=k)  # the places that fall in the top k
        out[f"hr@{k}"] = ((hi - lo) / places).sum().item()
        out[f"ndcg@{k}"] = ((gains[hi.long()] - gains[lo.long()]) / places).sum().item()
    # sum of 1 / (r + 1) over the places: harmonic numbers, H(n) = digamma(n + 1) + Euler's constant
    hit = first.isfinite()
    rr = (torch.special.digamma(end[hit] + 1) - torch.special.digamma(first[hit] + 1)) / places[hit]
    out["mrr"] = rr.sum().item()
    return out


def target_ranks(scores: torch.Tensor, target: torch.Tensor, exclude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (U, M); target (U,) column index; exclude (U, M) bool → per user (float64),
    the candidates (not excluded) scored above the target or NaN, and those scored equal
    to it, the target itself not counted. A target excluded or scored NaN has rank MISS."""
    rows = torch.arange(len(target))
    target_score = scores.gather(1, target[:, None])
    others = ~exclude
    others[rows, target] = False
    ahead = (((scores > target_score) | scores.isnan()) & others).sum(1)
    tied = ((scores == target_score) & others).sum(1)
    missed = exclude[rows, target] | target_score[:, 0].isnan()
    return torch.where(missed, MISS, ahead.double()), torch.where(missed, 0, tied).double()


class Ranker(Protocol):
    """Scores the catalog after histories."""

    max_seq_len: int  # the longest history window it reads

    def scores(self, items: torch.Tensor, timestamps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """items, timestamps (B, L) raw ids and times, right-padded; lengths (B,) ≥ 1 →
        (B, M) scores of the catalog's items (on the CPU)."""
        ...


class HSTURanker:
    """The HSTU model over its item embeddings (item_embedding.ItemEmbedding): cosine of the
    last position's output and each item's embedding. The catalog's embeddings are read
    once (a collective lookup in a process group: every rank builds its ranker), and
    histories index into them."""

    def __init__(self, model, items, catalog: torch.Tensor, device: torch.device | str = "cpu"):
        self.model, self.catalog, self.device = model, catalog, torch.device(device)
        self.max_seq_len = model.config.max_seq_len
        self.rows = items.embed(catalog.to(self.device))  # (M, D)
        self.item_emb = F.normalize(self.rows, dim=-1)

    @torch.no_grad()
    def scores(self, items, timestamps, lengths):
        mask = valid_mask(lengths, items.shape[1])  # the model reads the histories jagged
        idx = torch.searchsorted(self.catalog, items[mask]).clamp(max=len(self.catalog) - 1).to(self.device)
        offsets = offsets_from_lengths(lengths).to(self.device)
        out = self.model(self.rows[idx], timestamps[mask].to(self.device), offsets)
        user = out[offsets[1:] - 1]  # each history's last row
        return (user @ self.item_emb.T).cpu()


class SASRecRanker:
    """SASRec: dot product of the last position's state and each item's embedding. Its
    items are numbered by their place in its own catalog (1..M), the one it trained on."""

    def __init__(self, model, model_catalog: torch.Tensor, catalog: torch.Tensor, device: torch.device | str = "cpu"):
        self.model, self.model_catalog, self.device = model, model_catalog, torch.device(device)
        self.max_seq_len = model.config.max_seq_len
        # the catalog's items as the model's indices; items it never saw score -inf
        index = catalog_indices(model_catalog, catalog)
        self.known = index > 0
        self.columns = (index - 1).clamp(min=0).to(self.device)

    @torch.no_grad()
    def scores(self, items, timestamps, lengths):
        user = self.model.user_vectors(catalog_indices(self.model_catalog, items).to(self.device), lengths.to(self.device))
        scores = (user @ self.model.item_vectors()[self.columns].T).cpu()
        return scores.masked_fill(~self.known, float("-inf"))


class PopularityRanker:
    """Items ranked by their count in the training split, the same for every user."""

    max_seq_len = 1

    def __init__(self, data_dir: str | Path, catalog: torch.Tensor):
        items = torch.from_numpy(Sequences(Path(data_dir) / "train.parquet", 1).items)
        self.popularity = torch.zeros(len(catalog), dtype=torch.float64)
        self.popularity.index_add_(0, torch.searchsorted(catalog, items), torch.ones(len(items), dtype=torch.float64))

    def scores(self, items, timestamps, lengths):
        return self.popularity.expand(len(lengths), -1)


def catalog_of(data_dir: str | Path) -> torch.Tensor:
    """Every item id of the dataset, sorted: the candidates of full ranking."""
    return torch.from_numpy(Sequences(Path(data_dir) / "test.parquet", 1).all_items())


def whole_histories(data_dir: str | Path, split: str) -> Sequences:
    """A split's sequences with every item (no window): what evaluation reads."""
    return Sequences(Path(data_dir) / f"{split}.parquet", np.iinfo(np.int64).max)


def user_sample(n_users: int, max_users: int | None, seed: int = 0) -> np.ndarray:
    """All users, or a fixed random sample of max_users of them (sorted)."""
    if max_users is None or n_users <= max_users:
        return np.arange(n_users)
    return np.sort(np.random.default_rng(seed).choice(n_users, max_users, replace=False))


@torch.no_grad()
def evaluate_rankers(
    rankers: dict[str, Ranker],
    full: Sequences,
    catalog: torch.Tensor,
    max_users: int | None = None,
    batch_size: int = 256,
    group=None,
) -> dict[str, dict[str, float]]:
    """{ranker name: metrics | {"users": n}} over the users of a split's whole histories
    `full` (whole_histories; or a sample of max_users of them), ranking `catalog`. In an
    initialized process group each rank scores its share and the sums are added up: every
    rank returns the same metrics."""
    users = user_sample(len(full), max_users)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        users = users[dist.get_rank(group) :: dist.get_world_size(group)]
    # batches of similar lengths: a batch is padded to its longest history
    users = users[np.argsort(np.diff(full.offsets)[users], kind="stable")]
    windows = sorted({r.max_seq_len for r in rankers.values()})
    ranks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in rankers}
    for start in range(0, len(users), batch_size):
        sequences = [full[int(u)] for u in users[start : start + batch_size]]
        target = torch.searchsorted(catalog, torch.tensor([int(items[-1]) for items, _ in sequences]))
        exclude = torch.zeros(len(sequences), len(catalog), dtype=torch.bool)  # the whole history, a repeated target too
        for b, (items, _) in enumerate(sequences):
            exclude[b, torch.searchsorted(catalog, torch.from_numpy(items[:-1]))] = True
        for window in windows:  # each ranker reads the last max_seq_len items of the history
            batch = pad_batch([(items[:-1][-window:], times[:-1][-window:]) for items, times in sequences])
            for name, ranker in rankers.items():
                if ranker.max_seq_len == window:
                    scores = ranker.scores(batch["item_ids"], batch["timestamps"], batch["lengths"].clamp(min=1))
                    ranks[name].append(target_ranks(scores, target, exclude))
    # the sums travel on a device the group's backend reduces on (NCCL: CUDA only)
    nccl = distributed and dist.get_backend(group) == dist.Backend.NCCL
    on = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    out = {}
    for name, r in ranks.items():
        ahead, tied = (torch.cat(x) for x in zip(*r)) if r else (torch.empty(0, dtype=torch.float64),) * 2
        sums = metric_sums(ahead, tied)
        totals = torch.tensor([*sums.values(), ahead.numel()], dtype=torch.float64, device=on)
        if distributed:
            dist.all_reduce(totals, group=group)
        n = int(totals[-1])
        out[name] = {k: v / max(n, 1) for k, v in zip(sums, totals.tolist())} | {"users": n}
    return out
