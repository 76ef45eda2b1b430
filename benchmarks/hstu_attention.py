"""HSTU attention: the Triton kernels beside the PyTorch twin, forward and forward +
backward, on one GPU.

    python benchmarks/hstu_attention.py [--out FILE]
    python benchmarks/hstu_attention.py --against DIR [--rounds 2] [--shapes 0 1]

--against DIR times the Triton kernels of another checkout (its `kernels` package, say
`git archive REV | tar -x -C DIR`) beside this one's on the same inputs instead of the twin,
the two alternated for --rounds rounds (the best of each kept), and prints how far the two
outputs and gradients lie apart.

Shapes (bf16, lengths uniform in [N/2, N], max_seq_len N): B32 N4096 H4 D128, B128 N200
H2 D64, and the paper presets' attention (B128 N200: H1 D50; H2 D25). TFLOP/s counts the
causal half of QKᵀ and AV: forward H · Σ n² · (dqk + dv), forward + backward 3.5x that.
"fwd+bwd, fixed biases" leaves the bias tables without gradients (no atomic adds).
"f+b graph" is the Triton forward + backward captured in a CUDA graph and replayed: the
GPU's time alone, as the training step's graphs see it (the other columns include the
host's time where the GPU waits for it, as at B128 N200).
Times: the median of triton.testing.do_bench (CUDA events); the twin where it fits in memory.
The JSON's meta also lists the configuration the autotuner chose for each kernel launch.
"""
import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.graph_replay import replayed  # noqa: E402
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


