import pytest
import torch
import triton
import triton.language as tl

from kernels import launch as launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x * a + SHIFT, mask=offs < n)


def test_launch_matches_the_plain_launch_across_alignments_sizes_and_constants():
    """Launches that differ in what Triton specializes on (a misaligned view, n of 1 or a
    multiple of 16, constants) each get a kernel compiled for them; on a GPU, later ones
    reuse it, and a changed float argument compiles nothing new."""
    base = torch.arange(200, dtype=torch.float32, device=DEVICE)
    cases = [(base, 200, 2.0, 1), (base[1:], 199, 2.0, 1), (base, 1, 3.0, 1), (base[3:], 16, 0.5, 7), (base, 200, 2.0, 1)]
    for _ in range(2):
        for x, n, a, shift in cases:
            y = torch.full((n + 1,), -1.0, device=DEVICE)
            launches.launch(_axpy_kernel, (launches.cdiv(n, 64),), x, y, n, a, BLOCK=64, SHIFT=shift)
            assert torch.equal(y[:n], x[:n] * a + shift) and y[n] == -1.0
    if DEVICE == "cuda":
        def compiled() -> int:
            return sum(len(launches.prepare(_axpy_kernel, 4, BLOCK=64, SHIFT=s).compiled) for s in (1, 7))
        assert compiled() == 4  # the first and last cases share one
        for lr in (0.1, 0.2, 0.3):
            launches.launch(_axpy_kernel, (4,), base, torch.empty_like(base), 200, lr, BLOCK=64, SHIFT=1)
        assert compiled() == 4


@pytest.mark.skipif(DEVICE != "cuda", reason="the direct launch runs on CUDA devices only")
def test_launch_refuses_a_tensor_off_the_gpu_after_compiling():
    """A launch whose key is compiled already still refuses a CPU tensor (it is not handed to
    the kernel as an address)."""
    x = torch.arange(64, dtype=torch.float32, device=DEVICE)
    launches.launch(_axpy_kernel, (1,), x, torch.empty_like(x), 64, 2.0, BLOCK=64, SHIFT=1)
    with pytest.raises(ValueError, match="cpu tensor"):
        launches.launch(_axpy_kernel, (1,), x.cpu(), torch.empty_like(x), 64, 2.0, BLOCK=64, SHIFT=1)


def test_launch_takes_runtime_arguments_by_name():
    """Runtime parameters named in the keyword arguments are bound per launch, as positional
    ones are: a second value of `a` is not served the first's kernel constants."""
    x = torch.arange(64, dtype=torch.float32, device=DEVICE)
    for a in (2.0, -3.0):
        y = torch.empty_like(x)
        launches.launch(_axpy_kernel, (1,), x, y, n=64, a=a, BLOCK=64, SHIFT=1)
        assert torch.equal(y, x * a + 1)


@pytest.mark.skipif(DEVICE != "cuda", reason="the direct launch runs on CUDA devices only")
def test_prepare_refuses_runtime_parameters_among_the_constants():
    """A Prepared launch binds what follows its first arguments once, so a runtime parameter
    there (it would be frozen at its first value) is an error that names the kernel."""
    with pytest.raises(TypeError, match="_axpy_kernel: parameters after the first 2 must be constexprs"):
        launches.prepare(_axpy_kernel, 2, n=64, a=2.0, BLOCK=64, SHIFT=1)
    assert launches.prepare(_axpy_kernel, 4, BLOCK=64, SHIFT=1).rest == (64, 1)


def test_host_grid_arithmetic_matches_tritons():
    """cdiv and next_power_of_2, which grids use on the host, agree with Triton's."""
    for n in range(0, 300):
        for d in (1, 3, 8, 64, 256):
            assert launches.cdiv(n, d) == triton.cdiv(n, d)
        if n:
            assert launches.next_power_of_2(n) == triton.next_power_of_2(n)
    assert launches.cdiv(2**40 + 1, 2**20) == 2**20 + 1 and launches.next_power_of_2(2**40 + 1) == 2**41


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bfloat16, torch.uint8])
def test_aligned_empty_gives_separate_tensors_each_starting_aligned(dtype):
    """Views of one allocation whose alignment does not follow n: a kernel handed any of
    them, for any n, is compiled for an aligned pointer."""
    for n in range(0, 11):
        parts = launches.aligned_empty(3, n, dtype, DEVICE)
        assert len(parts) == 3 and all(p.shape == (n,) and p.dtype == dtype and p.is_contiguous() for p in parts)
        assert all(p.data_ptr() % launches.ALIGN_BYTES == 0 for p in parts)
        for i, p in enumerate(parts):  # no two overlap
            p.fill_(i + 1)
        assert all(bool((p == i + 1).all()) for i, p in enumerate(parts))
