"""The full softmax cross-entropy (kernels.softmax_cross_entropy): the Triton kernels beside
their PyTorch twin and the plain F.cross_entropy over the whole logits, on one GPU.

    python benchmarks/softmax_cross_entropy.py [--out FILE]

Shapes: the `hstu` preset's step on ML-1M (about 20,000 positions against its 3,706 items,
D 50) and a larger catalog (32,768 positions, 16,384 items, D 128), fp32 inputs under bf16
autocast as training runs them. Forward alone and forward + backward (both inputs'
gradients). TFLOP/s counts the products: 2·P·M·D for the forward, 3x that for forward +
backward (the kernels recompute the logits once more in each backward kernel, which is
not counted). Times: the median of triton.testing.do_bench (CUDA events).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402

from kernels.softmax_cross_entropy import softmax_cross_entropy  # noqa: E402

SHAPES = [(20_000, 3_706, 50), (32_768, 16_384, 128)]  # (positions, keys, dim)


def plain(q, keys, target, backend=None):
    return F.cross_entropy(q @ keys.T, target)


def bench(fn, q, keys, target, backward: bool) -> float:
    q, keys = q.detach().requires_grad_(backward), keys.detach().requires_grad_(backward)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(q, keys, target)
        if backward:
            loss.backward()
            q.grad = keys.grad = None

    return do_bench(step, warmup=10, rep=100, return_mode="median")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/softmax_cross_entropy_<device>.json)")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    impls = {
        "triton": lambda q, k, t: softmax_cross_entropy(q, k, t, backend="triton"),
        "reference": lambda q, k, t: softmax_cross_entropy(q, k, t, backend="reference"),
        "F.cross_entropy": plain,
    }
    rows = []
    for P, M, D in SHAPES:
        q = 10 * F.normalize(torch.randn(P, D, device="cuda", generator=gen), dim=-1)
        keys = F.normalize(torch.randn(M, D, device="cuda", generator=gen), dim=-1)
        target = torch.randint(0, M, (P,), device="cuda", generator=gen)
        flops = 2 * P * M * D
        for name, fn in impls.items():
            f, fb = bench(fn, q, keys, target, False), bench(fn, q, keys, target, True)
            rows.append({
                "shape": f"P{P} M{M} D{D}", "impl": name, "forward_ms": f, "forward_backward_ms": fb,
                "forward_TFLOPs": flops / f / 1e9, "forward_backward_TFLOPs": 3 * flops / fb / 1e9,
            })
    print(f"\n{'shape':<22}{'impl':<17}{'fwd ms':>9}{'f+b ms':>9}{'fwd TFLOP/s':>13}{'f+b TFLOP/s':>13}")
    for r in rows:
        print(f"{r['shape']:<22}{r['impl']:<17}{r['forward_ms']:>9.3f}{r['forward_backward_ms']:>9.3f}"
              f"{r['forward_TFLOPs']:>13.1f}{r['forward_backward_TFLOPs']:>13.1f}")
    write_results("softmax_cross_entropy", rows, args.out)


if __name__ == "__main__":
    main()
