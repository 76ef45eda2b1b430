"""The training batches as a LightningDataModule: data.py's sequences, loaded, sampled and
packed for Lightning's loop."""
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from .balanced_sampler import BalancedDistributedSampler
from .data import Sequences, packed_jagged_batch, unpacked


class SequenceDataModule(L.LightningDataModule):
    """Jagged training batches from `train.parquet`, packed by the loader and unpacked on
    the device (packed_jagged_batch). Under several processes, with `cost` (each sequence's
    cost from the rows it gives the model: flops.sequence_flops) every global batch is split
    over the ranks by cost (BalancedDistributedSampler, seeded by `seed`); without it
    Lightning adds its random DistributedSampler."""

    def __init__(
        self, data_dir: str | Path, max_len: int, batch_size: int, num_workers: int = 0, random_windows: bool = False,
        cost: Callable[[np.ndarray], np.ndarray] | None = None, seed: int = 0,
    ):
        super().__init__()
        self.data_dir = Path(data_dir)
        self.max_len, self.batch_size, self.num_workers = max_len, batch_size, num_workers
        self.random_windows = random_windows
        self.cost, self.seed = cost, seed

    def setup(self, stage: str | None = None) -> None:
        # a training sample needs one more item than the model sees: the last one's target
        self.train = Sequences(self.data_dir / "train.parquet", self.max_len + 1, self.random_windows)

    def catalog(self) -> torch.Tensor:
        """Every item id of the training split: the pool negatives are drawn from."""
        return torch.from_numpy(Sequences(self.data_dir / "train.parquet", 1).all_items())

    def train_dataloader(self) -> DataLoader:
        world = self.trainer.world_size if self.trainer is not None else 1
        sampler = None
        if self.cost is not None and world > 1:
            costs = self.cost(self.train.input_lengths())
            sampler = BalancedDistributedSampler(self.train, costs, self.batch_size, world, self.trainer.global_rank, self.seed)
        return DataLoader(
            self.train,
            batch_size=self.batch_size,
            shuffle=sampler is None,
            sampler=sampler,
            collate_fn=packed_jagged_batch,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,  # not restarted every epoch
            pin_memory=torch.cuda.is_available(),  # host-to-device copies that do not block
            drop_last=False,
        )

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict[str, torch.Tensor]:
        return unpacked(batch)
