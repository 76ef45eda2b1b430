"""Lookups through the tiered inference table (device cache, host cache, LMDB disk store)
against the same lookups with every row on the device.

    python benchmarks/inference_table.py [--ids 100000000] [--dims 64 128] [--batch 65536]

`--ids` rows of random int64 ids; the device cache holds 1% of them and the host cache
10%, the disk store all. Batches of `--batch` ids are drawn from a power law (α 1.05) over
a fixed random ranking of the ids; `--warmup` batches fill the caches (by default as
many ids as the table holds, so that the caches reach their steady state rather than
serving first sightings from disk), then `--batches` are timed (each call up to a synchronize). Reported: ids per second and the share of ids
each tier served. The baseline is the engine's table holding every row on the device
(find of the same batches). Prints a table and writes JSON to
benchmarks/results/inference_table_<device>.json.
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
from kernels.dynamic_embedding import EmbeddingConfig, OptimizerConfig  # noqa: E402
from kernels.dynamic_embedding.disk_store import DiskStore  # noqa: E402
from kernels.dynamic_embedding.embedding import make_table  # noqa: E402
from kernels.dynamic_embedding.inference import InferenceConfig, InferenceTable  # noqa: E402

ALPHA, DEVICE_SHARE, HOST_SHARE = 1.05, 0.01, 0.10
CHUNK = 1 << 22  # rows generated and written at a time


def batches(ids: torch.Tensor, n: int, size: int, rng: np.random.Generator):
    """n batches of `size` ids drawn by power-law rank."""
    for _ in range(n):
        ranks = rng.zipf(ALPHA, 3 * size)
        ranks = ranks[ranks <= ids.numel()][:size] - 1
        yield ids[torch.from_numpy(ranks)]


def timed(fn, work: list[torch.Tensor], device: str) -> float:
    """Ids per second of fn over the batches."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for b in work:
        fn(b)
    if device == "cuda":
        torch.cuda.synchronize()
    return sum(b.numel() for b in work) / (time.perf_counter() - start)


def run(n_ids: int, dim: int, batch: int, warmup: int, timed_batches: int, device: str, work: Path) -> dict:
    g = torch.Generator().manual_seed(dim)
    ids = torch.unique(torch.randint(-(1 << 62), 1 << 62, (n_ids,), generator=g))  # ascending
    t = time.perf_counter()
    store = DiskStore(work / f"store-{dim}", dim, create=True)
    for start in range(0, ids.numel(), CHUNK):  # a bulk load in key order, chunk by chunk
        part = ids[start : start + CHUNK]
        store.append(part, torch.randn(part.numel(), dim, generator=g))
    build_s = time.perf_counter() - t
    store_bytes = store.bytes_on_disk()
    ids = ids[torch.randperm(ids.numel(), generator=g)]  # a random popularity ranking
    config = InferenceConfig(EmbeddingConfig(dim=dim), device_rows=int(n_ids * DEVICE_SHARE), host_rows=int(n_ids * HOST_SHARE))
    table = InferenceTable(config, store, device)
    rng = np.random.default_rng(0)
    for b in batches(ids, warmup, batch, rng):  # fills the caches (and compiles the kernels)
        table.lookup(b)
    before = table.stats()
    work_batches = [b.to(device) for b in batches(ids, timed_batches, batch, rng)]
    tiered = timed(table.lookup, work_batches, device)
    after = table.stats()
    looked = after.lookups - before.lookups
    share = {t: (getattr(after, f"{t}_hits") - getattr(before, f"{t}_hits")) / looked for t in ("device", "host", "disk")}
    table.close(remove_files=True)
    del table

    flat = make_table(EmbeddingConfig(dim=dim, optimizer=OptimizerConfig("sgd"), max_capacity=n_ids), torch.device(device),
                      capacity=n_ids, preallocate=True)
    for start in range(0, ids.numel(), CHUNK):
        part = ids[start : start + CHUNK].to(device)
        flat.insert_or_assign(part, torch.randn(part.numel(), dim, device=device), torch.zeros_like(part), return_evicted=False)
    out = torch.empty(batch, dim, device=device)

    def find(b):
        return flat.find_values(b, out[: b.numel()]) if hasattr(flat, "find_values") else flat.find(b)

    find(work_batches[0])  # compiles the probe kernel outside the timing
    on_device = timed(find, work_batches, device)
    return {
        "ids": n_ids, "dim": dim, "batch": batch, "build_s": build_s, "store_gib": store_bytes / 2**30, "tiered_ids_per_s": tiered,
        "device_share": share["device"], "host_share": share["host"], "disk_share": share["disk"],
        "all_on_device_ids_per_s": on_device,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ids", type=int, default=100_000_000)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--warmup", type=int, help="batches before the timing (default: --ids ids in all)")
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="inference-table-"))
    results = []
    print(f"{'ids':>12} {'dim':>4} {'tiered ids/s':>13} {'device':>7} {'host':>6} {'disk':>6} {'all on device ids/s':>20} {'build s':>8}")
    try:
        for dim in args.dims:
            warmup = args.warmup if args.warmup is not None else -(-args.ids // args.batch)
            r = run(args.ids, dim, args.batch, warmup, args.batches, args.device, work)
            results.append(r)
            print(f"{r['ids']:>12,} {dim:>4} {r['tiered_ids_per_s']:>13,.0f} {r['device_share']:>7.1%} {r['host_share']:>6.1%} "
                  f"{r['disk_share']:>6.1%} {r['all_on_device_ids_per_s']:>20,.0f} {r['build_s']:>8.0f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results("inference_table", results, args.out, device=args.device, alpha=ALPHA, device_share=DEVICE_SHARE,
                  host_share=HOST_SHARE)


if __name__ == "__main__":
    main()
