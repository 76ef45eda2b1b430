"""A distributed sampler that splits every global batch over the ranks by cost, so that
no rank waits for a slower one at the step's collectives.

Under data parallelism each step ends with collectives (the dense gradients' all-reduce,
the embedding exchange), so a step takes as long as its busiest rank. A random split of
sequences of uneven lengths leaves some rank well above the mean at most steps: the
attention's cost grows with the square of a sequence's length. This sampler draws the
same shuffled order on every rank (seed and epoch, as DistributedSampler), cuts it into
global batches of world × batch_size sequences, and splits each one into world shares of
equal count and near-equal cost: in rounds, the world costliest sequences left go to the
shares by their sums so far, the costliest to the lightest. The shares' sums then differ
by at most the costliest sequence's cost. Every rank computes the same split: nothing is
exchanged.

It is a DistributedSampler (Lightning keeps it instead of adding its own): the DataLoader
cuts its indices into batches of batch_size, each one this rank's share of one global
batch. As with DistributedSampler (drop_last False), the order wraps around to give every
rank the same number of samples; the last global batch may be smaller, split evenly.
"""
import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler


def balanced_shares(costs: np.ndarray, shares: int) -> np.ndarray:
    """costs (C, m) of C batches, m a multiple of shares → (C, shares, m // shares): each
    share's positions in its batch, equal counts, sums within the largest cost of each other."""
    count, m = costs.shape
    per = m // shares
    if per * shares != m:
        raise ValueError(f"a batch of {m} does not split into {shares} equal shares")
    costliest_first = np.argsort(-costs, axis=1, kind="stable")
    out = np.empty((count, shares, per), dtype=np.int64)
    sums = np.zeros((count, shares))
    rows = np.arange(count)[:, None]
    for r in range(per):
        taken = costliest_first[:, r * shares : (r + 1) * shares]  # costliest first
        lightest = np.argsort(sums, axis=1, kind="stable")  # lightest share first
        out[rows, lightest, r] = taken
        sums[rows, lightest] += costs[rows, taken]
    return out


class BalancedDistributedSampler(DistributedSampler):
    def __init__(self, dataset: Dataset, costs: np.ndarray, batch_size: int, num_replicas: int, rank: int, seed: int = 0):
        """costs: (len(dataset),) each sample's cost (lightning_modules/flops.py's
        sequence_flops of its rows); batch_size: sequences per rank and step."""
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        costs = np.asarray(costs, dtype=np.float64)
        if costs.shape != (len(dataset),):
            raise ValueError(f"costs has shape {costs.shape}; the dataset has {len(dataset)} samples")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.costs, self.batch_size = costs, batch_size

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = np.resize(torch.randperm(len(self.dataset), generator=g).numpy(), self.total_size)  # wraps around
        return iter(self.share(order).tolist())

    def share(self, order: np.ndarray) -> np.ndarray:
        """This rank's share of each global batch of `order` (indices, a multiple of
        num_replicas long), batch after batch."""
        world, full = self.num_replicas, self.num_replicas * self.batch_size
        cut = len(order) - len(order) % full
        parts = []
        for batches in (order[:cut].reshape(-1, full), order[cut:].reshape(1, -1)):
            if batches.size:
                shares = balanced_shares(self.costs[batches], world)[:, self.rank]
                parts.append(np.take_along_axis(batches, shares, axis=1).reshape(-1))
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
