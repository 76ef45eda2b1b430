"""The host's time in a cuBLAS call at a row count it has not seen, against one it has.

    python benchmarks/matmul_shapes.py [--calls 12] [--multiples 1 8 128 1024]

cuBLAS picks a kernel per matrix shape and keeps its pick, so the first call at a new
shape costs the host that choice. A jagged batch's row count is new nearly every step;
the eager training step pads it to a multiple of HSTUConfig.row_multiple
(lightning_modules/row_padding.py). For each op of an `hstu-long` block's shapes
(D 512, 2,048 projected columns, 16,384 sampled negatives, bf16) and each multiple, the
table gives the host's time in the call (launch included, the GPU idle before it) at
`--calls` row counts drawn at random in [ROWS_LOW, ROWS_HIGH) and rounded up to the
multiple: the median and the longest first call at a count, and the median of a second
call at the same count. Prints a table and writes JSON to benchmarks/results/.
"""
import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402

WIDTH, PROJECTED, NEGATIVES = 512, 2048, 16384  # hstu-long: model width, a block's U V Q K columns, sampled negatives
ROWS_LOW, ROWS_HIGH = 24576, 65536  # hstu-long's batch of 16 sequences of 2,048 to 4,096 rows
WARM_ROWS = 40000  # a count every op is called at first (cuBLAS's handle and workspace made)


def ops(device: torch.device) -> dict:
    """name -> a call on (x (rows, WIDTH), g (rows, PROJECTED)): a block's projection
    forward and its two backward products, and the sampled softmax's logits."""
    w = torch.randn(PROJECTED, WIDTH, device=device, dtype=torch.bfloat16)
    b = torch.randn(PROJECTED, device=device, dtype=torch.bfloat16)
    negatives = torch.randn(NEGATIVES, WIDTH, device=device, dtype=torch.bfloat16)
    return {
        "x @ W.T + b (addmm)": lambda x, g: torch.nn.functional.linear(x, w, b),
        "x @ W.T (mm)": lambda x, g: x @ w.t(),
        "dX = dY @ W": lambda x, g: g @ w,
        "dW = dY.T @ x (rows inner)": lambda x, g: g.t() @ x,
        "logits = x @ negatives.T": lambda x, g: x @ negatives.t(),
    }


def host_ms(call, rows: int, device: torch.device) -> float:
    """The host's milliseconds in one call at `rows` rows, the GPU idle before it."""
    x = torch.randn(rows, WIDTH, device=device, dtype=torch.bfloat16)
    g = torch.randn(rows, PROJECTED, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    call(x, g)
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    return took * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=12, help="row counts drawn per op and multiple")
    p.add_argument("--multiples", type=int, nargs="+", default=[1, 8, 128, 1024])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("matmul_shapes.py times cuBLAS: it needs a CUDA device")
    device, rng, rows = torch.device("cuda"), random.Random(args.seed), []
    print(f"{'multiple':>9}  {'op':<28}{'new: median ms':>16}{'new: longest':>14}{'seen: median':>14}", flush=True)
    for multiple in args.multiples:
        for name, call in ops(device).items():
            host_ms(call, WARM_ROWS, device)
            new, seen = [], []
            for _ in range(args.calls):
                count = -(-rng.randrange(ROWS_LOW, ROWS_HIGH) // multiple) * multiple
                new.append(host_ms(call, count, device))
                seen.append(host_ms(call, count, device))
            row = {"multiple": multiple, "op": name, "calls": args.calls, "new_median_ms": sorted(new)[len(new) // 2],
                   "new_longest_ms": max(new), "seen_median_ms": sorted(seen)[len(seen) // 2]}
            rows.append(row)
            print(f"{multiple:>9}  {name:<28}{row['new_median_ms']:>16.3f}{row['new_longest_ms']:>14.3f}{row['seen_median_ms']:>14.3f}",
                  flush=True)
    write_results("matmul_shapes", rows, args.out, rows_low=ROWS_LOW, rows_high=ROWS_HIGH)


if __name__ == "__main__":
    main()
