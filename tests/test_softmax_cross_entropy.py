"""The full softmax cross-entropy's Triton kernels against the PyTorch twin (under Triton's
interpreter on a CPU, at full size on a GPU), and the twin against the plain formula with
its gradients."""
import pytest
import torch
import torch.nn.functional as F

from kernels.autotune import config_blocks, tuned_to
from kernels.softmax_cross_entropy import reference, softmax_cross_entropy, triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 32 if DEVICE == "cuda" else 1  # rows and keys on a GPU
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# Triton's interpreter computes bfloat16 dots wrongly: bfloat16 runs on a GPU only, float16
# stands in for the 16-bit products on a CPU
SIXTEEN_BIT = torch.bfloat16 if DEVICE == "cuda" else torch.float16


pytestmark = pytest.mark.usefixtures("poisoned_memory")  # (conftest.py)


def case(seed, rows, keys, dim, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(rows, dim, generator=gen)).to(DEVICE, dtype)  # logits of a few units, as at temperature 0.1
    k = F.normalize(torch.randn(keys, dim, generator=gen), dim=-1).to(DEVICE, dtype)
    target = torch.randint(0, keys, (rows,), generator=gen).to(DEVICE)
    return q, k, target


def loss_and_grads(backend, q, k, target, upstream):
    q, k = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    loss = softmax_cross_entropy(q, k, target, backend=backend)
    if q.shape[0]:
        (loss * upstream).backward()
    return loss, q.grad, k.grad


# rows: none, one, fewer and more than a block; keys: one, odd, many blocks; dims: padded
# to the least dot size, odd, several column chunks
@pytest.mark.parametrize("rows,keys,dim", [(0, 5, 8), (1, 1, 4), (37, 77, 25), (130, 200, 50), (20, 33, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, SIXTEEN_BIT])
def test_the_kernels_match_the_twin_forward_and_backward(rows, keys, dim, dtype):
    q, k, target = case(rows + dim, rows * SCALE, keys * SCALE, dim, dtype)
    upstream = torch.tensor(2.5, device=DEVICE)
    got = loss_and_grads("triton", q, k, target, upstream)
    want = loss_and_grads("reference", q, k, target, upstream)
    if not rows:
        assert got[0].isnan() and want[0].isnan()
        return
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=tol, rtol=tol)
    for g, w in zip(got[1:], want[1:]):
        assert g.dtype == dtype and g.isfinite().all()
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("config", triton_kernels.CONFIGS, ids=config_blocks)
def test_every_tuning_configuration_matches_the_twin(config):
    """Each tiling of the three kernels (the interpreter runs its blocks, not its warps and
    stages): rows and keys over several of its largest blocks, a partial one at the end."""
    q, k, target = case(11, 300 * SCALE, 290 * SCALE, 40, torch.float32)
    upstream = torch.tensor(1.5, device=DEVICE)
    tuned = (triton_kernels._forward, triton_kernels._backward_q, triton_kernels._backward_keys)
    with tuned_to(*((t, config) for t in tuned)):
        got = loss_and_grads("triton", q, k, target, upstream)
        assert all(t.chosen for t in tuned), "a kernel did not run"
    want = loss_and_grads("reference", q, k, target, upstream)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_the_kernels_under_autocast_multiply_in_its_dtype():
    """fp32 inputs under 16-bit autocast: loss and gradients as the twin's under autocast
    (16-bit products) and fp32 gradients; the twin rounds its logits to the product
    dtype, the kernels keep them in fp32, hence a 16-bit tolerance."""
    q, k, target = case(3, 50 * SCALE, 70 * SCALE, 24, torch.float32)
    upstream = torch.tensor(1.0, device=DEVICE)
    with torch.autocast(DEVICE, dtype=SIXTEEN_BIT):
        got = loss_and_grads("triton", q, k, target, upstream)
        want = loss_and_grads("reference", q, k, target, upstream)
    plain = loss_and_grads("reference", q, k, target, upstream)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    assert not torch.equal(want[0], plain[0])  # autocast did change the products


@pytest.mark.parametrize("rows", [0, 1, 63, 64, 200])
def test_the_twin_is_the_plain_cross_entropy_with_its_gradients(rows, monkeypatch):
    monkeypatch.setattr(reference, "BLOCK_LOGITS_CPU", 64 * 37)  # blocks of 64 rows: more and fewer than one, and none
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 37, (rows,), generator=g)
    loss = reference.softmax_cross_entropy(q, k, target)
    q2, k2 = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
    plain = F.cross_entropy(q2 @ k2.T, target)
    torch.testing.assert_close(loss, plain, equal_nan=True)
    if rows:
        (3.0 * loss).backward()
        (3.0 * plain).backward()
        torch.testing.assert_close(q.grad, q2.grad)
        torch.testing.assert_close(k.grad, k2.grad)
        few = q[:5].detach().requires_grad_(True), k.detach().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda a, b: reference.softmax_cross_entropy(a, b, target[:5]), few)


def test_bad_shapes_are_refused():
    q, k, target = case(0, 4, 6, 8, torch.float32)
    with pytest.raises(ValueError, match="q and keys"):
        softmax_cross_entropy(q, k[:, :4], target)
    with pytest.raises(ValueError, match="target"):
        softmax_cross_entropy(q, k, target[:3])
    with pytest.raises(ValueError, match="no keys"):
        softmax_cross_entropy(q, k[:0], target)
