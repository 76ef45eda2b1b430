"""The sampled softmax cross-entropy (kernels.sampled_softmax) beside the PyTorch formula it
replaced in the training loss (masked logits, the positive prepended, F.cross_entropy), on
one GPU.

    python benchmarks/sampled_softmax.py [--out FILE]

Shapes: the `hstu-long` preset's step (about 49,000 positions against 16,384 shared
negatives, D 512) and a paper-size one (20,000 positions, 512 negatives, D 50), fp32 inputs
under bf16 autocast as training runs them, about one row in a hundred meeting its own id
among the negatives. Forward alone and forward + backward (the gradients of q, the
negatives and the positives' logits), the median of triton.testing.do_bench (CUDA
events), and the forward + backward's peak of memory allocated beyond its inputs.
TFLOP/s counts the products: 2·P·N·D forward, 3x that forward + backward.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402

from kernels.sampled_softmax import sampled_softmax_cross_entropy  # noqa: E402

SHAPES = [(49_152, 16_384, 512), (20_000, 512, 50)]  # (positions, negatives, dim)
ID_RANGE_PER_NEGATIVE = 100  # ids drawn from this many values per negative: a hit in about one row in a hundred


def plain(q, keys, positive, key_ids, row_ids):
    """The loss as training computed it before the op: masked logits, concatenated, float32 cross-entropy."""
    logits = (q @ keys.T).masked_fill(key_ids[None, :] == row_ids[:, None], float("-inf"))
    full = torch.cat([positive[:, None], logits], 1)
    return F.cross_entropy(full, torch.zeros(q.shape[0], dtype=torch.long, device=q.device))


def bench(fn, inputs, backward: bool) -> tuple[float, float]:
    """(median ms, peak MiB allocated beyond the inputs) of fn's loss, with its backward."""
    q, keys, positive = (x.detach().requires_grad_(backward) for x in inputs[:3])
    ids = inputs[3:]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(q, keys, positive, *ids)
        if backward:
            loss.backward()
            q.grad = keys.grad = positive.grad = None

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return do_bench(step, warmup=10, rep=100, return_mode="median"), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sampled_softmax_<device>.json)")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    impls = {
        "triton": lambda *a: sampled_softmax_cross_entropy(*a, backend="triton"),
        "reference": lambda *a: sampled_softmax_cross_entropy(*a, backend="reference"),
        "plain formula": plain,
    }
    rows = []
    for P, N, D in SHAPES:
        ids = N * ID_RANGE_PER_NEGATIVE
        inputs = (
            10 * F.normalize(torch.randn(P, D, device="cuda", generator=gen), dim=-1),
            F.normalize(torch.randn(N, D, device="cuda", generator=gen), dim=-1),
            10 * torch.rand(P, device="cuda", generator=gen),
            torch.randperm(ids, device="cuda", generator=gen)[:N],
            torch.randint(0, ids, (P,), device="cuda", generator=gen),
        )
        flops = 2 * P * N * D
        for name, fn in impls.items():
            (f, _), (fb, peak) = bench(fn, inputs, False), bench(fn, inputs, True)
            rows.append({
                "shape": f"P{P} N{N} D{D}", "impl": name, "forward_ms": f, "forward_backward_ms": fb,
                "forward_backward_peak_MiB": peak, "forward_TFLOPs": flops / f / 1e9,
                "forward_backward_TFLOPs": 3 * flops / fb / 1e9,
            })
            print(rows[-1], flush=True)
    print(f"\n{'shape':<22}{'impl':<15}{'fwd ms':>9}{'f+b ms':>9}{'f+b peak MiB':>14}{'f+b TFLOP/s':>13}")
    for r in rows:
        print(f"{r['shape']:<22}{r['impl']:<15}{r['forward_ms']:>9.3f}{r['forward_backward_ms']:>9.3f}"
              f"{r['forward_backward_peak_MiB']:>14.0f}{r['forward_backward_TFLOPs']:>13.1f}")
    write_results("sampled_softmax", rows, args.out)


if __name__ == "__main__":
    main()
