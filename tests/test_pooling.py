"""Embedding pooling's Triton kernels against the PyTorch twin (under Triton's interpreter
on a CPU), and the twin against a per-bag loop and torch's autograd."""
import pytest
import torch

from kernels import pooling
from kernels.autotune import config_blocks, tuned_to
from kernels.pooling import reference, triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 64 if DEVICE == "cuda" else 1  # bags per batch and table rows on a GPU


pytestmark = pytest.mark.usefixtures("poisoned_memory")  # (conftest.py)


def bags(gen, batch, longest, rows):
    lengths = torch.randint(0, longest + 1, (batch,), generator=gen)
    lengths[torch.rand(batch, generator=gen) < 0.2] = 0  # empty bags
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.randint(0, rows, (int(lengths.sum()),), generator=gen), offsets


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("batch,longest,rows,dim", [(0, 4, 5, 8), (1, 0, 3, 16), (7, 13, 6, 33), (40, 25, 300, 130)])
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pooling_matches_the_twin_forward_and_backward(batch, longest, rows, dim, mode, dtype):
    gen = torch.Generator().manual_seed(batch + dim)
    batch, rows = batch * SCALE, rows * SCALE
    indices, offsets = bags(gen, batch, longest, rows)
    indices, offsets = indices.to(DEVICE), offsets.to(DEVICE)
    storage = torch.randn(rows, dim + 5, generator=gen).to(DEVICE, dtype)
    weight = storage[:, :dim]  # rows with a stride past their width, as a table's
    got = pooling.pool(weight, indices, offsets, mode, backend="triton")
    want = pooling.pool(weight, indices, offsets, mode, backend="reference")
    assert got.shape == (batch, dim) and got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    upstream = torch.randn(batch, dim, generator=gen).to(DEVICE, dtype)
    grads = []
    for backend in ("triton", "reference"):
        w = weight.detach().clone().requires_grad_(True)
        pooling.pool(w, indices, offsets, mode, backend=backend).backward(upstream)
        grads.append(w.grad.float())
    assert torch.allclose(*grads, atol=TOLERANCE[dtype] * max(longest, 1), rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("config", triton_kernels.CONFIGS, ids=config_blocks)
def test_every_tuning_configuration_matches_the_twin(config):
    """Each tiling of the forward and backward kernels (the interpreter runs its blocks,
    not its warps): bags longer than its rows a step and rows wider than its columns."""
    gen = torch.Generator().manual_seed(3)
    rows, dim = 50 * SCALE, 300
    indices, offsets = bags(gen, 9 * SCALE, 70, rows)
    indices, offsets = indices.to(DEVICE), offsets.to(DEVICE)
    weight = torch.randn(rows, dim, generator=gen).to(DEVICE)
    upstream = torch.randn(9 * SCALE, dim, generator=gen).to(DEVICE)
    with tuned_to((triton_kernels._pool, config), (triton_kernels._pool_backward, config)):
        for mode in ("sum", "mean"):
            got = []
            for backend in ("triton", "reference"):
                w = weight.clone().requires_grad_(True)
                pooled = pooling.pool(w, indices, offsets, mode, backend=backend)
                pooled.backward(upstream)
                got.append((pooled.detach(), w.grad))
            assert triton_kernels._pool.best_config is config and triton_kernels._pool_backward.best_config is config
            (pooled, grad), (want, want_grad) = got
            assert torch.allclose(pooled, want, atol=1e-5, rtol=1e-5), mode
            assert torch.allclose(grad, want_grad, atol=1e-4, rtol=1e-5), mode


def test_the_twin_is_a_loop_over_bags_and_passes_gradcheck():
    gen = torch.Generator().manual_seed(0)
    indices, offsets = bags(gen, 9, 6, 7)
    weight = torch.randn(7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    for mode in ("sum", "mean"):
        pooled = reference.pool(weight, indices, offsets, mode)
        for b in range(9):
            rows = weight[indices[offsets[b] : offsets[b + 1]]]
            want = rows.sum(0) / (max(len(rows), 1) if mode == "mean" else 1)
            assert torch.allclose(pooled[b], want)
        assert torch.autograd.gradcheck(lambda w: reference.pool(w, indices, offsets, mode), (weight,))


def test_bad_input_is_refused_with_the_problem_named():
    weight, offsets = torch.zeros(4, 2), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="mode"):
        pooling.pool(weight, torch.tensor([0, 1]), offsets, "max")
    with pytest.raises(ValueError, match="indices"):
        pooling.pool(weight, torch.tensor([0, 1], dtype=torch.int32), offsets)
