"""Dropout(LayerNorm(x) ⊙ u): the Triton kernels against the PyTorch twin (under Triton's
interpreter on a CPU), forward and backward with the same dropout mask; the twin's mask
against its definition and its gradients by gradcheck; the model's blocks on the kernels."""
import pytest
import torch
import torch.nn.functional as F

from kernels import norm_mul_dropout as nmd
from kernels.norm_mul_dropout import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 64 if DEVICE == "cuda" else 1  # rows on a GPU
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.usefixtures("poisoned_memory")  # (conftest.py)


def inputs(rows, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed + rows + dim)
    x = (torch.randn(rows, dim, generator=gen) * 3 + 1).to(DEVICE, dtype)
    u = torch.randn(rows, dim, generator=gen).to(DEVICE, dtype)
    weight = (1 + torch.randn(dim, generator=gen) / 4).to(DEVICE)
    bias = torch.randn(dim, generator=gen).to(DEVICE)
    return x, u, weight, bias, torch.randn(rows, dim, generator=gen).to(DEVICE, dtype)


def through(backend, x, u, weight, bias, upstream, p, seed):
    """(output, the gradients of x, u, weight and bias) of norm_mul_dropout on backend, its
    seed drawn after torch.manual_seed(seed)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, u, weight, bias)]
    torch.manual_seed(seed)
    out = nmd.norm_mul_dropout(*leaves, eps=1e-5, p=p, backend=backend)
    out.backward(upstream)
    return [out, *(t.grad for t in leaves)]


# rows: none, one, fewer and more than a program's; widths: the paper presets' 50, not a
# multiple of the four columns a random call serves, hstu-long's 512, past one program's tile
@pytest.mark.parametrize("rows,dim", [(0, 50), (1, 50), (7, 33), (131, 50), (70, 512), (3, 5000), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("p", [0.0, 0.2, 0.5])
def test_norm_mul_dropout_matches_the_twin_forward_and_backward(rows, dim, dtype, p):
    x, u, weight, bias, upstream = inputs(rows * SCALE, dim, dtype)
    got = through("triton", x, u, weight, bias, upstream, p, seed=5)
    want = through("reference", x, u, weight, bias, upstream, p, seed=5)
    tol = TOLERANCE[dtype]
    for g, w, name in zip(got, want, ("out", "dx", "du", "dweight", "dbias")):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        scale = max(x.shape[0], 1) if name in ("dweight", "dbias") else 1  # sums over the rows
        torch.testing.assert_close(g.float(), w.float(), atol=tol * scale ** 0.5 * 4, rtol=tol * 4, msg=name)
    if p:  # the same elements dropped, forward and backward
        assert torch.equal(got[0] == 0, want[0] == 0) and torch.equal(got[2] == 0, want[2] == 0)


def test_the_mask_depends_on_the_seed_and_drops_a_share_p():
    """Each call draws its own seed: two calls drop different elements, each about a share
    p of them; the same torch seed drops the same ones."""
    x, u, weight, bias, _ = inputs(256, 512, torch.float32)
    outs = []
    for seed in (1, 2, 1):
        torch.manual_seed(seed)
        outs.append(nmd.norm_mul_dropout(x, u, weight, bias, p=0.3, backend="triton") == 0)
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])
    for dropped in outs[:2]:
        assert abs(dropped.float().mean().item() - 0.3) < 0.01  # (131,072 elements: a sd of 0.0013)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_each_replay_of_a_cuda_graph_draws_its_own_mask():
    """The seed is drawn on the device inside the captured work, so each replay of a graph
    of the forward and backward drops other elements, a share p of them, and its backward
    drops the same ones as its forward."""
    x, u, weight, bias, upstream = inputs(256, 512, torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, u)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (autotuning and compiles before the capture)
        for _ in range(2):
            nmd.norm_mul_dropout(*leaves, weight, bias, p=0.3, backend="triton").backward(upstream)
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nmd.norm_mul_dropout(*leaves, weight, bias, p=0.3, backend="triton")
        out.backward(upstream)
    dropped = []
    for _ in range(2):
        graph.replay()
        dropped.append(out == 0)
        assert torch.equal(dropped[-1], leaves[1].grad == 0)
        assert abs(dropped[-1].float().mean().item() - 0.3) < 0.01
    assert not torch.equal(dropped[0], dropped[1])


def test_the_twins_mask_is_philox_words_against_the_threshold():
    """reference.kept: element (r, c) compares word c % 4 of the counter r · ⌈D / 4⌉ + c // 4
    with the threshold; known words of Philox-4x32-10 (the counter 0 and key 0 of the
    published test vectors: 6627e8d5 e169c58d bc57ac4c 9b00dbd8)."""
    assert [int(w) for w in reference.philox_words(0, torch.zeros(1, dtype=torch.int64))] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8,
    ]
    seed, rows, dim, p = 12345, 3, 10, 0.4
    words = reference.philox_words(seed, torch.arange(rows * 3, dtype=torch.int64))
    kept = reference.kept(seed, rows, dim, p)
    for r in range(rows):
        for c in range(dim):
            assert bool(kept[r, c]) == (int(words[c % 4][r * 3 + c // 4]) >= reference.keep_threshold(p))


def test_the_twin_is_the_formula_and_its_gradients_pass_gradcheck():
    x, u, weight, bias, _ = inputs(6, 7, torch.float64)
    plain = F.layer_norm(x, (7,), weight.double(), bias.double(), 1e-5) * u
    torch.testing.assert_close(reference.norm_mul_dropout(x, u, weight.double(), bias.double(), 1e-5, 0.0, 0), plain)
    mask = reference.kept(99, 6, 7, 0.5, x.device)
    torch.testing.assert_close(reference.norm_mul_dropout(x, u, weight.double(), bias.double(), 1e-5, 0.5, 99), plain * mask * 2)
    leaves = [t.detach().double().cpu().requires_grad_(True) for t in (x, u, weight, bias)]
    assert torch.autograd.gradcheck(lambda *a: reference.norm_mul_dropout(*a, 1e-5, 0.5, 99), leaves)


def test_bad_shapes_and_probabilities_are_refused():
    x, u, weight, bias, _ = inputs(4, 8, torch.float32)
    with pytest.raises(ValueError, match="u must have x's shape"):
        nmd.norm_mul_dropout(x, u[:, :4], weight, bias, backend="triton")
    with pytest.raises(ValueError, match="dropout probability must be in"):
        nmd.norm_mul_dropout(x, u, weight, bias, p=1.5, backend="triton")
