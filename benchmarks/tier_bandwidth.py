"""Rows moved between a tiered table's device tier and its host tier (pinned host memory
worked in place by GPU kernels) by the exchange kernel that tiers.swap_in runs: host rows
up only, device rows down only, or both at once, in GB/s over PCIe.

    python benchmarks/tier_bandwidth.py [--rows 1000000] [--moves 150000] [--dim 128] [--orders] [--tiles]

One table of `rows` rows in each tier (Adam rows: the embedding and two moments), and
`moves` lanes that each move a row between random slots; the median of 20 calls timed by
CUDA events. GB/s counts the rows' bytes that cross the link (a lane moving both ways
counts two rows).

The lanes' host slots are random ("random"). `--orders` adds rows that give the lanes
their host slots in ascending order (the device slots stay random): "sorted" sorts the
rows going down and those coming up each on its own (a bound: a lane's two host rows
are not paired so in a table), "by up" and "by down" order the lanes by one of their
host slots, "two passes" moves the rows down in the order of their host slots, then
those coming up in theirs.

`--tiles` times the exchange kernel's tilings (lanes per program, warps, columns at a
time: TILINGS) on both ways at once "by up", the order the prefetch gives its lanes,
each twice; the kernel's own is tier_kernels.TIER_TILING.
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402

from kernels.dynamic_embedding.probe_kernels import TableStack  # noqa: E402
from kernels.dynamic_embedding.tier_kernels import TIER_TILING, exchange_tier_rows  # noqa: E402
from kernels.dynamic_embedding.triton_table import TritonHashTable  # noqa: E402

CALLS = 20
TILINGS = [(b, w, d) for b in (8, 16, 32, 64) for w in (4, 8) for d in (128, 256, 512)]


def time_ms(fn) -> float:
    times = []
    for _ in range(CALLS + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1 << 20)
    p.add_argument("--moves", type=int, default=150_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--orders", action="store_true", help="also the lanes in orders of their host slots")
    p.add_argument("--tiles", action="store_true", help="also the exchange kernel's tilings, both ways by up")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/tier_bandwidth_<gpu>.json)")
    args = p.parse_args()
    row_dim = 3 * args.dim
    tables = [TritonHashTable(row_dim, capacity=args.rows, max_capacity=args.rows, bucket_size=128, device="cuda", host_rows=host)
              for host in (False, True)]
    stack = TableStack(torch.stack([t.descriptor() for t in tables]), tables)
    gen = torch.Generator(device="cuda").manual_seed(0)
    perm = torch.randperm(args.rows, device="cuda", generator=gen)
    host_perm = torch.randperm(args.rows, device="cuda", generator=gen)
    slots = perm[: args.moves]
    down, up = host_perm[: args.moves], host_perm[args.moves : 2 * args.moves]
    none = torch.full_like(slots, -1)
    tids = torch.zeros(args.moves, dtype=torch.int32, device="cuda")
    row_bytes = tables[0].row_stride * 4
    by_up, by_down = up.argsort(), down.argsort()
    down_sorted, up_sorted = down[by_down], up[by_up]
    by_up_lanes = [(slots[by_up], down[by_up], up_sorted)]  # both ways, the lanes by their up slot
    cases = [("up", "random", [(slots, none, up)]), ("down", "random", [(slots, down, none)]),
             ("both", "random", [(slots, down, up)])]
    if args.orders:
        cases += [
            ("up", "sorted", [(slots, none, up_sorted)]), ("down", "sorted", [(slots, down_sorted, none)]),
            ("both", "sorted", [(slots, down_sorted, up_sorted)]),
            ("both", "by up", by_up_lanes),
            ("both", "by down", [(slots[by_down], down_sorted, up[by_down])]),
            ("both", "two passes", [(slots[by_down], down_sorted, none), (slots[by_up], none, up_sorted)]),
        ]
    runs = [(name, order, passes, TIER_TILING) for name, order, passes in cases]
    if args.tiles:
        runs += [("both", "by up", by_up_lanes, tiling) for _ in range(2) for tiling in TILINGS]
    rows = []
    for name, order, passes, tiling in runs:
        def run():
            for s, d, u in passes:
                exchange_tier_rows(stack, tids, s, d, u, 1, row_dim, tiles=tiling)
        ms = time_ms(run)
        crossing = 2 if name == "both" else 1
        gbs = crossing * args.moves * row_bytes / ms / 1e6
        rows.append({"moves": name, "order": order, "host_rows": args.rows, "lanes": args.moves, "row_bytes": row_bytes,
                     "block": tiling[0], "warps": tiling[1], "dim_block": tiling[2], "ms": ms, "gb_per_s": gbs})
        print(f"{name:<6}{order:<12}{args.moves:>10} rows of {row_bytes} B  tiles {tiling}  {ms:8.3f} ms  {gbs:7.1f} GB/s")
    write_results("tier_bandwidth", rows, args.out)


if __name__ == "__main__":
    main()
