"""Jagged ops and embedding pooling: the Triton kernels beside their PyTorch twins and
torch's own ops, on one GPU.

    python benchmarks/jagged_ops.py [--out FILE]

Pooling: 65,536 bags of 10 ids each (uniform over a table of 2^20 rows, float32), dim 128,
sum and mean, forward alone and forward + backward (the weight's gradient), beside
F.embedding_bag. GB/s counts the rows the forward reads (ids x dim x 4 bytes). Jagged ops:
jagged_to_padded, padded_to_jagged, jagged_concat and jagged_split of 4,096 sequences of
lengths uniform in [0, 400], dim 256, bf16; GB/s counts bytes read plus bytes written.
Times: the median of triton.testing.do_bench (CUDA events, L2 flushed between runs).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402

from kernels import jagged, pooling  # noqa: E402

BAGS, IDS_PER_BAG, TABLE_ROWS, POOL_DIM = 65_536, 10, 1 << 20, 128
SEQUENCES, LONGEST, JAGGED_DIM = 4096, 400, 256


def timed(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def pooling_rows() -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(TABLE_ROWS, POOL_DIM, device="cuda", generator=gen)
    indices = torch.randint(0, TABLE_ROWS, (BAGS * IDS_PER_BAG,), device="cuda", generator=gen)
    offsets = torch.arange(0, BAGS + 1, device="cuda", dtype=torch.int64) * IDS_PER_BAG
    read = indices.numel() * POOL_DIM * weight.element_size()
    rows = []
    for mode in ("sum", "mean"):
        runs = {
            "triton": lambda: pooling.pool(weight, indices, offsets, mode, backend="triton"),
            "reference": lambda: pooling.pool(weight, indices, offsets, mode, backend="reference"),
            "F.embedding_bag": lambda: F.embedding_bag(indices, weight, offsets[:-1], mode=mode),
        }
        want = runs["reference"]()
        for name, fn in runs.items():
            assert torch.allclose(fn(), want, atol=1e-4), name
            ms = timed(fn)
            w = weight.detach().requires_grad_(True)
            grad = torch.randn(BAGS, POOL_DIM, device="cuda", generator=gen)
            if name == "F.embedding_bag":
                step = lambda: torch.autograd.grad(F.embedding_bag(indices, w, offsets[:-1], mode=mode), w, grad)  # noqa: E731
            else:
                step = lambda: torch.autograd.grad(pooling.pool(w, indices, offsets, mode, backend=name), w, grad)  # noqa: E731
            rows.append({
                "op": f"pool {mode}", "impl": name, "shape": f"{BAGS} bags x {IDS_PER_BAG} ids, D {POOL_DIM}",
                "forward_ms": ms, "forward_read_GBps": read / ms / 1e6, "forward_backward_ms": timed(step),
            })
    return rows


def jagged_rows() -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = torch.randint(0, LONGEST + 1, (SEQUENCES,), device="cuda", generator=gen)
    offsets = jagged.offsets_from_lengths(lengths)
    total = int(offsets[-1])
    values = torch.randn(total, JAGGED_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    short = torch.randint(0, 17, (SEQUENCES,), device="cuda", generator=gen)
    short_offsets = jagged.offsets_from_lengths(short)
    extra = torch.randn(int(short_offsets[-1]), JAGGED_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    joined, _ = jagged.jagged_concat(values, offsets, extra, short_offsets)
    padded = jagged.jagged_to_padded(values, offsets, LONGEST)
    row_bytes = JAGGED_DIM * values.element_size()
    cases = {
        "jagged_to_padded": (lambda b: jagged.jagged_to_padded(values, offsets, LONGEST, backend=b), (total + padded.shape[0] * LONGEST) * row_bytes),
        "padded_to_jagged": (lambda b: jagged.padded_to_jagged(padded, offsets, total, backend=b), 2 * total * row_bytes),
        "jagged_concat": (lambda b: jagged.jagged_concat(values, offsets, extra, short_offsets, backend=b), 2 * joined.shape[0] * row_bytes),
        "jagged_split": (lambda b: jagged.jagged_split(joined, offsets, short_offsets, total, backend=b), 2 * joined.shape[0] * row_bytes),
    }
    rows = []
    for op, (fn, moved) in cases.items():
        for impl in ("triton", "reference"):
            ms = timed(lambda: fn(impl))
            rows.append({"op": op, "impl": impl, "shape": f"{SEQUENCES} seqs, len U[0, {LONGEST}], D {JAGGED_DIM} bf16", "ms": ms, "GBps": moved / ms / 1e6})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default benchmarks/results/jagged_ops_<device>.json)")
    args = p.parse_args()
    rows = pooling_rows() + jagged_rows()
    print(f"{'op':18} {'impl':16} {'fwd ms':>8} {'GB/s':>7} {'fwd+bwd ms':>10}")
    for r in rows:
        print(
            f"{r['op']:18} {r['impl']:16} {r.get('forward_ms', r.get('ms')):8.3f} "
            f"{r.get('forward_read_GBps', r.get('GBps')):7.0f} {r.get('forward_backward_ms', float('nan')):10.3f}"
        )
    write_results("jagged_ops", rows, args.out)


if __name__ == "__main__":
    main()
