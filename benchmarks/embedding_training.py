"""Embedding training step on dynamicemb's published benchmark workload.

    python benchmarks/embedding_training.py [--optimizer adam sgd]

10 tables of capacity 1,677,721 rows, 104,857 ids per table per batch (one id per sample,
no pooling), dim 128, fp32, ids from a power law with exponent 1.05. One iteration =
lookup (forward) of every table, backward of a loss over the looked-up rows, and the
fused sparse optimizer update of every table. Times are CUDA-event means over 100
iterations after warm-up, each iteration with fresh ids. Tier "hbm": every row in GPU
memory; tier "host": 10% of the rows on the GPU, the rest in pinned host memory, the next
batch's rows prefetched inside each timed iteration.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402

from kernels.dynamic_embedding import DynamicEmbedding, EmbeddingConfig, OptimizerConfig  # noqa: E402

TABLES, CAPACITY, IDS, DIM, ALPHA = 10, 1_677_721, 104_857, 128, 1.05
PUBLISHED_MS = {"dynamicemb_adam": 2.19, "dynamicemb_sgd": 1.92, "torchrec_adam": 1.35, "torchrec_sgd": 0.96}
PUBLISHED_HOST_MS = {"dynamicemb_adam_cached": 12.28, "dynamicemb_adam_uncached": 33.31}


def power_law_ids(n: int, high: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """Inverse-CDF draws of a continuous power law on [1, high], shifted to [0, high)."""
    u = torch.rand(n, device="cuda", generator=gen, dtype=torch.float64)
    a = 1.0 - alpha
    x = ((high**a - 1.0) * u + 1.0) ** (1.0 / a)
    return (x.floor().long() - 1).clamp(0, high - 1)


def run(optimizer: str, iters: int, warmup: int, tier: str = "hbm") -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    config = EmbeddingConfig(
        dim=DIM, optimizer=OptimizerConfig(name=optimizer, lr=1e-3), capacity=CAPACITY, max_capacity=CAPACITY, bucket_size=128,
        max_load_factor=1.0, device_capacity=CAPACITY // 10 if tier == "host" else None,
    )
    tables = [DynamicEmbedding(config, "cuda") for _ in range(TABLES)]
    upstream = torch.randn(IDS, DIM, device="cuda", generator=gen)
    batches = [[power_law_ids(IDS, CAPACITY, ALPHA, gen) + t * CAPACITY for t in range(TABLES)] for _ in range(warmup + iters)]
    times = []
    for i, ids in enumerate(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if tier == "host" and i + 1 < len(batches):
            for table, x in zip(tables, batches[i + 1]):
                table.prefetch(x)
        rows = [table.lookup(x).requires_grad_(True) for table, x in zip(tables, ids)]
        loss = sum((r * upstream).sum() for r in rows)
        loss.backward()
        for table, x, r in zip(tables, ids, rows):
            table.apply_gradients(x, r.grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    sizes = [t.stats().size for t in tables]
    return {
        "optimizer": optimizer, "tables": TABLES, "capacity": CAPACITY, "ids_per_table": IDS, "dim": DIM, "alpha": ALPHA,
        "iterations": iters, "ms_mean": sum(times) / len(times), "ms_median": sorted(times)[len(times) // 2],
        "rows_per_table_after": sum(sizes) / len(sizes), "tier": tier,
        "published_ms": PUBLISHED_HOST_MS if tier == "host" else {k: v for k, v in PUBLISHED_MS.items() if k.endswith(optimizer)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", nargs="+", default=["adam", "sgd"])
    p.add_argument("--host-tier", action="store_true", help="also run Adam with 10%% of rows on the GPU")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/embedding_training_<gpu>.json)")
    args = p.parse_args()
    rows = [run(o, args.iters, args.warmup) for o in args.optimizer]
    if args.host_tier:
        rows.append(run("adam", args.iters, args.warmup, tier="host"))
    print(f"\n{torch.cuda.get_device_name()}: forward + backward + update, ms per iteration")
    print(f"{'optimizer':<10}{'tier':<6}{'mean':>8}{'median':>8}   published (H100)")
    for r in rows:
        print(f"{r['optimizer']:<10}{r['tier']:<6}{r['ms_mean']:>8.2f}{r['ms_median']:>8.2f}   {r['published_ms']}")
    write_results("embedding_training", rows, args.out)


if __name__ == "__main__":
    main()
