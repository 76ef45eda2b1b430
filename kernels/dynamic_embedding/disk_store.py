"""The disk tier of the inference table: int64 id → embedding row in LMDB.

LMDB (through `lmdb`) is a memory-mapped B+tree: readers never block and never take a
lock, one writer commits at a time, and a read transaction sees the database as it was
when it began. That is what serving asks of its last tier: many request threads reading,
a stream of updates writing, and a request that begins after an update's commit seeing
it. It was chosen over RocksDB (`rocksdict`) by measurement (benchmarks/disk_store.py):
serving's batched point reads, the hot path, run about 2.4x faster on LMDB; RocksDB's
log-structured writes are about 3x faster, a rate (LMDB's 130-160k rows/s) streaming
updates do not need.

Keys are stored as 8 big-endian bytes of the id with its sign bit flipped, so that byte
order is numeric order (a sorted bulk load appends); values are the row's float32 bytes.
"""
import shutil
from pathlib import Path

import numpy as np
import torch

MAP_SIZE = 1 << 40  # the memory map's reservation (virtual; the file grows as rows are written)
SIGN_BIT = np.uint64(1 << 63)
WRITE_CHUNK = 1 << 16  # rows per write transaction in a bulk load


def key_bytes(ids: np.ndarray) -> list[bytes]:
    """int64 ids → their 8-byte keys (byte order = numeric order)."""
    raw = (np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64) ^ SIGN_BIT).astype(">u8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


def row_bytes(rows: torch.Tensor) -> list[bytes]:
    """(N, dim) rows → each row's float32 bytes."""
    data = rows.detach().cpu().to(torch.float32).contiguous().numpy().tobytes()
    size = len(data) // rows.shape[0] if rows.shape[0] else 0
    return [data[i : i + size] for i in range(0, len(data), size)] if size else []


class DiskStore:
    """Rows of one embedding table on disk, at `path` (a directory)."""

    def __init__(self, path: str | Path, dim: int, create: bool = False, map_size: int = MAP_SIZE):
        import lmdb  # only where a disk tier is used

        self.path, self.dim = Path(path), dim
        if not create and not (self.path / "data.mdb").is_file():
            raise FileNotFoundError(f"{self.path}: no disk store (data.mdb) here")
        self.path.mkdir(parents=True, exist_ok=True)
        # sync off: a store is rebuilt from its dump, never recovered after a crash
        self.env = lmdb.open(str(self.path), map_size=map_size, readahead=False, sync=False, metasync=False,
                             max_readers=1024, lock=True)

    @staticmethod
    def build(path: str | Path, keys: torch.Tensor, rows: torch.Tensor) -> "DiskStore":
        """A new store holding rows (N, dim) under distinct keys (N,), replacing whatever
        was at `path`."""
        shutil.rmtree(path, ignore_errors=True)
        store = DiskStore(path, rows.shape[1], create=True)
        keys, rows = keys.detach().cpu(), rows.detach().cpu()
        order = torch.argsort(keys, stable=True)
        for start in range(0, order.numel(), WRITE_CHUNK):
            part = order[start : start + WRITE_CHUNK]
            store.append(keys[part], rows[part])
        return store

    def append(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Bulk load: rows under distinct ascending keys, all above every stored key
        (LMDB's append: no page splits, no search); ValueError otherwise."""
        flat = keys.detach().cpu().numpy().astype(np.int64)
        if flat.size == 0:
            return
        with self.env.begin(write=True) as txn:
            pairs = zip(key_bytes(flat), row_bytes(rows))
            added = txn.cursor().putmulti(pairs, append=True)[1]
            if added != flat.size:  # LMDB refuses a key out of order in append mode; raising aborts
                raise ValueError("append: keys must be distinct, ascending and above every stored key")

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (N, dim) float32, found (N,) bool) on the CPU; rows of ids not stored are
        zeros. One read transaction: a consistent view of the store."""
        flat = ids.detach().cpu().numpy()
        with self.env.begin() as txn:
            values = [txn.get(k) for k in key_bytes(flat)]
        found = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
        rows = np.zeros((len(values), self.dim), dtype=np.float32)
        if found.any():
            rows[found] = np.frombuffer(b"".join(v for v in values if v is not None), dtype=np.float32).reshape(-1, self.dim)
        return torch.from_numpy(rows), torch.from_numpy(found)

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Stores rows under ids (the last copy of an id wins), in one transaction: a read
        that begins after this returns sees all of them, one that began before sees none."""
        with self.env.begin(write=True) as txn:
            for k, v in zip(key_bytes(ids.detach().cpu().numpy()), row_bytes(rows)):
                txn.put(k, v)

    def __len__(self) -> int:
        return self.env.stat()["entries"]

    def bytes_on_disk(self) -> int:
        """Disk space the store takes (blocks allocated, not the map's reservation)."""
        return sum(p.stat().st_blocks * 512 for p in self.path.iterdir() if p.is_file())

    def close(self) -> None:
        self.env.close()

    def remove(self) -> None:
        """Closes the store and deletes its files."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
