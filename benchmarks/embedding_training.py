"""Embedding training step on dynamicemb's published benchmark workload.

    python benchmarks/embedding_training.py [--optimizer adam sgd] [--policies lru lfu admission] [--host-tier] [--per-table]

10 tables of capacity 1,677,721 rows, 104,857 ids per table per batch (one id per sample,
no pooling), dim 128, fp32, ids from a power law with exponent 1.05, as in dynamicemb's
benchmark: every table first holds every id of its range (inserted before timing), and
an iteration is the lookup (forward) of every table followed by the backward with a
given output gradient, which here is the gradient sum and the fused optimizer update.
The tables are one DynamicEmbeddingCollection (all ten in one group: one launch per
kernel for all tables, tiered or not); --per-table also times ten DynamicEmbeddings called
one by one.
Times are CUDA events around 100 back-to-back iterations (no sync between them) after
10 warm-up iterations, each iteration with fresh ids; host_issue_ms is the host's time to
issue an iteration. Where it nears the GPU's, the GPU waits on the host and the mean
measures the machine's CPU more than the kernels. Tier "host": 10% of the rows on the
GPU, the rest in pinned host memory (worked in place by GPU kernels), the next batch's
rows prefetched in each iteration (the collection's prefetch; one by one, each table's); its tables are filled the same way, in smaller
lookups (a lookup's new ids must fit the device tier). --policies times the step with
other eviction settings too: lfu (scores counting uses), admission (a new id gets a row
on its second sighting), with every row on the GPU and, with --host-tier, tiered; and
lfu_promote (lfu with promote_on_miss: every id missing from the device tier moves up,
the least used row down), tiered only. The path column says whether the collection
grouped them.
"GB moved": rows moved between the tiers per iteration (promotions and demotions), times
the row's bytes (embedding and Adam state); --profile prints the kernels of 10 more
iterations (fresh batches, after the timed ones) by GPU time, their time beside the
iterations', and with --trace writes their host and device timelines.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402

from kernels.dynamic_embedding import EmbeddingConfig, OptimizerConfig  # noqa: E402
from kernels.dynamic_embedding.collection import DynamicEmbeddingCollection  # noqa: E402

TABLES, CAPACITY, IDS, DIM, ALPHA = 10, 1_677_721, 104_857, 128, 1.05
PUBLISHED_MS = {"dynamicemb_adam": 2.19, "dynamicemb_sgd": 1.92, "torchrec_adam": 1.35, "torchrec_sgd": 0.96}
PROFILED_STEPS = 10
PUBLISHED_HOST_MS = {"dynamicemb_adam_cached": 12.28, "dynamicemb_adam_uncached": 33.31}


def power_law_ids(n: int, high: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """Inverse-CDF draws of a continuous power law on [1, high], shifted to [0, high)."""
    u = torch.rand(n, device="cuda", generator=gen, dtype=torch.float64)
    a = 1.0 - alpha
    x = ((high**a - 1.0) * u + 1.0) ** (1.0 / a)
    return (x.floor().long() - 1).clamp(0, high - 1)


# EmbeddingConfig settings; lfu_promote (every missed id moved up, lfu victims) only with --host-tier
POLICIES = {
    "lru": {}, "lfu": {"eviction": "lfu"}, "admission": {"admission_threshold": 2},
    "lfu_promote": {"eviction": "lfu", "promote_on_miss": True},
}


def run(
    optimizer: str, iters: int, warmup: int, tier: str = "hbm", per_table: bool = False, policy: str = "lru", profile: bool = False,
    trace: str | None = None,
) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    config = EmbeddingConfig(
        dim=DIM, optimizer=OptimizerConfig(name=optimizer, lr=1e-3), capacity=CAPACITY, max_capacity=CAPACITY, bucket_size=128,
        max_load_factor=1.0, device_capacity=CAPACITY // 10 if tier == "host" else None, **POLICIES[policy],
    )
    names = [f"t{i}" for i in range(TABLES)]
    tables = DynamicEmbeddingCollection({n: config for n in names}, "cuda")
    # every id of the range first, as dynamicemb's benchmark
    fill = 1 << 20 if tier == "hbm" else 1 << 15
    for start in range(0, CAPACITY, fill):
        chunk = torch.arange(start, min(start + fill, CAPACITY), device="cuda")
        for _ in range(config.admission_threshold):  # seen often enough to be admitted
            tables.lookup({n: chunk for n in names})
    grads = {n: torch.randn(IDS, DIM, device="cuda", generator=gen) for n in names}
    profiled = PROFILED_STEPS if profile else 0
    batches = [{n: power_law_ids(IDS, CAPACITY, ALPHA, gen) for n in names} for _ in range(warmup + iters + profiled + 1)]

    def step(i: int) -> None:
        ids = batches[i]
        if tier == "host" and per_table:
            for n, x in batches[i + 1].items():
                tables[n].prefetch(x)
        elif tier == "host":
            tables.prefetch(batches[i + 1])
        if per_table:
            for n, x in ids.items():
                tables[n].lookup(x)
                tables[n].apply_gradients(x, grads[n])
        else:
            tables.lookup(ids)
            tables.apply_gradients(ids, grads)

    def moved() -> int:  # rows moved between the tiers so far, both ways
        return sum(s.promotions + s.demotions for s in tables.stats().values())

    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    moved_before = moved()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    issue = time.perf_counter()
    for i in range(warmup, warmup + iters):
        step(i)
    issue = time.perf_counter() - issue
    end.record()
    torch.cuda.synchronize()
    ms_mean = start.elapsed_time(end) / iters
    stats = tables.stats()
    moves = (moved() - moved_before) / iters
    if profile:  # the GPU's time per kernel over PROFILED_STEPS more iterations, on fresh batches
        label = f"{tier}_{policy}_{'one-by-one' if per_table else 'grouped'}"
        activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if trace else [])
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.profiler.profile(activities=activities) as prof:
            first.record()
            for i in range(warmup + iters, warmup + iters + profiled):
                step(i)
            last.record()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]  # (not the host ops that launched them)
        busy = sum(e.self_device_time_total for e in kernels) / 1e3 / profiled
        print(f"{label}, {profiled} iterations: {first.elapsed_time(last) / profiled:.2f} ms each, "
              f"kernels and copies {busy:.2f} ms of it")
        print(averages.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
        if trace:
            Path(trace).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(trace) / f"{label}.json"))
    return {
        "optimizer": optimizer, "tables": TABLES, "capacity": CAPACITY, "ids_per_table": IDS, "dim": DIM, "alpha": ALPHA,
        "iterations": iters, "ms_mean": ms_mean, "host_issue_ms": issue * 1e3 / iters, "tier": tier,
        "policy": policy, "path": "one by one" if per_table or tables.single else "grouped",
        "rows_per_table_after": sum(s.size for s in stats.values()) / TABLES,
        "tier_moves_per_iter": moves, "tier_gb_per_iter": moves * config.row_bytes() / 1e9,
        "published_ms": PUBLISHED_HOST_MS if tier == "host" else {k: v for k, v in PUBLISHED_MS.items() if k.endswith(optimizer)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", nargs="+", default=["adam", "sgd"])
    p.add_argument("--host-tier", action="store_true", help="also run Adam with 10%% of rows on the GPU")
    p.add_argument("--per-table", action="store_true", help="also time the tables called one by one")
    p.add_argument("--policies", nargs="+", default=["lru"], choices=sorted(POLICIES), help="eviction settings to time")
    p.add_argument("--profile", action="store_true", help="print each run's kernels by GPU time")
    p.add_argument("--trace", metavar="DIR", help="with --profile: host and device timelines of the profiled iterations, Chrome traces in DIR")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/embedding_training_<gpu>.json)")
    args = p.parse_args()
    rows = []
    for o in args.optimizer:
        for policy in args.policies:
            if POLICIES[policy].get("promote_on_miss"):
                continue  # (a setting of tiered tables)
            rows.append(run(o, args.iters, args.warmup, policy=policy, profile=args.profile, trace=args.trace))
            torch.cuda.empty_cache()
        if args.per_table:
            rows.append(run(o, args.iters, args.warmup, per_table=True))
            torch.cuda.empty_cache()
    if args.host_tier:
        for policy in args.policies:
            rows.append(run("adam", args.iters, args.warmup, tier="host", policy=policy, profile=args.profile, trace=args.trace))
            torch.cuda.empty_cache()
        if args.per_table:
            rows.append(run("adam", args.iters, args.warmup, tier="host", per_table=True))
    print(f"\n{torch.cuda.get_device_name()}: forward + backward + update, ms per iteration")
    print(f"{'optimizer':<10}{'policy':<10}{'tier':<6}{'path':<12}{'mean':>8}{'host':>8}{'GB moved':>10}   published (H100)")
    for r in rows:
        print(f"{r['optimizer']:<10}{r['policy']:<10}{r['tier']:<6}{r['path']:<12}{r['ms_mean']:>8.2f}{r['host_issue_ms']:>8.2f}"
              f"{r['tier_gb_per_iter']:>10.3f}   {r['published_ms']}")
    if any(r["host_issue_ms"] > 0.9 * r["ms_mean"] for r in rows):
        print("host: the time to issue an iteration is close to its GPU time: those rows measure this machine's host")
    write_results("embedding_training", rows, args.out)


if __name__ == "__main__":
    main()
