"""Dropout(LayerNorm(x) ⊙ u), HSTU's block output before its projection: the Triton kernels
(kernels.norm_mul_dropout) beside torch's ops as the blocks ran them before, eager and
through torch.compile, on one GPU.

    python benchmarks/norm_mul_dropout.py [--out FILE]

bf16 x and u (the attention's output and U under autocast), dropout 0.2, the norm in
float32: 25,600 rows of width 50 (`hstu`, batch 128 of up to 200 items) and 49,152 of
width 512 (`hstu-long`, batch 16 of about 3,072 items). "torch" is
Dropout(LayerNorm(x.float()) · u), "compiled" the same through torch.compile (the
`--compile-blocks` path). Forward alone and forward + backward (x's, u's, weight's and
bias's gradients); GB/s counts the forward's bytes read and written (x, u and the output).
"graph" is the forward + backward captured in a CUDA graph and replayed: the GPU's time
alone. Times: the median of triton.testing.do_bench (CUDA events). Without dropout each
implementation is checked against torch's first.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_replay import replayed  # noqa: E402
from benchmarks.layer_norm import print_table, timed  # noqa: E402
from benchmarks.results_path import write_results  # noqa: E402

from kernels.norm_mul_dropout import norm_mul_dropout  # noqa: E402

SHAPES = {"hstu (B128 N200)": (25_600, 50), "hstu-long (B16 N4096)": (49_152, 512)}
EPS = 1e-5
DROPOUT = 0.2


def torch_ops(x, u, weight, bias, p):
    return F.dropout(F.layer_norm(x.float(), (x.shape[-1],), weight, bias, EPS) * u, p)


IMPLS = {
    "triton": lambda x, u, w, b, p: norm_mul_dropout(x, u, w, b, EPS, p, backend="triton"),
    "torch": torch_ops,
    "compiled": torch.compile(torch_ops, dynamic=False),
}


def rows_for(name: str, rows: int, dim: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, u = (torch.randn(rows, dim, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    weight, bias = torch.randn(dim, device="cuda", generator=gen), torch.randn(dim, device="cuda", generator=gen)
    grad = torch.randn(rows, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    want = torch_ops(x, u, weight, bias, 0.0)
    out = []
    for impl, fn in IMPLS.items():
        torch.testing.assert_close(fn(x, u, weight, bias, 0.0).float(), want, atol=2e-2, rtol=2e-2)
        leaves = [t.detach().requires_grad_(True) for t in (x, u, weight, bias)]
        upstream = grad.to(fn(x, u, weight, bias, DROPOUT).dtype)  # (torch's ops return float32)

        def forward_backward():
            return torch.autograd.grad(fn(*leaves, DROPOUT), leaves, upstream)

        forward = timed(lambda: fn(x, u, weight, bias, DROPOUT))
        both = timed(forward_backward)
        graphed = timed(replayed(forward_backward))
        written = upstream.element_size()
        out.append({"shape": name, "rows": rows, "dim": dim, "impl": impl, "forward_ms": forward,
                    "forward_GBps": x.numel() * (2 * x.element_size() + written) / forward / 1e6,
                    "forward_backward_ms": both, "forward_backward_graph_ms": graphed})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default benchmarks/results/norm_mul_dropout_<device>.json)")
    args = p.parse_args()
    results = [r for name, (rows, dim) in SHAPES.items() for r in rows_for(name, rows, dim)]
    print_table(f"Dropout(LayerNorm(x) · u), bf16 inputs, p {DROPOUT}", results)
    write_results("norm_mul_dropout", results, args.out, dropout=DROPOUT)


if __name__ == "__main__":
    main()
