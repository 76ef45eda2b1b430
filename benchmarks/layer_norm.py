"""Layer norm: the Triton kernels (kernels.layer_norm) beside torch's CUDA layer norm, at
the shapes the HSTU presets' blocks normalize, on one GPU.

    python benchmarks/layer_norm.py [--out FILE]

Float32 rows (autocast runs layer norms in float32): 25,600 rows of width 50 (`hstu` and
`hstu-large`, batch 128 of up to 200 items; both norms of a block are 50 wide) and 49,152
rows of width 512 (`hstu-long`, batch 16 of about 3,072 items). Forward alone and forward
+ backward (the input's, weight's and bias's gradients). GB/s counts the forward's bytes
read and written (x and y). "graph" is the forward + backward captured in a CUDA graph and
replayed: the GPU's time alone, as the training step's graph sees it (at width 50 the
plain forward + backward is bound by the host's launches). Times: the median of
triton.testing.do_bench (CUDA events, L2 flushed between runs). Each implementation is
checked against torch's first.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_replay import replayed  # noqa: E402
from benchmarks.results_path import write_results  # noqa: E402

from kernels.layer_norm import layer_norm  # noqa: E402

SHAPES = {"hstu, hstu-large (B128 N200)": (25_600, 50), "hstu-long (B16 N4096)": (49_152, 512)}
EPS = 1e-5


def timed(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def rows_for(name: str, rows: int, dim: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, dim, device="cuda", generator=gen)
    weight, bias = torch.randn(dim, device="cuda", generator=gen), torch.randn(dim, device="cuda", generator=gen)
    grad = torch.randn(rows, dim, device="cuda", generator=gen)
    impls = {
        "triton": lambda x, w, b: layer_norm(x, w, b, EPS, backend="triton"),
        "torch": lambda x, w, b: F.layer_norm(x, (dim,), w, b, EPS),
    }
    want = impls["torch"](x, weight, bias)
    out = []
    for impl, fn in impls.items():
        torch.testing.assert_close(fn(x, weight, bias), want, atol=1e-4, rtol=1e-4)
        leaves = [t.detach().requires_grad_(True) for t in (x, weight, bias)]

        def forward_backward():
            return torch.autograd.grad(fn(*leaves), leaves, grad)

        forward = timed(lambda: fn(x, weight, bias))
        both = timed(forward_backward)
        graphed = timed(replayed(forward_backward))
        out.append({"shape": name, "rows": rows, "dim": dim, "impl": impl, "forward_ms": forward,
                    "forward_GBps": 2 * x.numel() * x.element_size() / forward / 1e6, "forward_backward_ms": both,
                    "forward_backward_graph_ms": graphed})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default benchmarks/results/layer_norm_<device>.json)")
    args = p.parse_args()
    results = [r for name, (rows, dim) in SHAPES.items() for r in rows_for(name, rows, dim)]
    print_table("float32 layer norm", results)
    write_results("layer_norm", results, args.out)


def print_table(title: str, results: list[dict]) -> None:
    """A row-wise op's rows: forward ms and GB/s, forward + backward ms, replayed ms."""
    print(f"\n{torch.cuda.get_device_name()}: {title}")
    print(f"{'shape':30} {'impl':9} {'fwd ms':>8} {'GB/s':>7} {'fwd+bwd ms':>11} {'graph ms':>9}")
    for r in results:
        print(f"{r['shape']:30} {r['impl']:9} {r['forward_ms']:8.3f} {r['forward_GBps']:7.0f} {r['forward_backward_ms']:11.3f}"
              f" {r['forward_backward_graph_ms']:9.3f}")


if __name__ == "__main__":
    main()
