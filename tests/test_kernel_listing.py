"""benchmarks/kernel_listing.py: a kernel compiled for Hopper on a CPU, its resources and its
loops' instructions; the alignment a launch would give changes its loads as it does there."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def scale_rows(x_ptr, y_ptr, rows, stride, BLOCK: tl.constexpr):
    """y = 2 x over rows of BLOCK entries, `stride` entries apart."""
    for r in range(tl.program_id(0), rows, tl.num_programs(0)):
        c = tl.arange(0, BLOCK)
        tl.store(y_ptr + r * stride + c, tl.load(x_ptr + r * stride + c) * 2)


def not_a_kernel():
    pass
'''


def listing(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The tool run on the test's kernel file (the interpreter off: its kernels do not compile)."""
    source = tmp_path / "probe.py"
    source.write_text(KERNEL)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_listing.py"), *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)


def test_a_kernel_compiles_for_hopper_without_a_gpu_and_its_loop_is_listed(tmp_path):
    found = {}
    for name, aligned in (("plain", []), ("aligned", ["--aligned", "stride"])):
        out = tmp_path / f"{name}.json"
        run = listing(tmp_path, f"{tmp_path / 'probe.py'}:scale_rows", "--constexprs", "BLOCK=256", "--json", str(out), *aligned)
        assert run.returncode == 0, run.stderr
        found[name] = json.loads(out.read_text())
        assert "scale_rows" in run.stdout and "loop 0x" in run.stdout
    plain, aligned = found["plain"], found["aligned"]
    assert plain["registers"] > 0 and plain["stack_bytes"] == 0 and plain["arch"] == 90
    # one loop over the rows, its loads and stores inside it
    (loop,) = plain["loops"]
    assert loop["kinds"]["LDG"] >= 1 and loop["kinds"]["STG"] >= 1
    # a stride the compiler knows to be a multiple of 16 lets each thread load its two
    # 16-bit entries as one 32-bit word: half the loads
    assert aligned["loops"][0]["kinds"]["LDG"] * 2 == loop["kinds"]["LDG"]


def test_what_is_not_a_kernel_or_not_an_argument_is_refused_by_name(tmp_path):
    run = listing(tmp_path, f"{tmp_path / 'probe.py'}:not_a_kernel")
    assert run.returncode != 0 and "not a Triton kernel" in run.stderr
    run = listing(tmp_path, f"{tmp_path / 'probe.py'}:scale_rows", "--constexprs", "BLOCK=256", "--types", "z_ptr=*fp32")
    assert run.returncode != 0 and "no argument ['z_ptr']" in run.stderr
    run = listing(tmp_path, f"{tmp_path / 'probe.py'}:scale_rows", "--constexprs", "BLOCK")
    assert run.returncode != 0 and "NAME=VALUE" in run.stderr
