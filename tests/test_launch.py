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
            launches.launch(_axpy_kernel, (triton.cdiv(n, 64),), x, y, n, a, BLOCK=64, SHIFT=shift)
            assert torch.equal(y[:n], x[:n] * a + shift) and y[n] == -1.0
    if DEVICE == "cuda":
        ours = [k for k in launches._compiled if k[0] == id(_axpy_kernel)]
        assert len(ours) == 4  # the first and last cases share one
        for lr in (0.1, 0.2, 0.3):
            launches.launch(_axpy_kernel, (4,), base, torch.empty_like(base), 200, lr, BLOCK=64, SHIFT=1)
        assert len([k for k in launches._compiled if k[0] == id(_axpy_kernel)]) == 4


@pytest.mark.skipif(DEVICE != "cuda", reason="the direct launch runs on CUDA devices only")
def test_launch_refuses_a_tensor_off_the_gpu_after_compiling():
    """A launch whose key is compiled already still refuses a CPU tensor (it is not handed to
    the kernel as an address)."""
    x = torch.arange(64, dtype=torch.float32, device=DEVICE)
    launches.launch(_axpy_kernel, (1,), x, torch.empty_like(x), 64, 2.0, BLOCK=64, SHIFT=1)
    with pytest.raises(ValueError, match="cpu tensor"):
        launches.launch(_axpy_kernel, (1,), x.cpu(), torch.empty_like(x), 64, 2.0, BLOCK=64, SHIFT=1)
