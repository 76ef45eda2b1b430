"""What a Triton kernel compiles to for an NVIDIA GPU, on a machine without one: its
registers, stack (spilled) bytes and shared memory, and each loop of its SASS with the
instructions in it by kind. For kernel work between GPU leases: whether a change spills,
vectorizes its loads, or adds waits and barriers to a loop, seen before a lease times it.

    python benchmarks/kernel_listing.py kernels.norm_mul_dropout.triton_kernels._norm_mul_dropout_backward_kernel \\
        --constexprs DROPOUT=True BLOCK_R=4 BLOCK_D=512 --warps 8
    python benchmarks/kernel_listing.py path/to/file.py:kernel_name --types x_ptr=*fp32 ...

The kernel is MODULE.ATTRIBUTE or FILE.py:NAME (a jitted function, or one wrapped by
triton.autotune). --types NAME=TYPE sets any runtime argument's type (Triton's signature
strings: *bf16, *fp32, i32, i64, fp32, ...); without one, an argument whose name ends in
_ptr is a pointer to --pointer-dtype and the rest are i32. --constexprs NAME=VALUE sets
the constexprs (ints, floats, True, False). Pointers, and the integers named by
--aligned, get the divisibility-by-16 attribute a launch gives 16-byte aligned tensors and
integers that are multiples of 16: without it the compiler cannot prove a load aligned,
and the listing shows scalar loads and spills that the launched kernel does not have.

A loop is the range from a backward branch's target to the branch; nested loops are
listed each, outer ones holding the inner ones' instructions. Needs the ptxas and
cuobjdump that Triton's wheels carry (triton/backends/nvidia/bin). Prints a table;
--json writes it.
"""
import argparse
import importlib
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ALIGNMENT = 16  # bytes, and the integer divisibility Triton specializes launches on
MIN_LOOP_INSTRUCTIONS = 8  # shorter backward branches are waits spinning on a barrier
WARP_SIZE = 32
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# the kinds of instruction a listing counts first: the products, the special functions,
# memory by space, local memory (spills), barriers and the asynchronous copies' waits
KEY_KINDS = ("HGMMA", "HMMA", "MUFU", "LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDL", "STL", "BAR", "UTMALDG",
             "UTMASTG", "SYNCS", "WARPGROUP", "DEPBAR")


def load_kernel(spec: str):
    """The jitted function that spec (MODULE.ATTRIBUTE or FILE.py:NAME) names, unwrapped
    from triton.autotune."""
    if ":" in spec:
        path, name = spec.rsplit(":", 1)
        module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module_name, name = spec.rsplit(".", 1)
        module = importlib.import_module(module_name)
    kernel = getattr(module, name)
    while not isinstance(kernel, triton.runtime.JITFunction) and hasattr(kernel, "fn"):
        kernel = kernel.fn
    if not isinstance(kernel, triton.runtime.JITFunction):
        raise TypeError(f"{spec} is not a Triton kernel (set TRITON_INTERPRET=0: the interpreter's kernels do not compile)")
    return kernel


def parse_value(text: str):
    """A constexpr's value from the command line."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise ValueError(f"a constexpr must be an int, a float, True or False: {text!r}")


def compile_kernel(
    kernel, types: dict[str, str], constexprs: dict, aligned: set[str], arch: int = 90, num_warps: int = 4,
    num_stages: int = 3, pointer_dtype: str = "bf16",
):
    """The kernel compiled for sm_{arch} (Triton's CompiledKernel), without a GPU."""
    params = kernel.params
    unknown = (set(types) | set(constexprs) | aligned) - {p.name for p in params}
    if unknown:
        raise ValueError(f"{kernel.__name__} has no argument {sorted(unknown)}")
    signature, attrs = {}, {}
    for i, p in enumerate(params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            continue
        kind = types.get(p.name, f"*{pointer_dtype}" if p.name.endswith("_ptr") else "i32")
        signature[p.name] = kind
        if kind.startswith("*") or p.name in aligned:
            attrs[(i,)] = [["tt.divisibility", ALIGNMENT]]
    source = ASTSource(kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, WARP_SIZE), options={"num_warps": num_warps, "num_stages": num_stages})


def _tool(name: str, *args: str) -> str:
    return subprocess.run([str(TOOLS / name), *args], capture_output=True, text=True, check=True).stdout


def listing(compiled) -> dict:
    """{registers, stack_bytes, shared_bytes, instructions, loops}: the kernel's resources
    (cuobjdump -res-usage) and its SASS's loops, each {start, end, instructions, kinds}."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = _tool("cuobjdump", "-res-usage", str(cubin))
        sass = _tool("cuobjdump", "-sass", str(cubin))
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    instructions = sass_instructions(sass)
    return {
        "registers": registers, "stack_bytes": stack, "shared_bytes": compiled.metadata.shared,
        "instructions": len(instructions), "loops": loops(instructions),
    }


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction without its predicate) of each line of cuobjdump's SASS."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    return out


def kind(instruction: str) -> str:
    """An instruction's opcode without its modifiers: HGMMA of HGMMA.64x64x16.F32.BF16."""
    return instruction.split()[0].split(".")[0]


def loops(instructions: list[tuple[int, str]]) -> list[dict]:
    """Each backward branch's range of at least MIN_LOOP_INSTRUCTIONS instructions, with
    its instructions counted by kind, by start."""
    found = []
    for at, text in instructions:
        m = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= at:
            continue
        start = int(m.group(1), 16)
        body = [t for a, t in instructions if start <= a <= at]
        if len(body) >= MIN_LOOP_INSTRUCTIONS:
            found.append({"start": start, "end": at, "instructions": len(body), "kinds": dict(Counter(kind(t) for t in body))})
    return sorted(found, key=lambda loop: (loop["start"], -loop["end"]))


def print_listing(name: str, result: dict) -> None:
    print(f"{name}: {result['registers']} registers, {result['stack_bytes']} bytes of stack (spills), "
          f"{result['shared_bytes']} bytes of shared memory, {result['instructions']} instructions")
    for loop in result["loops"]:
        kinds = loop["kinds"]
        first = [f"{k} {kinds[k]}" for k in KEY_KINDS if k in kinds]
        rest = sorted(((n, k) for k, n in kinds.items() if k not in KEY_KINDS), reverse=True)[:6]
        print(f"  loop {loop['start']:#x}-{loop['end']:#x}: {loop['instructions']} instructions: "
              + ", ".join(first + [f"{k} {n}" for n, k in rest]))


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{what} takes NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", help="MODULE.ATTRIBUTE or FILE.py:NAME")
    p.add_argument("--types", nargs="*", default=[], metavar="NAME=TYPE")
    p.add_argument("--constexprs", nargs="*", default=[], metavar="NAME=VALUE")
    p.add_argument("--aligned", nargs="*", default=[], metavar="NAME", help="integer arguments that are multiples of 16")
    p.add_argument("--pointer-dtype", default="bf16")
    p.add_argument("--arch", type=int, default=90, help="the compute capability as an integer (90: Hopper)")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--json", help="write the listing here")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the project's kernels by module name)
    kernel = load_kernel(args.kernel)
    constexprs = {k: parse_value(v) for k, v in _pairs(args.constexprs, "--constexprs").items()}
    compiled = compile_kernel(kernel, _pairs(args.types, "--types"), constexprs, set(args.aligned), args.arch, args.warps,
                              args.stages, args.pointer_dtype)
    result = {"kernel": args.kernel, "arch": args.arch, "warps": args.warps, "stages": args.stages,
              "constexprs": constexprs, **listing(compiled)}
    print_listing(args.kernel, result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
