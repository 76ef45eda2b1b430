"""Sequences from the prepared Parquet files: training batches jagged (what the HSTU model
reads), evaluation batches right-padded (what every ranker scores). Without Lightning, so
that the steps that only read sequences (evaluation, export) do not import it;
data_module.py is the training side's LightningDataModule over them."""
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from kernels.launch import aligned_size

from .hstu import valid_mask


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

    def input_lengths(self) -> np.ndarray:
        """(len,) the rows each sample gives the model: its window but the last item (the
        last one's target)."""
        return np.maximum(np.minimum(np.diff(self.offsets), self.max_len) - 1, 0)

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


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.zeros(0, np.int64)


def jagged_batch(samples: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    """A training batch, built in the loader's worker so the step reads nothing back from
    the device: item_ids and timestamps (total,) int64, the samples one after the other;
    lengths (B,) and offsets (B + 1,); input_rows, every row but each sample's last (what
    the model reads: row r's target is the next item, row r + 1), and input_offsets, the
    offsets of those rows (samples one row shorter)."""
    lengths = np.fromiter((len(items) for items, _ in samples), dtype=np.int64, count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    input_offsets = np.zeros_like(offsets)
    np.cumsum(np.maximum(lengths - 1, 0), out=input_offsets[1:])
    has_next = np.ones(offsets[-1], dtype=bool)
    has_next[offsets[1:][lengths > 0] - 1] = False  # each sample's last row
    return {
        "item_ids": torch.from_numpy(_concat([items for items, _ in samples])),
        "timestamps": torch.from_numpy(_concat([times for _, times in samples])),
        "lengths": torch.from_numpy(lengths),
        "offsets": torch.from_numpy(offsets),
        "input_rows": torch.from_numpy(np.flatnonzero(has_next)),
        "input_offsets": torch.from_numpy(input_offsets),
    }


def _aligned(size: int) -> int:
    """The int64 elements a PackedBatch leaves for an array of `size`: each array then
    starts 16-byte aligned (kernels.launch.ALIGN_BYTES), so that its view's alignment does not change with the sizes
    of the arrays before it (a kernel reading it would compile again at whichever step
    first brought the other)."""
    return aligned_size(size, np.dtype(np.int64).itemsize)


class PackedBatch:
    """jagged_batch's arrays as one int64 array, with their names and sizes, each array
    starting 16-byte aligned (_aligned; zeros between). A data loader's
    worker hands it to the main process as pickled bytes: a tensor would go as a shared
    memory file descriptor, passed over a connection the main process opens to the worker
    for each batch, which costs the main process more than the batch's whole collation.
    The loader's pinning thread makes it a pinned tensor (pin_memory), Lightning moves it
    to the device in one copy (to), and `unpacked` gives the jagged batch back there."""

    def __init__(self, values: np.ndarray | torch.Tensor, layout: tuple):
        self.values, self.layout = values, layout  # layout: (name, size) per array, in order

    def _tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.values) if isinstance(self.values, np.ndarray) else self.values

    def pin_memory(self, device=None) -> "PackedBatch":
        return PackedBatch(self._tensor().pin_memory(), self.layout)

    def to(self, device, non_blocking: bool | None = None) -> "PackedBatch":
        """On `device`; the copy from pinned memory does not block unless non_blocking=False."""
        t = self._tensor()
        return PackedBatch(t.to(device, non_blocking=t.is_pinned() if non_blocking is None else non_blocking), self.layout)

    def unpacked(self) -> dict[str, torch.Tensor]:
        """The jagged batch (views of the packed tensor, wherever it lies)."""
        names, sizes = zip(*self.layout)
        parts = self._tensor().split([_aligned(n) for n in sizes])
        return {name: part[:n] for name, part, n in zip(names, parts, sizes)}


def packed_jagged_batch(samples: list[tuple[np.ndarray, np.ndarray]]) -> PackedBatch:
    """jagged_batch of samples as a PackedBatch."""
    batch = jagged_batch(samples)
    values = np.zeros(sum(_aligned(t.numel()) for t in batch.values()), dtype=np.int64)
    start = 0
    for t in batch.values():
        values[start : start + t.numel()] = t.numpy().reshape(-1)
        start += _aligned(t.numel())
    return PackedBatch(values, tuple((k, t.numel()) for k, t in batch.items()))


def unpacked(batch) -> dict[str, torch.Tensor]:
    """The jagged batch of a PackedBatch; any other batch as it is."""
    return batch.unpacked() if isinstance(batch, PackedBatch) else batch


def padded(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, L, ...) right-padded with zeros from jagged (total, ...) values; L = the longest
    length."""
    width = int(lengths.max()) if lengths.numel() else 0
    out = values.new_zeros((lengths.numel(), width) + values.shape[1:])
    out[valid_mask(lengths, width)] = values
    return out
