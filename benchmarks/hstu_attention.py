"""HSTU attention: the Triton kernels beside the PyTorch twin, forward and forward +
backward, on one GPU.

    python benchmarks/hstu_attention.py [--out FILE]

Shapes (bf16, lengths uniform in [N/2, N], max_seq_len N): B32 N4096 H4 D128, B128 N200
H2 D64, and the paper presets' attention (B128 N200: H1 D50; H2 D25). TFLOP/s counts the
causal half of QKᵀ and AV: forward H · Σ n² · (dqk + dv), forward + backward 3.5x that.
"fwd+bwd, fixed biases" leaves the bias tables without gradients (no atomic adds).
Times: the median of triton.testing.do_bench (CUDA events); the twin where it fits in memory.
"""
import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402

from kernels.hstu_attention import hstu_attention  # noqa: E402

SHAPES = [(32, 4096, 4, 128), (128, 200, 2, 64), (128, 200, 1, 50), (128, 200, 2, 25)]  # B, N, H, D
NUM_BUCKETS = 128


def inputs(batch, n, heads, dim, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(n // 2, n + 1, (batch,), device="cuda", generator=gen)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    total = int(offsets[-1])
    qkv = [torch.randn(total, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_(True) for _ in range(3)]
    timestamps = torch.cumsum(torch.randint(1, 100_000, (total,), device="cuda", generator=gen), 0)
    position_bias = (0.02 * torch.randn(2 * n - 1, device="cuda", generator=gen)).requires_grad_(True)
    time_bias = (0.02 * torch.randn(NUM_BUCKETS + 1, device="cuda", generator=gen)).requires_grad_(True)
    return qkv, offsets, timestamps, position_bias, time_bias, float((lengths.double() ** 2).sum())


def bench(fn) -> float | None:
    try:
        return do_bench(fn, warmup=10, rep=100, return_mode="median")
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default benchmarks/results/hstu_attention_<device>.json)")
    args = p.parse_args()
    rows = []
    for batch, n, heads, dim in SHAPES:
        (q, k, v), offsets, timestamps, position_bias, time_bias, squares = inputs(batch, n, heads, dim)
        forward_flops = heads * squares * 2 * dim
        grad = torch.randn_like(v)
        fixed = (position_bias.detach(), time_bias.detach())
        for impl in ("triton", "reference"):
            def forward(biases=(position_bias, time_bias)):
                return hstu_attention(q, k, v, offsets, timestamps, *biases, n, backend=impl)

            if impl == "reference" and n > 1024:
                with torch.no_grad():
                    fwd = bench(forward)
                step = None  # the twin's autograd keeps (H, n, n) tensors per sequence
                step_fixed = None
            else:
                fwd = bench(lambda: forward())
                step = bench(lambda: forward().backward(grad))
                step_fixed = bench(lambda: forward(fixed).backward(grad))
            row = {"shape": f"B{batch} N{n} H{heads} D{dim} bf16", "impl": impl, "forward_ms": fwd, "forward_backward_ms": step,
                   "forward_backward_fixed_bias_ms": step_fixed}
            row["forward_TFLOPs"] = forward_flops / fwd / 1e9 if fwd else None
            row["forward_backward_TFLOPs"] = 3.5 * forward_flops / step / 1e9 if step else None
            rows.append(row)

    def fmt(x, spec):
        return format(x, spec) if x is not None else "-"

    print(f"{'shape':24} {'impl':10} {'fwd ms':>8} {'TFLOP/s':>8} {'f+b ms':>8} {'TFLOP/s':>8} {'f+b fixed':>9}")
    for r in rows:
        print(
            f"{r['shape']:24} {r['impl']:10} {fmt(r['forward_ms'], '8.3f')} {fmt(r['forward_TFLOPs'], '8.1f')} "
            f"{fmt(r['forward_backward_ms'], '8.3f')} {fmt(r['forward_backward_TFLOPs'], '8.1f')} {fmt(r['forward_backward_fixed_bias_ms'], '9.3f')}"
        )
    write_results("hstu_attention", rows, args.out)


if __name__ == "__main__":
    main()
