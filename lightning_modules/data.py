"""Sequences from the prepared Parquet files, batched as right-padded tensors."""
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset


class Sequences(Dataset):
    """One sample per user: `max_len` consecutive items of a split's sequence, the last
    ones, or with `random_windows` a window ending at a random place (each ending with at
    least max_len items before it equally likely) so that the earlier items of a long
    sequence are trained on too."""

    def __init__(self, path: str | Path, max_len: int, random_windows: bool = False):
        table = pq.read_table(path)
        self.users = table.column("user_id").to_numpy()
        items, times = table.column("item_ids").combine_chunks(), table.column("timestamps").combine_chunks()
        self.offsets = items.offsets.to_numpy().astype(np.int64)
        self.items = items.values.to_numpy().copy()  # writable: torch.from_numpy shares it
        self.times = times.values.to_numpy().copy()
        self.max_len = max_len
        self.random_windows = random_windows

    def __len__(self) -> int:
        return len(self.users)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = self.offsets[i], self.offsets[i + 1]
        if self.random_windows and end - start > self.max_len:
            # numpy's global generator: seeded by the run's seed (and per data loader worker)
            end = int(np.random.randint(start + self.max_len, end + 1))
        start = max(start, end - self.max_len)
        return self.items[start:end], self.times[start:end]

    def all_items(self) -> np.ndarray:
        return np.unique(self.items)


def pad_batch(samples: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    """→ item_ids (B, L) int64, timestamps (B, L) int64, lengths (B,); L = longest sample."""
    lengths = torch.tensor([len(s[0]) for s in samples], dtype=torch.int64)
    L = int(lengths.max()) if len(samples) else 0
    ids = torch.zeros(len(samples), L, dtype=torch.int64)
    ts = torch.zeros(len(samples), L, dtype=torch.int64)
    for b, (items, times) in enumerate(samples):
        ids[b, : len(items)] = torch.from_numpy(items)
        ts[b, : len(times)] = torch.from_numpy(times)
    return {"item_ids": ids, "timestamps": ts, "lengths": lengths}


class SequenceDataModule(L.LightningDataModule):
    """Training batches from `train.parquet`; Lightning adds the distributed sampler."""

    def __init__(self, data_dir: str | Path, max_len: int, batch_size: int, num_workers: int = 0, random_windows: bool = False):
        super().__init__()
        self.data_dir = Path(data_dir)
        self.max_len, self.batch_size, self.num_workers = max_len, batch_size, num_workers
        self.random_windows = random_windows

    def setup(self, stage: str | None = None) -> None:
        # a training sample needs one more item than the model sees: the last one's target
        self.train = Sequences(self.data_dir / "train.parquet", self.max_len + 1, self.random_windows)

    def catalog(self) -> torch.Tensor:
        """Every item id of the training split: the pool negatives are drawn from."""
        return torch.from_numpy(Sequences(self.data_dir / "train.parquet", 1).all_items())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train,
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=pad_batch,
            num_workers=self.num_workers,
            drop_last=False,
        )