def other_attention(root: Path):
    """hstu_attention of the `kernels` package of the checkout at root, imported under
    another name (its relative imports stay inside it)."""
    name = "kernels_against"
    spec = importlib.util.spec_from_file_location(
        name, root / "kernels" / "__init__.py", submodule_search_locations=[str(root / "kernels")]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.hstu_attention").hstu_attention


def pair_bias_tiles(package: str) -> dict:
    """Whether a kernels package's attention reads its biases from the prepass's tiles
    (HSTU_PAIR_BIAS_TILES), from which max_seq_len on (off for a checkout from before the
    switch; from length 0 for one from before the length floor), and whether the backward
    reads the forward's (HSTU_KEEP_PAIR_BIASES; off before that switch)."""
    kernels = importlib.import_module(f"{package}.hstu_attention.triton_kernels")
    return {"on": getattr(kernels, "PAIR_BIAS_TILES", False), "min_length": getattr(kernels, "PAIR_BIAS_TILES_MIN_LENGTH", 0),
            "kept_for_the_backward": getattr(kernels, "KEEP_PAIR_BIASES", False)}


def tuned_choices(package: str) -> dict:
    """The configuration the autotuner chose for each launch of a kernels package's
    attention kernels ("kernels", or other_attention's), by the launch's tuning key and
    constants: what a row's figures were timed with."""
    launches = {}
    attention = ("_forward", "_backward_kv", "_backward_q")
    # (in triton_kernels for a checkout from before attention_kernels.py)
    for module, names in (("attention_kernels", attention), ("triton_kernels", attention), ("score_grads", ("_dq", "_bias_grads"))):
        try:
            kernels = importlib.import_module(f"{package}.hstu_attention.{module}")
        except ImportError:  # (a checkout from before that module)
            continue
        for name in names:
            launches[name] = {f"{key[0]} {dict(key[2])}": str(config) for key, config in getattr(kernels, name).chosen.items()}
    return launches


def bench(fn) -> float | None:
    try:
        return do_bench(fn, warmup=10, rep=100, return_mode="median")
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def time_impl(attention, label, backend, q, k, v, offsets, timestamps, position_bias, time_bias, n, grad) -> dict:
    """Forward, forward + backward, forward + backward with fixed biases, and forward +
    backward replayed from a CUDA graph (Triton only) of one implementation, ms (None where
    it does not fit or is not timed)."""
    fixed = (position_bias.detach(), time_bias.detach())
    leaves = (q, k, v, position_bias, time_bias)

    def forward(biases=(position_bias, time_bias)):
        return attention(q, k, v, offsets, timestamps, *biases, n, backend=backend)

    if backend == "reference" and n > 1024:
        with torch.no_grad():
            fwd = bench(forward)
        step = step_fixed = None  # the twin's autograd keeps (H, n, n) tensors per sequence
    else:
        fwd = bench(lambda: forward())
        step = bench(lambda: forward().backward(grad))
        step_fixed = bench(lambda: forward(fixed).backward(grad))
    graphed = bench(replayed(lambda: torch.autograd.grad(forward(), leaves, grad))) if backend == "triton" else None
    return {"impl": label, "forward_ms": fwd, "forward_backward_ms": step, "forward_backward_fixed_bias_ms": step_fixed,
            "forward_backward_graph_ms": graphed}


def fastest(runs: list[dict], forward_flops: float) -> dict:
    """One implementation's rows of several rounds as one: the least time of each kind."""
    row = {"impl": runs[0]["impl"]}
    for key in ("forward_ms", "forward_backward_ms", "forward_backward_fixed_bias_ms", "forward_backward_graph_ms"):
        times = [r[key] for r in runs if r[key] is not None]
        row[key] = min(times) if times else None
    row["forward_TFLOPs"] = forward_flops / row["forward_ms"] / 1e9 if row["forward_ms"] else None
    for key in ("forward_backward", "forward_backward_graph"):
        ms = row[f"{key}_ms"]
        row[f"{key}_TFLOPs"] = 3.5 * forward_flops / ms / 1e9 if ms else None
    return row


def gradients(attention, q, k, v, offsets, timestamps, position_bias, time_bias, n, grad) -> list[torch.Tensor]:
    """The output and the gradients of q, k, v and both biases, float32."""
    tensors = [q, k, v, position_bias, time_bias]
    out = attention(q, k, v, offsets, timestamps, position_bias, time_bias, n, backend="triton")
    return [out.detach().float()] + [g.float() for g in torch.autograd.grad(out, tensors, grad)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default benchmarks/results/hstu_attention_<device>.json)")
    p.add_argument("--against", type=Path, help="a checkout whose Triton kernels are timed beside these (no twin)")
    p.add_argument("--rounds", type=int, default=2, help="with --against: rounds of the two, alternated (the best kept)")
    p.add_argument("--shapes", type=int, nargs="+", metavar="I", help="only these of SHAPES, by index (default: all)")
    args = p.parse_args()
    shapes = [SHAPES[i] for i in args.shapes] if args.shapes else SHAPES
    if args.against:
        impls = [(hstu_attention, "triton", "triton"), (other_attention(args.against.resolve()), f"triton ({args.against})", "triton")]
    else:
        impls = [(hstu_attention, "triton", "triton"), (hstu_attention, "reference", "reference")]
    rounds = args.rounds if args.against else 1
    rows = []
    for batch, n, heads, dim in shapes:
        (q, k, v), offsets, timestamps, position_bias, time_bias, squares = inputs(batch, n, heads, dim)
        tensors = (q, k, v, offsets, timestamps, position_bias, time_bias, n)
        grad = torch.randn_like(v)
        timed = {}  # label: its rows, one per round
        for _ in range(rounds):
            for attention, label, backend in impls:
                timed.setdefault(label, []).append(time_impl(attention, label, backend, *tensors, grad))
        best = {label: fastest(runs, heads * squares * 2 * dim) for label, runs in timed.items()}
        if args.against:
            ours, theirs = (gradients(attention, *tensors, grad) for attention, _, _ in impls)
            apart = {name: float((a - b).abs().max()) for name, a, b in zip(("out", "dq", "dk", "dv", "d_position", "d_time"), ours, theirs)}
            print(f"B{batch} N{n} H{heads} D{dim}: largest differences {apart}")
            best[impls[1][1]]["largest_differences"] = apart
        rows += [{"shape": f"B{batch} N{n} H{heads} D{dim} bf16", **row} for row in best.values()]

    def fmt(x, spec):
        return format(x, spec) if x is not None else "-"

    print(f"{'shape':24} {'impl':22} {'fwd ms':>8} {'TFLOP/s':>8} {'f+b ms':>8} {'TFLOP/s':>8} {'f+b fixed':>9} {'f+b graph':>9} {'TFLOP/s':>8}")
    for r in rows:
        print(
            f"{r['shape']:24} {r['impl']:22} {fmt(r['forward_ms'], '8.3f')} {fmt(r['forward_TFLOPs'], '8.1f')} "
            f"{fmt(r['forward_backward_ms'], '8.3f')} {fmt(r['forward_backward_TFLOPs'], '8.1f')} {fmt(r['forward_backward_fixed_bias_ms'], '9.3f')} "
            f"{fmt(r['forward_backward_graph_ms'], '9.3f')} {fmt(r['forward_backward_graph_TFLOPs'], '8.1f')}"
        )
    packages = {"triton": "kernels"} | ({impls[1][1]: "kernels_against"} if args.against else {})
    write_results("hstu_attention", rows, args.out, configs={label: tuned_choices(p) for label, p in packages.items()},
                  pair_bias_tiles={label: pair_bias_tiles(p) for label, p in packages.items()})


if __name__ == "__main__":
    main()
