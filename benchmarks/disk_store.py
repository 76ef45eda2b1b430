"""The inference table's disk tier: LMDB (the store it uses) against RocksDB, on the work
serving gives it.

    python benchmarks/disk_store.py [--rows 2000000] [--dims 64 128]   # rocksdict: pip install .[bench]

For each store and dim: a bulk load of N rows (float32) under distinct random int64 ids,
batched point reads of 4,096 ids drawn from a power law (α 1.05, 10% of them absent),
as the inference table's misses reach the disk, and batched overwrites (streaming
updates). Both stores get rows as bytes under the same 8-byte keys; RocksDB reads with
one multi-get per batch, LMDB with one read transaction. Prints a table and writes JSON
to benchmarks/results/disk_store_cpu.json.
"""
import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402
from kernels.dynamic_embedding.disk_store import DiskStore, key_bytes  # noqa: E402

BATCH, ALPHA, ABSENT = 4096, 1.05, 0.1
READ_BATCHES, UPDATE_BATCHES = 200, 20


class RocksStore:
    """RocksDB through rocksdict, with the disk tier's calls."""

    def __init__(self, path: Path, dim: int):
        from rocksdict import Options, Rdict

        options = Options(raw_mode=True)
        options.create_if_missing(True)
        self.db, self.dim = Rdict(str(path), options), dim

    def load(self, keys: np.ndarray, rows: np.ndarray) -> None:
        from rocksdict import WriteBatch

        order = np.argsort(keys)
        for start in range(0, len(order), 1 << 16):
            part = order[start : start + (1 << 16)]
            batch = WriteBatch(raw_mode=True)
            for k, r in zip(key_bytes(keys[part]), rows[part]):
                batch.put(k, r.tobytes())
            self.db.write(batch)
        self.db.flush()

    def read(self, ids: np.ndarray) -> np.ndarray:
        values = self.db.get(key_bytes(ids))
        out = np.zeros((len(ids), self.dim), dtype=np.float32)
        found = np.fromiter((v is not None for v in values), bool, len(values))
        if found.any():
            out[found] = np.frombuffer(b"".join(v for v in values if v is not None), np.float32).reshape(-1, self.dim)
        return out

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        from rocksdict import WriteBatch

        batch = WriteBatch(raw_mode=True)
        for k, r in zip(key_bytes(ids), rows):
            batch.put(k, r.tobytes())
        self.db.write(batch)

    def close(self) -> None:
        self.db.close()


def power_law_batches(keys: np.ndarray, rng: np.random.Generator, n: int) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        ranks = rng.zipf(ALPHA, 4 * BATCH)
        ranks = ranks[ranks <= len(keys)][:BATCH] - 1
        ids = keys[ranks]
        absent = rng.random(len(ids)) < ABSENT
        ids[absent] = rng.integers(-(1 << 62), 1 << 62, int(absent.sum()))
        out.append(ids)
    return out


def run(store: str, rows_n: int, dim: int, work: Path) -> dict:
    rng = np.random.default_rng(0)
    keys = rng.choice(1 << 50, rows_n, replace=False).astype(np.int64) - (1 << 49)
    rows = rng.standard_normal((rows_n, dim), dtype=np.float32)
    path = work / f"{store}-{dim}"
    shutil.rmtree(path, ignore_errors=True)
    t = time.perf_counter()
    if store == "lmdb":
        db = DiskStore.build(path, torch.from_numpy(keys), torch.from_numpy(rows))
        read = lambda ids: db.read(torch.from_numpy(ids))  # noqa: E731
        write = lambda ids, r: db.write(torch.from_numpy(ids), torch.from_numpy(r))  # noqa: E731
    else:
        db = RocksStore(path, dim)
        db.load(keys, rows)
        read, write = db.read, db.write
    load_s = time.perf_counter() - t
    batches = power_law_batches(keys, rng, READ_BATCHES)
    t = time.perf_counter()
    for ids in batches:
        read(ids)
    read_s = time.perf_counter() - t
    updates = [keys[rng.integers(0, rows_n, BATCH)] for _ in range(UPDATE_BATCHES)]
    t = time.perf_counter()
    for ids in updates:
        write(ids, rows[: len(ids)])
    update_s = time.perf_counter() - t
    disk = sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())
    db.close()
    shutil.rmtree(path, ignore_errors=True)
    return {
        "store": store, "rows": rows_n, "dim": dim, "load_rows_per_s": rows_n / load_s,
        "read_keys_per_s": READ_BATCHES * BATCH / read_s, "update_rows_per_s": UPDATE_BATCHES * BATCH / update_s,
        "disk_bytes_per_row": disk / rows_n,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--stores", nargs="+", default=["lmdb", "rocksdb"])
    p.add_argument("--out")
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="disk-store-") as tmp:
        print(f"{'store':>8} {'dim':>4} {'load rows/s':>12} {'reads keys/s':>13} {'updates rows/s':>15} {'bytes/row':>10}")
        for dim in args.dims:
            for store in args.stores:
                r = run(store, args.rows, dim, Path(tmp))
                results.append(r)
                print(f"{store:>8} {dim:>4} {r['load_rows_per_s']:>12,.0f} {r['read_keys_per_s']:>13,.0f} "
                      f"{r['update_rows_per_s']:>15,.0f} {r['disk_bytes_per_row']:>10,.0f}", flush=True)
    write_results("disk_store", results, args.out, device="cpu", batch=BATCH, alpha=ALPHA, absent=ABSENT)


if __name__ == "__main__":
    main()
