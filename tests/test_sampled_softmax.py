"""The sampled softmax's Triton row kernel against its PyTorch twin (under Triton's
interpreter on a CPU, at full size on a GPU), and the op on the twin against the plain
formula (masked logits, the positive prepended, F.cross_entropy) with its gradients."""
import pytest
import torch
import torch.nn.functional as F

from kernels.sampled_softmax import reference, sampled_softmax_cross_entropy, triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 16 if DEVICE == "cuda" else 1  # rows and negatives on a GPU
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# Triton's interpreter has no bfloat16: float16 stands in for the 16-bit logits on a CPU
SIXTEEN_BIT = torch.bfloat16 if DEVICE == "cuda" else torch.float16

pytestmark = pytest.mark.usefixtures("poisoned_memory")  # (conftest.py)


def case(seed, rows, negatives, dim, dtype, ids=None):
    """(q, keys, positive, key_ids, row_ids): logits of a few units, as at temperature 0.1;
    ids drawn from `ids` values (default: as many as the rows and negatives), so that
    rows meet their own id among the negatives, some of them several times."""
    gen = torch.Generator().manual_seed(seed)
    q = (3 * F.normalize(torch.randn(rows, dim, generator=gen), dim=-1)).to(DEVICE, dtype)
    keys = F.normalize(torch.randn(negatives, dim, generator=gen), dim=-1).to(DEVICE, dtype)
    positive = (3 * torch.rand(rows, generator=gen)).to(DEVICE, dtype)
    ids = ids or max(1, (rows + negatives) // 2)
    key_ids = torch.randint(0, ids, (negatives,), generator=gen).to(DEVICE)
    row_ids = torch.randint(0, ids, (rows,), generator=gen).to(DEVICE)
    return q, keys, positive, key_ids, row_ids


def loss_and_grads(backend_or_fn, q, keys, positive, key_ids, row_ids, upstream=1.0):
    q, keys, positive = (x.detach().clone().requires_grad_(True) for x in (q, keys, positive))
    if callable(backend_or_fn):
        loss = backend_or_fn(q, keys, positive, key_ids, row_ids)
    else:
        loss = sampled_softmax_cross_entropy(q, keys, positive, key_ids, row_ids, backend=backend_or_fn)
    if q.shape[0]:
        (loss * upstream).backward()
    return loss, q.grad, keys.grad, positive.grad


def plain(q, keys, positive, key_ids, row_ids):
    """The formula as a loss over materialized float32 logits."""
    logits = (q @ keys.T).float().masked_fill(key_ids[None, :] == row_ids[:, None], float("-inf"))
    full = torch.cat([positive.float()[:, None], logits], dim=1)
    return F.cross_entropy(full, torch.zeros(q.shape[0], dtype=torch.long, device=q.device))


@pytest.mark.parametrize("rows,negatives,dim", [(1, 1, 4), (37, 77, 25), (130, 1500, 50), (5, 0, 8), (5, 1100, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, SIXTEEN_BIT])
@pytest.mark.parametrize("whole_row", [triton_kernels.MAX_WHOLE_ROW, 256], ids=["whole_rows", "wide_rows_past_256"])
def test_the_row_kernel_matches_the_twin(rows, negatives, dim, dtype, whole_row, monkeypatch):
    """The kernels' losses, positives' gradients and logits' gradients against the twin's,
    on the same logits: rows held whole (many a program, one), and with the whole-row
    limit lowered, rows walked in one block and several (1,100 and 1,500 columns; the last
    program's rows partly past the last row). Rows meet their own id among the negatives,
    some of them several times."""
    monkeypatch.setattr(triton_kernels, "MAX_WHOLE_ROW", whole_row)
    q, keys, positive, key_ids, row_ids = case(rows + negatives, rows * SCALE, negatives * SCALE, dim, dtype)
    logits = q @ keys.T
    got_logits, want_logits = logits.clone(), logits.clone()
    got = triton_kernels.softmax_rows(got_logits, positive, key_ids, row_ids)
    want = reference.softmax_rows(want_logits, positive, key_ids, row_ids)
    tol = TOLERANCE[dtype]
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)
    assert got_logits.dtype == dtype
    torch.testing.assert_close(got_logits.float(), want_logits.float(), atol=tol, rtol=tol)
    hits = key_ids[None, :] == row_ids[:, None]
    assert bool(hits.any()) or not negatives  # the case has accidental hits
    assert not got_logits[hits].any()  # a negative that is the row's own id has no gradient


@pytest.mark.parametrize("negatives", [0, 1, 100, 3000])
def test_the_id_bitmap_matches_the_twin(negatives):
    """The bitmap of the negatives' ids (a bit each, set by atomic ors) against the twin's,
    ids drawn from the whole int64 range with its extremes, repeated ids among them."""
    gen = torch.Generator().manual_seed(negatives)
    extremes = torch.tensor([torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max, -1, 0, 1, 1 << 32])
    drawn = torch.randint(torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max, (negatives,), generator=gen)
    key_ids = torch.cat([extremes, drawn, drawn[: negatives // 3]])[torch.randperm(negatives + 6 + negatives // 3, generator=gen)][:negatives]
    shift = triton_kernels.id_bitmap_shift(negatives)
    got = triton_kernels.id_bitmap(key_ids.to(DEVICE), shift)
    want = reference.id_bitmap(key_ids.to(DEVICE), shift)
    assert got.dtype == want.dtype == torch.int32 and got.shape == want.shape
    assert got.numel() * 32 >= max(triton_kernels.MIN_ID_BITS, negatives * triton_kernels.ID_BITS_PER_NEGATIVE)
    assert torch.equal(got, want)
    set_bits = sum(bin(w & 0xFFFFFFFF).count("1") for w in want.tolist())
    assert 0.9 * len(set(key_ids.tolist())) <= set_bits <= len(set(key_ids.tolist()))  # few ids share a bit


def test_the_id_bitmap_has_bounded_size():
    sizes = {n: 1 << (64 - triton_kernels.id_bitmap_shift(n)) for n in (0, 1, 16, 16384, 1 << 21, 1 << 30)}
    assert sizes[0] == sizes[1] == sizes[16] == triton_kernels.MIN_ID_BITS
    assert sizes[16384] == 16384 * triton_kernels.ID_BITS_PER_NEGATIVE
    assert sizes[1 << 21] == sizes[1 << 30] == triton_kernels.MAX_ID_BITS


@pytest.mark.parametrize("dtype", [torch.float32, SIXTEEN_BIT])
def test_the_op_on_the_kernel_matches_the_twin_forward_and_backward(dtype):
    inputs = case(7, 70 * SCALE, 300 * SCALE, 40, dtype)
    upstream = torch.tensor(2.5, device=DEVICE)
    got = loss_and_grads("triton", *inputs, upstream=upstream)
    want = loss_and_grads("reference", *inputs, upstream=upstream)
    tol = TOLERANCE[dtype]
    for g, w in zip(got, want):
        assert g.isfinite().all()
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)
    assert got[1].dtype == got[2].dtype == got[3].dtype == dtype


def test_no_rows_give_nan_and_no_negatives_give_zero_loss():
    for backend in ("reference", "triton"):
        q, keys, positive, key_ids, row_ids = case(1, 0, 5, 8, torch.float32)
        assert sampled_softmax_cross_entropy(q, keys, positive, key_ids, row_ids, backend=backend).isnan()
        q, keys, positive, key_ids, row_ids = case(1, 4, 0, 8, torch.float32)
        loss, dq, dkeys, dpositive = loss_and_grads(backend, q, keys, positive, key_ids, row_ids)
        assert loss.item() == 0.0 and not dq.any() and not dpositive.any() and dkeys.shape == (0, 8)


def test_the_kernel_under_autocast_multiplies_in_its_dtype():
    """float32 inputs under 16-bit autocast: the kernel's op equals the twin's under
    autocast, with float32 gradients, and differs from float32 products."""
    inputs = case(3, 50 * SCALE, 90 * SCALE, 24, torch.float32)
    with torch.autocast(DEVICE, dtype=SIXTEEN_BIT):
        got = loss_and_grads("triton", *inputs)
        want = loss_and_grads("reference", *inputs)
    exact = loss_and_grads("reference", *inputs)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    assert not torch.equal(want[0], exact[0])  # autocast did change the products


@pytest.mark.parametrize("rows,negatives", [(1, 1), (9, 6), (24, 40)])
def test_the_twin_is_the_plain_cross_entropy_with_its_gradients(rows, negatives):
    q, keys, positive, key_ids, row_ids = (
        x.cpu().double() if x.is_floating_point() else x.cpu() for x in case(rows, rows, negatives, 5, torch.float32, ids=6)
    )
    got = loss_and_grads("reference", q, keys, positive, key_ids, row_ids, upstream=1.7)
    want = loss_and_grads(plain, q, keys, positive, key_ids, row_ids, upstream=1.7)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-6, rtol=1e-6)
    assert torch.autograd.gradcheck(
        lambda a, b, c: sampled_softmax_cross_entropy(a, b, c, key_ids, row_ids, backend="reference").double(),
        tuple(x.detach().clone().requires_grad_(True) for x in (q, keys, positive)),
    )


def test_bad_shapes_and_ids_are_refused():
    q, keys, positive, key_ids, row_ids = case(1, 4, 6, 8, torch.float32)
    with pytest.raises(ValueError, match="q and keys"):
        sampled_softmax_cross_entropy(q, keys[:, :3], positive, key_ids, row_ids)
    with pytest.raises(ValueError, match="positive"):
        sampled_softmax_cross_entropy(q, keys, positive[:2], key_ids, row_ids)
    with pytest.raises(ValueError, match="key_ids"):
        sampled_softmax_cross_entropy(q, keys, positive, key_ids.int(), row_ids)
    with pytest.raises(ValueError, match="row_ids"):
        sampled_softmax_cross_entropy(q, keys, positive, key_ids, row_ids[:1])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padding_rows_after_real_rows_change_neither_the_loss_nor_the_gradients(backend):
    """real_rows: the loss of a batch with padding rows after its real ones (any values,
    here large ones whose logits would dominate a mean) is that of the real rows alone, the
    real rows' and the keys' gradients are theirs, and the padding rows get zero gradients."""
    real, pad = 23 * SCALE, 9 * SCALE
    q, keys, positive, key_ids, row_ids = case(5, real + pad, 60 * SCALE, 16, torch.float32)
    q[real:] *= 40
    upstream = torch.tensor(1.5, device=DEVICE)
    unpadded = loss_and_grads(backend, q[:real], keys, positive[:real], key_ids, row_ids[:real], upstream=upstream)
    padded = loss_and_grads(
        lambda *a: sampled_softmax_cross_entropy(*a, backend=backend, real_rows=real), q, keys, positive, key_ids, row_ids,
        upstream=upstream,
    )
    torch.testing.assert_close(padded[0], unpadded[0])
    torch.testing.assert_close(padded[1][:real], unpadded[1])
    torch.testing.assert_close(padded[2], unpadded[2])
    torch.testing.assert_close(padded[3][:real], unpadded[3])
    assert not padded[1][real:].any() and not padded[3][real:].any()
    everything = sampled_softmax_cross_entropy(q, keys, positive, key_ids, row_ids, backend=backend)
    assert not torch.allclose(everything, unpadded[0])  # the padding rows would have counted
    assert sampled_softmax_cross_entropy(q, keys, positive, key_ids, row_ids, backend=backend, real_rows=0).isnan()
    with pytest.raises(ValueError, match="real_rows"):
        sampled_softmax_cross_entropy(q, keys, positive, key_ids, row_ids, backend=backend, real_rows=real + pad + 1)
