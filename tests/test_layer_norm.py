"""Layer norm's Triton kernels against the PyTorch twin (under Triton's interpreter on a
CPU), forward and backward, and the twin against the formula and gradcheck."""
import pytest
import torch

from kernels import layer_norm as ln
from kernels.layer_norm import reference, triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 64 if DEVICE == "cuda" else 1  # rows on a GPU
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.usefixtures("poisoned_memory")  # (conftest.py)


# rows: none, one, fewer and more than a program's; widths: narrower and wider than a
# power of two (the paper presets' 50), one program's whole tile and past it
@pytest.mark.parametrize("rows,dim", [(0, 50), (1, 50), (7, 33), (131, 50), (70, 64), (9, 600), (3, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_layer_norm_matches_the_twin_forward_and_backward(rows, dim, dtype):
    gen = torch.Generator().manual_seed(rows + dim)
    rows = rows * SCALE
    x = (torch.randn(rows, dim, generator=gen) * 3 + 1).to(DEVICE, dtype)
    weight = (1 + torch.randn(dim, generator=gen) / 4).to(DEVICE, dtype)
    bias = torch.randn(dim, generator=gen).to(DEVICE, dtype)
    upstream = torch.randn(rows, dim, generator=gen).to(DEVICE, dtype)
    results = []
    for backend in ("triton", "reference"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias)]
        y = ln.layer_norm(*leaves, eps=1e-5, backend=backend)
        y.backward(upstream)
        results.append([y, *(t.grad for t in leaves)])
    tol = TOLERANCE[dtype]
    for got, want, name in zip(*results, ("y", "dx", "dweight", "dbias")):
        assert got.dtype == want.dtype == dtype, name
        scale = max(rows, 1) if name in ("dweight", "dbias") else 1  # sums over the rows
        torch.testing.assert_close(got.float(), want.float(), atol=tol * scale ** 0.5, rtol=tol, msg=name)


def test_leading_dimensions_and_the_statistics_kept():
    """x (..., D) keeps its shape, and the forward's statistics are each row's mean and
    reciprocal standard deviation."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 50, generator=gen).to(DEVICE)
    w, b = torch.randn(50, generator=gen).to(DEVICE), torch.randn(50, generator=gen).to(DEVICE)
    got = ln.layer_norm(x, w, b, backend="triton")
    assert got.shape == x.shape
    torch.testing.assert_close(got, ln.layer_norm(x, w, b, backend="reference"), atol=1e-5, rtol=1e-5)
    _, mean, rstd = triton_kernels.layer_norm_forward(x.reshape(12, 50), w, b, 1e-5)
    flat = x.reshape(12, 50)
    torch.testing.assert_close(mean, flat.mean(1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rstd, (flat.var(1, unbiased=False) + 1e-5).rsqrt(), atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"weight and bias must be \(8,\)"):
        ln.layer_norm(torch.zeros(2, 8), torch.ones(7), torch.zeros(7))
    with pytest.raises(ValueError, match="unknown layer norm backend"):
        ln.layer_norm(torch.zeros(2, 8), torch.ones(8), torch.zeros(8), backend="cuda")


def test_the_twin_is_the_formula_and_passes_gradcheck():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    mean, var = x.mean(1, keepdim=True), x.var(1, unbiased=False, keepdim=True)
    torch.testing.assert_close(reference.layer_norm(x, w, b, 1e-5), (x - mean) / (var + 1e-5).sqrt() * w + b)
    assert torch.autograd.gradcheck(lambda *t: reference.layer_norm(*t, 1e-5), (x, w, b))
