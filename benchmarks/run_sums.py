"""The sharded collection's gradient sums on one GPU: the distinct ids' gradient copies
summed before they travel, by one atomic add per lane (`index_add_` per table, the form
before run_sum_kernels) and by the run-sum kernel over the routing's order (reading each
table's gradients where they lie), at the scaling benchmark's embedding workload per GPU: 10
tables of dim 128, 65,536 power-law ids each (α 1.05 over the ids of `--gpus` GPUs'
shards, as benchmarks/scaling.py draws them).

    python benchmarks/run_sums.py [--gpus 2]

The routing order and runs group copies of an id as ShardedDynamicEmbeddingCollection._route
does (ids sorted by table and key here: one owner). Prints a table (median of
triton.testing.do_bench, ms) and writes JSON to benchmarks/results/.
"""
import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402
from benchmarks.scaling import ALPHA, DIM, FULL, TABLES, power_law  # noqa: E402
from kernels.dynamic_embedding.run_sum_kernels import sum_runs  # noqa: E402


def routed(ids_per_table: int, rows: int, gen: torch.Generator):
    """(per-table ids, order, run, per-table slots, distinct) as the routing makes them."""
    ids = [power_law(ids_per_table, rows, gen, "cuda") for _ in range(TABLES)]
    keys = torch.cat(ids)
    tids = torch.arange(TABLES, device="cuda").repeat_interleave(ids_per_table)
    by_key = torch.argsort(keys, stable=True)
    order = by_key[torch.argsort(tids[by_key], stable=True)]
    skeys, stids = keys[order], tids[order]
    first = torch.ones_like(skeys, dtype=torch.bool)
    first[1:] = (skeys[1:] != skeys[:-1]) | (stids[1:] != stids[:-1])
    run = torch.cumsum(first, 0) - 1
    slot = torch.empty_like(run)
    slot[order] = run
    return ids, order, run, slot.split(ids_per_table), int(run[-1]) + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=2, help="the id range is this many GPUs' shards")
    p.add_argument("--out")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    ids, order, run, slots, distinct = routed(FULL["ids"], FULL["rows"] * args.gpus, gen)
    grads = [torch.randn(FULL["ids"], DIM, generator=gen).cuda() for _ in range(TABLES)]

    def atomics():
        out = torch.zeros(distinct, DIM, device="cuda")
        for g, slot in zip(grads, slots):
            out.index_add_(0, slot, g)
        return out

    def runs():
        out = torch.zeros(distinct, DIM, device="cuda")
        sum_runs(grads, order, run, out)
        return out

    difference = (atomics() - runs()).abs().max().item()
    rows = []
    for name, fn in (("index_add_ per table", atomics), ("run sums", runs)):
        ms = triton.testing.do_bench(fn, return_mode="median")
        rows.append({"method": name, "ms": ms, "lanes": TABLES * FULL["ids"], "distinct": distinct, "dim": DIM})
    print(f"{TABLES} tables x {FULL['ids']:,} power-law ids (alpha {ALPHA}), dim {DIM}: {distinct:,} distinct; "
          f"largest difference {difference:.2g}")
    print(f"{'method':<24}{'ms':>8}")
    for r in rows:
        print(f"{r['method']:<24}{r['ms']:>8.3f}")
    write_results("run_sums", rows, args.out, gpus=args.gpus, largest_difference=difference)


if __name__ == "__main__":
    main()
