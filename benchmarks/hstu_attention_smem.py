"""Shared memory each tuning configuration of the HSTU attention kernels needs, per head dim
and GPU architecture, without a GPU: Triton compiles the kernels for the target on the CPU
and reports the bytes a program takes.

    python benchmarks/hstu_attention_smem.py [--arch 90] [--head-dims 64 128 256] [--out FILE]

A configuration whose need is above the architecture's limit per block (LIMITS) fails to
load there: the autotuner skips it, and where none of the forward's paired tilings fits,
hstu_attention runs a head a program. bf16 inputs, head dims equal for q, k and v.
"""
import argparse
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_listing import compile_kernel  # noqa: E402
from benchmarks.results_path import write_results  # noqa: E402
from kernels.autotune import config_label  # noqa: E402
from kernels.hstu_attention import attention_kernels as ak, score_grads, triton_kernels as tk  # noqa: E402

# the most shared memory a block may take (bytes), by compute capability
LIMITS = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
POINTERS = {"offsets_ptr": "*i64", "timestamps_ptr": "*i64", "targets_ptr": "*i64", "thresholds_ptr": "*fp64", "ext_ptr": "*fp64"}
INTS = ["ext_blocks", "heads", "max_seq_len", "num_buckets", "context_len", "length_class"]


def signature(kernel) -> dict:
    """Triton types of a kernel's runtime parameters (bf16 tensors, float32 tables)."""
    types = {}
    for name in kernel.arg_names:
        if name in POINTERS:
            types[name] = POINTERS[name]
        elif name.endswith("_ptr"):
            types[name] = "*bf16" if name[0] in "qkvdo" or name == "biases_ptr" else "*fp32"
        elif name in INTS:
            types[name] = "i32"
        elif name == "scale":
            types[name] = "fp32"
    return types


def shared_bytes(kernel, config, arch: int, constants: dict) -> int:
    compiled = compile_kernel(
        kernel, signature(kernel), {**constants, **config.kwargs}, set(), arch, config.num_warps, config.num_stages,
    )
    return compiled.metadata.shared


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, choices=sorted(LIMITS))
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/hstu_attention_smem_sm<arch>.json)")
    args = p.parse_args()
    limit = LIMITS[args.arch]
    by_descriptor = args.arch >= 10 * tk.DESCRIPTOR_STORE_MIN_CAPABILITY  # as the backward stores dS there
    rows = []
    print(f"sm_{args.arch}: at most {limit} bytes of shared memory a block")
    for dim in args.head_dims:
        attention = dict(HAS_TARGETS=False, TWO_BUCKET_TILES=True, DQK=dim, DV=dim, BLOCK_DQK=dim, BLOCK_DV=dim)
        # (the forward and the dK dV kernel reading the pair biases' buffer, as they do
        # from PAIR_BIAS_TILES_MIN_LENGTH on unless HSTU_PAIR_BIAS_TILES=0; else computing
        # them per tile)
        tiles = dict(BIAS_TILES=tk.PAIR_BIAS_TILES, BY_DESCRIPTOR=by_descriptor, TWO_BUCKET_TILES=not tk.PAIR_BIAS_TILES)
        # (K and V, Q and dO through descriptors of a head's rows where the forward and the
        # dK dV kernel read them so: with the prepass's biases, on GPUs with descriptors,
        # from triton_kernels.ROWS_BY_DESCRIPTOR_MIN_HEAD_DIM; the forward then runs one
        # head a program, and two heads only with pointer rows)
        tiles["ROWS_BY_DESCRIPTOR"] = (
            tk.PAIR_BIAS_TILES and tk.ROWS_BY_DESCRIPTOR and by_descriptor and dim >= tk.ROWS_BY_DESCRIPTOR_MIN_HEAD_DIM
        )
        kernels = [
            ("forward, one head", ak._forward_kernel, ak.CONFIGS, dict(attention, PAIR=False, **tiles)),
            ("forward, two heads", ak._forward_kernel, ak.CONFIGS, dict(attention, PAIR=True, **dict(tiles, ROWS_BY_DESCRIPTOR=False))),
            ("backward dK dV", ak._backward_kv_kernel, ak.CONFIGS,
             dict(attention, STORE_DS=False, BY_DESCRIPTOR=False, BIAS_TILES=False, ROWS_BY_DESCRIPTOR=False)),
            ("backward dK dV, dS stored", ak._backward_kv_kernel, ak.CONFIGS, dict(attention, STORE_DS=True, **tiles)),
            ("backward dQ", ak._backward_q_kernel, ak.CONFIGS, dict(attention, BIAS_GRADS=True)),
            ("dQ from stored dS", score_grads._dq_kernel, score_grads.DQ_CONFIGS, dict(HAS_TARGETS=False, DQK=dim, BLOCK_DQK=dim)),
        ]
        for label, kernel, configs, constants in kernels:
            for config in configs:
                need = shared_bytes(kernel, config, args.arch, constants)
                tiling = config_label(config)
                rows.append({"arch": args.arch, "head_dim": dim, "kernel": label, "tiling": tiling, "shared_bytes": need, "fits": need <= limit})
                print(f"{dim:>4}  {label:<27}{tiling:<28}{need:>9}  {'fits' if need <= limit else 'too large'}", flush=True)
    write_results("hstu_attention_smem", rows, args.out or str(Path(__file__).parent / "results" / f"hstu_attention_smem_sm{args.arch}.json"),
                  device="cpu", arch=args.arch, limit=limit, triton=triton.__version__)


if __name__ == "__main__":
    main()
