"""BalancedDistributedSampler: every rank's batches together are each global batch of one
shuffled order, split into equal counts whose costs differ by at most the costliest
sequence; far closer than the random split it replaces. And the data module uses it
under several processes where training gives it a cost."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_modules.balanced_sampler import BalancedDistributedSampler, balanced_shares
from lightning_modules.config import preset
from lightning_modules.data import unpacked
from lightning_modules.data_module import SequenceDataModule
from lightning_modules.datasets import prepare
from lightning_modules.flops import sequence_cost, sequence_flops


class Items:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def long_costs(n: int, seed: int = 0) -> np.ndarray:
    """hstu-long's costs of sequences of 2048 .. 4096 rows."""
    lengths = np.random.default_rng(seed).integers(2048, 4097, size=n)
    return sequence_flops(preset("hstu-long"), lengths, 16384)


def rank_batches(n: int, costs: np.ndarray, batch: int, world: int, epoch: int = 0) -> list[list[list[int]]]:
    """Per rank, its batches of indices, as the DataLoader cuts them."""
    out = []
    for rank in range(world):
        s = BalancedDistributedSampler(Items(n), costs, batch, world, rank, seed=3)
        s.set_epoch(epoch)
        idx = list(s)
        assert len(idx) == len(s)
        out.append([idx[i : i + batch] for i in range(0, len(idx), batch)])
    return out


@pytest.mark.parametrize("n, batch, world", [(1000, 16, 4), (37, 4, 3), (5, 4, 2), (64, 8, 8)])
def test_the_ranks_split_each_global_batch_of_one_order(n, batch, world):
    costs = long_costs(n)
    per_rank = rank_batches(n, costs, batch, world)
    steps = len(per_rank[0])
    assert all(len(b) == steps for b in per_rank)  # every rank makes the same number of steps
    g = torch.Generator().manual_seed(3)
    order = np.resize(torch.randperm(n, generator=g).numpy(), -(-n // world) * world)  # wraps as DistributedSampler
    at = 0
    for step in range(steps):
        shares = [per_rank[r][step] for r in range(world)]
        assert len({len(s) for s in shares}) == 1  # equal counts
        size = sum(len(s) for s in shares)
        assert sorted(i for s in shares for i in s) == sorted(order[at : at + size].tolist())  # one global batch
        sums = [costs[s].sum() for s in shares]
        assert max(sums) - min(sums) <= costs[order[at : at + size]].max() + 1e-6
        at += size
    assert at == len(order)


def test_shares_are_far_closer_than_a_random_split():
    n, batch, world = 4096, 16, 8
    costs = long_costs(n, seed=1)
    per_rank = rank_batches(n, costs, batch, world)
    balanced = np.array([[costs[per_rank[r][s]].sum() for r in range(world)] for s in range(len(per_rank[0]))])
    random = costs[np.random.default_rng(2).permutation(n)].reshape(-1, world, batch).sum(2)
    excess = lambda sums: float((sums.max(1) / sums.mean(1) - 1).mean())  # the busiest rank over the mean  # noqa: E731
    assert excess(random) > 0.05  # a random split costs the step several percent
    assert excess(balanced) < excess(random) / 10


def test_epochs_draw_new_orders_and_bad_costs_are_refused():
    costs = long_costs(200)
    first, second = rank_batches(200, costs, 8, 2, epoch=0), rank_batches(200, costs, 8, 2, epoch=1)
    assert first != second and first == rank_batches(200, costs, 8, 2, epoch=0)
    with pytest.raises(ValueError, match="costs has shape"):
        BalancedDistributedSampler(Items(10), np.ones(9), 4, 2, 0)
    with pytest.raises(ValueError, match="equal shares"):
        balanced_shares(np.ones((1, 5)), 2)


def test_training_data_is_split_by_cost_under_several_processes(tmp_path):
    """SequenceDataModule with training's cost: a random split on one process; under two,
    the two ranks' first batches are one global batch with near-equal FLOPs."""
    prepare("synthetic", tmp_path, synthetic_users=300, seed=0)
    config = preset("hstu").override(max_seq_len=50)

    def first_batch(world: int, rank: int) -> dict:
        data = SequenceDataModule(tmp_path, config.max_seq_len, 16, cost=sequence_cost(config, 1000), seed=config.seed)
        data.trainer = SimpleNamespace(world_size=world, global_rank=rank)
        data.setup("fit")
        loader = data.train_dataloader()
        assert isinstance(loader.sampler, BalancedDistributedSampler) == (world > 1)
        return unpacked(next(iter(loader)))

    one = first_batch(1, 0)
    assert len(one["lengths"]) == 16
    shares = [first_batch(2, r) for r in range(2)]
    costs = [sequence_flops(config, (s["lengths"] - 1).numpy(), 1000) for s in shares]
    assert [len(c) for c in costs] == [16, 16]
    assert abs(costs[0].sum() - costs[1].sum()) <= max(c.max() for c in costs) + 1e-6
