"""The jagged ops' Triton kernels against their PyTorch twins (under Triton's interpreter
on a CPU), and the twins against torch's autograd."""
import pytest
import torch

from kernels import jagged
from kernels.jagged import reference

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 16 if DEVICE == "cuda" else 1  # sequences per batch on a GPU


pytestmark = pytest.mark.usefixtures("poisoned_memory")  # (conftest.py)


def random_lengths(gen: torch.Generator, batch: int, longest: int) -> torch.Tensor:
    lengths = torch.randint(0, longest + 1, (batch,), generator=gen)
    lengths[torch.rand(batch, generator=gen) < 0.2] = 0  # empty sequences
    return lengths


def jagged_case(gen, batch, longest, dim, dtype):
    lengths = random_lengths(gen, batch * SCALE, longest)
    offsets = reference.offsets_from_lengths(lengths)
    values = torch.randn(int(lengths.sum()), dim, generator=gen).to(dtype)
    return lengths.to(DEVICE), offsets.to(DEVICE), values.to(DEVICE)


def both(fn, *args, **kwargs):
    return fn(*args, backend="triton", **kwargs), fn(*args, backend="reference", **kwargs)


def grads_of(fn, inputs, upstream):
    """Gradients of sum(out * upstream) for the inputs, through fn(*inputs)."""
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(out, upstream)
    return [x.grad for x in inputs]


CASES = [(0, 7, 3), (1, 0, 5), (5, 9, 1), (13, 40, 33), (64, 20, 130), (6, 700, 64)]  # batch, longest, dim


@pytest.mark.parametrize("batch,longest,dim", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_offsets_and_padded_round_trip_match_the_twin(batch, longest, dim, dtype):
    gen = torch.Generator().manual_seed(batch * 1000 + dim)
    lengths, offsets, values = jagged_case(gen, batch, longest, dim, dtype)
    got, want = both(jagged.offsets_from_lengths, lengths)
    assert torch.equal(got, want) and got.dtype == torch.int64
    batch *= SCALE
    for max_len in (0, max(longest // 2, 1), longest + 3):  # truncating, and padding
        got, want = both(jagged.jagged_to_padded, values, offsets, max_len, padding_value=-7.0)
        assert got.shape == (batch, max_len, dim) and torch.equal(got, want)
        back, back_want = both(jagged.padded_to_jagged, want, offsets)
        assert torch.equal(back, back_want)
        kept = torch.arange(values.shape[0], device=DEVICE) - offsets[:-1].repeat_interleave(lengths) < max_len
        assert torch.equal(back[kept], values[kept]) and not back[~kept].any()
        upstream = torch.randn(batch, max_len, dim, generator=gen).to(DEVICE, dtype)
        for backend_grads in zip(*(
            grads_of(lambda v: jagged.jagged_to_padded(v, offsets, max_len, backend=b), [values.float()], [upstream.float()])
            for b in ("triton", "reference")
        )):
            assert torch.allclose(*backend_grads)
        down = torch.randn(values.shape[0], dim, generator=gen).to(DEVICE)
        for backend_grads in zip(*(
            grads_of(lambda p: jagged.padded_to_jagged(p, offsets, backend=b), [want.float()], [down])
            for b in ("triton", "reference")
        )):
            assert torch.allclose(*backend_grads)


@pytest.mark.parametrize("batch,longest,dim", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_concat_and_split_match_the_twin(batch, longest, dim, dtype):
    gen = torch.Generator().manual_seed(batch * 7 + dim)
    a_lengths, a_offsets, a_values = jagged_case(gen, batch, longest, dim, dtype)
    b_lengths, b_offsets, b_values = jagged_case(gen, batch, max(longest // 3, 1), dim, dtype)
    (got, got_offsets), (want, want_offsets) = both(jagged.jagged_concat, a_values, a_offsets, b_values, b_offsets)
    assert torch.equal(got, want) and torch.equal(got_offsets, want_offsets)
    for s in range(batch * SCALE):  # the model of concat: each sequence's a rows, then its b rows
        rows = want[want_offsets[s] : want_offsets[s + 1]]
        assert torch.equal(rows, torch.cat([a_values[a_offsets[s] : a_offsets[s + 1]], b_values[b_offsets[s] : b_offsets[s + 1]]]))
    (a_got, b_got), (a_want, b_want) = both(jagged.jagged_split, want, a_offsets, b_offsets)
    assert torch.equal(a_got, a_values) and torch.equal(b_got, b_values)
    assert torch.equal(a_want, a_values) and torch.equal(b_want, b_values)
    upstream = torch.randn(want.shape[0], dim, generator=gen).to(DEVICE)
    for backend_grads in zip(*(
        grads_of(lambda a, b: jagged.jagged_concat(a, a_offsets, b, b_offsets, backend=be)[0], [a_values.float(), b_values.float()], [upstream])
        for be in ("triton", "reference")
    )):
        assert torch.equal(*backend_grads)
    ups = [torch.randn(a_values.shape[0], dim, generator=gen).to(DEVICE), torch.randn(b_values.shape[0], dim, generator=gen).to(DEVICE)]
    for backend_grads in zip(*(
        grads_of(lambda v: jagged.jagged_split(v, a_offsets, b_offsets, backend=be), [want.float()], ups)
        for be in ("triton", "reference")
    )):
        assert torch.equal(*backend_grads)


def test_the_twins_pass_gradcheck():
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([2, 0, 3, 1])
    offsets = reference.offsets_from_lengths(lengths)
    values = torch.randn(6, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    other = torch.randn(3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    other_offsets = torch.tensor([0, 1, 1, 3, 3])
    padded = torch.randn(4, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: reference.jagged_to_padded(v, offsets, 2, 1.5), (values,))
    assert torch.autograd.gradcheck(lambda p: reference.padded_to_jagged(p, offsets, 6), (padded,))
    assert torch.autograd.gradcheck(lambda a, b: reference.jagged_concat(a, offsets, b, other_offsets)[0], (values, other))
    joined = reference.jagged_concat(values, offsets, other, other_offsets)[0].detach().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: reference.jagged_split(v, offsets, other_offsets, 6), (joined,))


def test_bad_input_is_refused_with_the_problem_named():
    values = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="int64"):
        jagged.jagged_to_padded(values, torch.tensor([0, 3], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="2-D"):
        jagged.jagged_to_padded(torch.zeros(3), torch.tensor([0, 3]), 4)
    with pytest.raises(ValueError, match="as many sequences"):
        jagged.jagged_concat(values, torch.tensor([0, 3]), values, torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="backend"):
        jagged.offsets_from_lengths(torch.tensor([1]), backend="cuda")
