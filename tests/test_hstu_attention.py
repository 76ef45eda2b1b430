"""HSTU attention's Triton kernels against the PyTorch twin (under Triton's interpreter on
a CPU, at full size on a GPU), and the twin's masks and gradients on their own."""
import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

from kernels.autotune import config_blocks, tuned_to
from kernels.hstu_attention import (
    allowed_pairs, attention_kernels, bias_tiles, hstu_attention, reference, score_grads, time_buckets, triton_kernels,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 4 if DEVICE == "cuda" else 1  # sequences and length on a GPU
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
NUM_BUCKETS = 128


pytestmark = pytest.mark.usefixtures("poisoned_memory")  # (conftest.py)


@pytest.fixture
def two_bucket_tiles(monkeypatch):
    """The kernels' loop of tiles spanning two time buckets at most, whatever the length
    (it runs from triton_kernels.TWO_BUCKET_MIN_LENGTH on), in the forward and the dK dV
    kernel too: their biases computed per tile, not read from the pair biases' prepass."""
    monkeypatch.setattr(triton_kernels, "TWO_BUCKET_MIN_LENGTH", 0)
    monkeypatch.setattr(triton_kernels, "PAIR_BIAS_TILES", False)


def case(seed, lengths, heads, dqk, dv, max_seq_len, dtype, targets=False):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    total = int(offsets[-1])
    tensors = dict(
        q=torch.randn(total, heads, dqk, generator=gen), k=torch.randn(total, heads, dqk, generator=gen),
        v=torch.randn(total, heads, dv, generator=gen),
        # gaps from seconds to years: every time bucket is used
        timestamps=torch.cumsum(torch.exp(torch.rand(total, generator=gen) * 20).long(), 0),
        position_bias=torch.randn(2 * max_seq_len - 1, generator=gen), time_bias=torch.randn(NUM_BUCKETS + 1, generator=gen),
    )
    for name in ("q", "k", "v"):
        tensors[name] = tensors[name].to(DEVICE, dtype).requires_grad_(True)
    for name in ("position_bias", "time_bias"):
        tensors[name] = tensors[name].to(DEVICE).requires_grad_(True)
    tensors["timestamps"] = tensors["timestamps"].to(DEVICE)
    num_targets = None
    if targets:
        num_targets = torch.minimum(torch.randint(0, 6, lengths.shape, generator=gen), lengths).to(DEVICE)
    return tensors, offsets.to(DEVICE), num_targets


def run(backend, tensors, offsets, max_seq_len, num_targets, context_len, upstream):
    inputs = {name: t.detach().clone().requires_grad_(t.requires_grad) for name, t in tensors.items()}
    out = hstu_attention(
        inputs["q"], inputs["k"], inputs["v"], offsets, inputs["timestamps"], inputs["position_bias"],
        inputs["time_bias"], max_seq_len, num_targets, context_len, backend=backend,
    )
    out.backward(upstream)
    # (no rows: the twin's output depends on no input but v, whose other grads stay None)
    return out, {name: t.grad if t.grad is not None else torch.zeros_like(t) for name, t in inputs.items() if t.requires_grad}


def close(got, want, tol):
    """Within tol of want's scale: the kernels sum in another order and round A to the input dtype."""
    if want.numel() == 0:
        return got.shape == want.shape
    scale = want.float().abs().max().clamp(min=1e-6)
    return bool(((got.float() - want.float()).abs() <= tol * scale).all())


LENGTHS = [[5, 0, 33, 1, 64, 70, 17], [0], []]
# Triton's interpreter computes bfloat16 dots wrongly (numbers of 1e9 where the GPU and the
# twin agree): bfloat16 runs on a GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dqk,dv", [(1, 25, 25), (2, 50, 64), (2, 128, 128)])
@pytest.mark.parametrize("targets,context_len", [(False, 0), (True, 0), (True, 3)])
def test_triton_attention_matches_the_twin_forward_and_backward(lengths, dtype, heads, dqk, dv, targets, context_len):
    lengths = [n * SCALE for n in lengths] * SCALE
    max_seq_len = max(lengths + [1]) + 3
    tensors, offsets, num_targets = case(len(lengths) + dqk, lengths, heads, dqk, dv, max_seq_len, dtype, targets)
    upstream = torch.randn(tensors["v"].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    got, got_grads = run("triton", tensors, offsets, max_seq_len, num_targets, context_len, upstream)
    want, want_grads = run("reference", tensors, offsets, max_seq_len, num_targets, context_len, upstream)
    assert got.shape == want.shape and got.dtype == dtype
    assert close(got, want, TOLERANCE[dtype])
    for name, g in want_grads.items():
        assert close(got_grads[name], g, TOLERANCE[dtype] * 4), name


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("targets,context_len", [(False, 0), (True, 0), (True, 3)])
@pytest.mark.usefixtures("two_bucket_tiles")
def test_with_two_bucket_tiles_on_every_length_matches_the_twin(lengths, targets, context_len):
    test_triton_attention_matches_the_twin_forward_and_backward(lengths, torch.float32, 2, 50, 64, targets, context_len)


@pytest.mark.parametrize("heads", [3, 4])
@pytest.mark.usefixtures("two_bucket_tiles")
def test_programs_of_one_head_and_of_two_match_the_twin(heads):
    """An even head count runs the forward two heads a program (four heads: two such pairs
    per sequence), an odd one a head a program."""
    test_triton_attention_matches_the_twin_forward_and_backward(LENGTHS[0], torch.float32, heads, 32, 16, True, 3)


@pytest.mark.parametrize("heads", [1, 2])
def test_head_dim_256_matches_the_twin(heads):
    """The largest head dim the kernels serve; on an H100 or H200 two heads of 256 do not
    fit a forward program's shared memory, so there they run a head a program. float16:
    the float32 case gave no result in 300 s on an H200, likely its compile (exact float32
    products are FMA loops, minutes per kernel), where 16-bit cases ran in seconds."""
    test_triton_attention_matches_the_twin_forward_and_backward([5, 0, 33], torch.float16, heads, 256, 256, True, 3)


class _NoRoomForPairs:
    """triton_kernels._forward on a device whose shared memory holds no paired tiling
    (the autotuner's launch raises OutOfResources before the kernel runs), or none at all."""

    def __init__(self, forward, unpaired_too=False):
        self.forward, self.unpaired_too, self.paired_calls = forward, unpaired_too, 0

    def __call__(self, grid, args, constants):
        if constants["PAIR"] or self.unpaired_too:
            self.paired_calls += constants["PAIR"]
            raise OutOfResources(300_000, 232_448, "shared memory")
        return self.forward(grid, args, constants)


def test_paired_heads_that_do_not_fit_run_a_head_a_program(monkeypatch):
    no_room = _NoRoomForPairs(triton_kernels._forward)
    monkeypatch.setattr(triton_kernels, "_forward", no_room)
    monkeypatch.setattr(triton_kernels, "_unpaired", set())
    for _ in range(2):  # the second call goes to one head a program at once
        test_triton_attention_matches_the_twin_forward_and_backward([5, 0, 33], torch.float32, 2, 32, 16, False, 0)
    assert no_room.paired_calls == 1 and len(triton_kernels._unpaired) == 1
    monkeypatch.setattr(triton_kernels, "_forward", _NoRoomForPairs(triton_kernels._forward, unpaired_too=True))
    with pytest.raises(RuntimeError, match="head dims 32 \\(q, k\\) and 16 \\(v\\) need more shared memory"):
        test_triton_attention_matches_the_twin_forward_and_backward([5, 0, 33], torch.float32, 2, 32, 16, False, 0)


@pytest.mark.parametrize("targets,context_len", [(False, 0), (True, 3)])
def test_timestamps_in_no_order_match_the_twin(targets, context_len):
    """The time bias's gradient sums each row's runs of equal buckets: timestamps shuffled
    within their sequences make runs of one or a few pairs, and equal ones runs that
    cross the masked pairs."""
    lengths = [n * SCALE for n in (70, 1, 64, 33)] * SCALE
    max_seq_len = max(lengths) + 1
    tensors, offsets, num_targets = case(7, lengths, 2, 32, 16, max_seq_len, torch.float32, targets)
    stamps = tensors["timestamps"].cpu()
    gen = torch.Generator().manual_seed(2)
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        stamps[a:b] = stamps[a:b][torch.randperm(b - a, generator=gen)]
    stamps[offsets[2]:offsets[2] + 20] = stamps[offsets[2]]  # a run of equal timestamps
    tensors["timestamps"] = stamps.to(DEVICE)
    upstream = torch.randn(tensors["v"].shape, generator=gen).to(DEVICE)
    got, got_grads = run("triton", tensors, offsets, max_seq_len, num_targets, context_len, upstream)
    want, want_grads = run("reference", tensors, offsets, max_seq_len, num_targets, context_len, upstream)
    assert close(got, want, TOLERANCE[torch.float32])
    for name, g in want_grads.items():
        assert close(got_grads[name], g, TOLERANCE[torch.float32] * 4), name


def test_the_masks_and_buckets_are_the_stated_ones():
    # 6 rows: a context prefix of 1, history rows 1-3, targets 4 and 5
    want = torch.tensor([
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed_pairs(6, 2, 1, "cpu"), want)
    assert torch.equal(allowed_pairs(3, 0, 0, "cpu"), torch.ones(3, 3, dtype=torch.bool).tril())
    buckets = time_buckets(torch.tensor([0, 1, 2, 4, 1000]), 20)
    assert buckets[0].tolist() == [0, 0, 2, 4, 20]  # floor(log(gap) / 0.301): log 2 -> 2.3, log 4 -> 4.6; 22.9 clamped


def test_the_twin_is_the_padded_computation_and_passes_gradcheck():
    gen = torch.Generator().manual_seed(5)
    heads, d, max_seq_len = 2, 3, 6
    offsets = torch.tensor([0, 3, 3, 7])  # lengths 3, 0, 4
    q, k, v = (torch.randn(7, heads, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    timestamps = torch.tensor([1, 5, 90, 7, 8, 3000, 3001])
    position_bias = torch.randn(2 * max_seq_len - 1, generator=gen, dtype=torch.float64, requires_grad=True)
    time_bias = torch.randn(9, generator=gen, dtype=torch.float64, requires_grad=True)

    def attention(q, k, v, position_bias, time_bias):
        return reference.hstu_attention(q, k, v, offsets, timestamps, position_bias, time_bias, max_seq_len, torch.tensor([1, 0, 1]), 1)

    assert torch.autograd.gradcheck(attention, (q, k, v, position_bias, time_bias))
    out = attention(q, k, v, position_bias, time_bias)
    # every row and head, by the formula written out pair by pair
    for start, n, targets in ((0, 3, 1), (3, 4, 1)):
        allowed = allowed_pairs(n, targets, 1, "cpu")
        for h in range(heads):
            for i in range(n):
                want = torch.zeros(d, dtype=torch.float64)
                for j in range(n):
                    gap = abs(int(timestamps[start + i]) - int(timestamps[start + j]))
                    bucket = min(max(int(torch.floor(torch.log(torch.tensor(float(max(gap, 1)))) / 0.301)), 0), 8)
                    s = q[start + i, h] @ k[start + j, h] + position_bias[j - i + max_seq_len - 1] + time_bias[bucket]
                    want += float(allowed[i, j]) * torch.nn.functional.silu(s) / max_seq_len * v[start + j, h]
                assert torch.allclose(out[start + i, h], want)


def test_bad_input_is_refused_with_the_problem_named():
    q = torch.zeros(4, 1, 8)
    offsets, timestamps, time_bias = torch.tensor([0, 4]), torch.zeros(4, dtype=torch.int64), torch.zeros(3)
    with pytest.raises(ValueError, match="position_bias"):
        hstu_attention(q, q, q, offsets, timestamps, torch.zeros(5), time_bias, 4)
    with pytest.raises(ValueError, match="num_targets"):
        hstu_attention(q, q, q, offsets, timestamps, torch.zeros(7), time_bias, 4, num_targets=torch.tensor([1, 2]))


@pytest.mark.parametrize("stored, prepass", [(False, False), (True, False), (True, True)],
                         ids=["recomputing", "stored", "stored_and_prepass"])
def test_every_tuning_configuration_matches_the_twin(monkeypatch, stored, prepass):
    """Each configuration of the kernels of one backward: recomputing dQ from the scores
    (a buffer of no bytes), or from stored dS (score_grads.py, whose two kernels have
    configurations of their own, taken in step with the others'); the biases computed per
    tile, or, where dS is stored (the prepass's buffer shares its budget), read from the
    pair biases' prepass (bias_tiles.py, its configurations too). The interpreter runs each
    tiling's blocks too (not its warps and stages), in float32 on shorter sequences."""
    if not stored:
        monkeypatch.setattr(triton_kernels, "SCORE_GRADS_BUFFER_BYTES", 0)
    monkeypatch.setattr(triton_kernels, "PAIR_BIAS_TILES", prepass)
    monkeypatch.setattr(triton_kernels, "PAIR_BIAS_TILES_MIN_LENGTH", 0)
    tuned = [attention_kernels._forward, attention_kernels._backward_kv, attention_kernels._backward_q]
    configs = [attention_kernels.CONFIGS] * 3
    if stored:
        tuned += [score_grads._dq, score_grads._bias_grads]
        configs += [score_grads.DQ_CONFIGS, score_grads.BIAS_CONFIGS]
    if prepass:
        tuned.append(bias_tiles._pair_biases)
        configs.append(bias_tiles.CONFIGS)
    # (every tiling's blocks meet several row and key blocks, the diagonal's among them)
    if DEVICE == "cuda":
        dtype, lengths, max_seq_len = torch.bfloat16, [5, 0, 133, 1, 264, 270, 17] * 4, 300
    else:
        dtype, lengths, max_seq_len = torch.float32, [5, 0, 133, 1, 150, 17], 160
    for i in range(max(len(c) for c in configs)):
        with tuned_to(*((t, c[i % len(c)]) for t, c in zip(tuned, configs))):
            for heads, context_len in ((2, 0), (2, 3), (1, 3)):  # (the forward runs an even head count in pairs)
                tensors, offsets, num_targets = case(i, lengths, heads, 64, 64, max_seq_len, dtype, True)
                upstream = torch.randn(tensors["v"].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
                got, got_grads = run("triton", tensors, offsets, max_seq_len, num_targets, context_len, upstream)
                assert all(t.chosen for t in tuned if t is not attention_kernels._backward_q or not stored), "a kernel did not run"
                want, want_grads = run("reference", tensors, offsets, max_seq_len, num_targets, context_len, upstream)
                assert close(got, want, TOLERANCE[dtype]), i
                for name, g in want_grads.items():
                    assert close(got_grads[name], g, TOLERANCE[dtype] * 4), (i, name)


def test_later_launches_reuse_the_tuners_choice_and_give_the_same_result():
    attention_kernels._forward.forget()
    tensors, offsets, _ = case(3, [7, 0, 20], 2, 16, 16, 24, torch.float32)
    args = [tensors[n].detach() for n in ("q", "k", "v")] + [offsets, tensors["timestamps"]]
    args += [tensors["position_bias"].detach(), tensors["time_bias"].detach(), 24]
    first = triton_kernels.hstu_attention(*args)  # through the autotuner
    (config,) = attention_kernels._forward.chosen.values()
    assert config in attention_kernels._forward.tuner.configs
    second = triton_kernels.hstu_attention(*args)  # the chosen configuration, launched directly
    assert len(attention_kernels._forward.chosen) == 1 and torch.equal(first, second)


def test_time_buckets_are_exact_at_every_edge():
    """Sequences of two rows whose gap is each bucket's least gap, one less and one more
    (gaps past 2^24 round to float32 as the twin's do): with zero queries and keys, the
    second row's output is SiLU(its bucket's bias) / max_seq_len, so a gap placed in the
    next or the last bucket shows."""
    edges = reference.time_bucket_edges(NUM_BUCKETS)[1:]
    gaps = sorted({max(1, e + d) for e in edges for d in (-1, 0, 1)} | {2**40, 2**62})
    b = len(gaps)
    offsets = torch.arange(0, 2 * b + 1, 2, device=DEVICE)
    timestamps = torch.stack([torch.zeros(b, dtype=torch.int64), torch.tensor(gaps)], 1).reshape(-1).to(DEVICE)
    q = torch.zeros(2 * b, 1, 16, device=DEVICE)
    v = torch.zeros(2 * b, 1, 16, device=DEVICE)
    v[0::2] = 1.0  # the first row of each sequence
    time_bias = torch.arange(NUM_BUCKETS + 1, dtype=torch.float32, device=DEVICE) * 0.01
    position_bias = torch.zeros(3, device=DEVICE)
    out = {backend: hstu_attention(q, q, v, offsets, timestamps, position_bias, time_bias, 2, backend=backend)
           for backend in ("triton", "reference")}
    assert close(out["triton"], out["reference"], 1e-6)
    buckets = time_buckets(torch.tensor([0, 2**62]), NUM_BUCKETS)[0, 1]
    assert int(buckets) == NUM_BUCKETS  # the largest gaps are clamped into the last bucket


@pytest.mark.parametrize("targets", [False, True])
@pytest.mark.usefixtures("two_bucket_tiles")
def test_tiles_whose_gaps_span_one_or_two_buckets_match_the_twin(targets):
    """Sequences whose second half starts a jump after the first (gaps across it run from
    the jump to about 400 past it): tiles across the jump hold gaps of one bucket (a jump
    inside one) or of two (a jump just below a bucket's float32 edge, past 2^24 where
    whole gaps round onto the edge from below); outputs and every gradient equal the
    twin's."""
    edges = torch.tensor(reference.time_bucket_edges(NUM_BUCKETS), dtype=torch.float32).tolist()
    jumps = [int(edges[b]) - 150 for b in (40, 60, 80, 100, 120)] + [int(1.15 * edges[b]) for b in (50, 90, 110)]
    gen = torch.Generator().manual_seed(0)
    half, heads, dim = 128, 2, 32
    stamps = []
    for jump in jumps:
        steps = torch.randint(0, 4, (2 * half,), generator=gen)
        steps[half] += jump
        stamps.append(torch.cumsum(steps, 0))
    b = len(jumps)
    offsets = torch.arange(0, 2 * half * b + 1, 2 * half).to(DEVICE)
    max_seq_len = 2 * half
    tensors = dict(
        q=torch.randn(2 * half * b, heads, dim, generator=gen), k=torch.randn(2 * half * b, heads, dim, generator=gen),
        v=torch.randn(2 * half * b, heads, dim, generator=gen), timestamps=torch.cat(stamps),
        position_bias=torch.randn(2 * max_seq_len - 1, generator=gen), time_bias=torch.randn(NUM_BUCKETS + 1, generator=gen),
    )
    tensors = {n: t.to(DEVICE).requires_grad_(n != "timestamps") for n, t in tensors.items()}
    num_targets = torch.randint(0, 5, (b,), generator=gen).to(DEVICE) if targets else None
    upstream = torch.randn(tensors["v"].shape, generator=gen).to(DEVICE)
    got, got_grads = run("triton", tensors, offsets, max_seq_len, num_targets, 0, upstream)
    want, want_grads = run("reference", tensors, offsets, max_seq_len, num_targets, 0, upstream)
    assert close(got, want, TOLERANCE[torch.float32])
    for name, g in want_grads.items():
        assert close(got_grads[name], g, TOLERANCE[torch.float32] * 4), name


@pytest.mark.usefixtures("two_bucket_tiles")
def test_tiles_whose_gaps_span_three_buckets_match_the_twin():
    """Sequences of evenly spaced timestamps (a step per sequence): a tile two blocks
    below the diagonal holds gaps from about 128 to 255 steps, two to four buckets, and
    must not be taken for a tile of two; outputs and every gradient equal the twin's."""
    steps = [7, 9, 11, 13, 17, 19, 23, 29, 31, 37]
    n, heads, dim = 256, 1, 16
    stamps = torch.cat([s * torch.arange(n) + 1000 * i for i, s in enumerate(steps)])
    # buckets of the last query block against the first key block, per sequence
    spans = [int(time_buckets(s * torch.arange(n), NUM_BUCKETS)[192:, :64].unique().numel()) for s in steps]
    assert 3 in spans, spans  # the case the test is for
    gen = torch.Generator().manual_seed(1)
    total = n * len(steps)
    tensors = dict(
        q=torch.randn(total, heads, dim, generator=gen), k=torch.randn(total, heads, dim, generator=gen),
        v=torch.randn(total, heads, dim, generator=gen), timestamps=stamps,
        position_bias=torch.randn(2 * n - 1, generator=gen), time_bias=torch.randn(NUM_BUCKETS + 1, generator=gen),
    )
    tensors = {name: t.to(DEVICE).requires_grad_(name != "timestamps") for name, t in tensors.items()}
    offsets = torch.arange(0, total + 1, n).to(DEVICE)
    upstream = torch.randn(total, heads, dim, generator=gen).to(DEVICE)
    got, got_grads = run("triton", tensors, offsets, n, None, 0, upstream)
    want, want_grads = run("reference", tensors, offsets, n, None, 0, upstream)
    assert close(got, want, TOLERANCE[torch.float32])
    for name, g in want_grads.items():
        assert close(got_grads[name], g, TOLERANCE[torch.float32] * 4), name


def test_timestamp_extremes_match_the_twin():
    """The prepass's least and greatest timestamp per block of rows (offsets from each
    sequence's first), empty sequences and a partial last block included."""
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([0, 1, 31, 32, 33, 100, 0, 257])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(DEVICE)
    timestamps = torch.randint(-2**40, 2**40, (int(lengths.sum()),), generator=gen).to(DEVICE)
    got = triton_kernels.timestamp_extremes(offsets, timestamps, 300, 128)
    want = reference.timestamp_extremes(offsets, timestamps, 300, 128)
    assert got.shape == want.shape == (8, 12, 2) and torch.equal(got, want)


@pytest.mark.usefixtures("two_bucket_tiles")
def test_a_batchs_timestamp_extremes_are_made_once_and_again_after_a_write(monkeypatch):
    """Calls on the same offsets and timestamps (a model's blocks, forward and backward)
    share one prepass of the extremes; an in-place write to the timestamps makes them
    again, and the attention then matches the twin on the new timestamps. With
    REUSE_BATCH_EXTREMES off, the forward and the backward each make their own."""
    made = []
    prepass = triton_kernels.timestamp_extremes
    monkeypatch.setattr(triton_kernels, "timestamp_extremes", lambda *args: made.append(1) or prepass(*args))
    monkeypatch.setattr(triton_kernels, "_last_extremes", None)
    lengths, heads, dim = [9, 0, 40, 23], 2, 32
    tensors, offsets, _ = case(11, lengths, heads, dim, dim, 40, torch.float32)
    q, k, v, timestamps = (tensors[name] for name in ("q", "k", "v", "timestamps"))
    biases = tensors["position_bias"], tensors["time_bias"]
    for _ in range(3):  # three blocks' attention, forward and backward
        hstu_attention(q, k, v, offsets, timestamps, *biases, 40, backend="triton").sum().backward()
    assert len(made) == 1
    timestamps[offsets[2]:].mul_(3)  # (a view: the write advances timestamps' version too)
    upstream = torch.randn(v.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = hstu_attention(q, k, v, offsets, timestamps, *biases, 40, backend="triton")
    assert len(made) == 2
    want = reference.hstu_attention(q, k, v, offsets, timestamps, *biases, 40)
    assert close(got, want, TOLERANCE[torch.float32])
    got_grads = torch.autograd.grad(got, (q, k, v), upstream)
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)
    for g, w in zip(got_grads, want_grads):
        assert close(g, w, TOLERANCE[torch.float32] * 4)
    assert len(made) == 2
    monkeypatch.setattr(triton_kernels, "REUSE_BATCH_EXTREMES", False)  # each call its own
    hstu_attention(q, k, v, offsets, timestamps, *biases, 40, backend="triton").sum().backward()
    assert len(made) == 4


def test_bucket_thresholds_are_the_least_gaps_of_each_bucket():
    """Each threshold is the least whole gap the twin places in its bucket or above (a
    bucket may be empty: the first two edges are both 2)."""
    thresholds = triton_kernels.bucket_thresholds(NUM_BUCKETS)
    assert len(thresholds) == NUM_BUCKETS + 2 and thresholds[-1] == float("inf")
    exact = [(b, int(t)) for b, t in enumerate(thresholds[1:-1], 1) if t < 2**53]
    assert len(exact) > 100
    gaps = torch.tensor([[0, t - 1, 0, t] for _, t in exact]).reshape(-1, 2)
    placed = time_buckets(gaps, NUM_BUCKETS)[:, 0, 1].reshape(-1, 2)  # (t - 1, t) per bucket
    bucket = torch.tensor([b for b, _ in exact])
    assert bool((placed[:, 1] >= bucket).all() and (placed[:, 0] < bucket).all())  # t in bucket b or above, t - 1 below


class _CountedLaunches:
    """triton_kernels._launch_dq, counting its launches."""

    def __init__(self, launch):
        self.launch, self.calls = launch, 0

    def __call__(self, *args):
        self.calls += 1
        return self.launch(*args)


@pytest.mark.parametrize("lengths", LENGTHS[:2])
@pytest.mark.parametrize("targets,context_len", [(False, 0), (True, 0), (True, 3)])
@pytest.mark.parametrize("two_buckets,by_descriptor", [(False, True), (True, True), (True, False)])
def test_backward_from_stored_score_grads_matches_the_twin(monkeypatch, lengths, targets, context_len, two_buckets, by_descriptor):
    """The backward that stores each tile's dS and takes dQ and the biases' gradients from
    it (score_grads.py), at every length, through a buffer of three sequences (the buffer
    is poisoned: an entry read that the dK dV kernel did not write shows as NaN); dS stored
    through tensor descriptors, or through pointers as on GPUs before Hopper. float16 on a
    GPU, where float32's exact products take minutes to compile."""
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    scaled = [n * SCALE for n in lengths] * SCALE  # (as the test below scales them)
    max_seq_len, heads = max(scaled + [1]) + 3, 2
    one_sequence = heads * max_seq_len * score_grads.score_grads_row_length(max_seq_len) * dtype.itemsize
    monkeypatch.setattr(triton_kernels, "SCORE_GRADS_BUFFER_BYTES", 3 * one_sequence)
    monkeypatch.setattr(triton_kernels, "_descriptor_stores", lambda device: by_descriptor)
    monkeypatch.setattr(triton_kernels, "TWO_BUCKET_MIN_LENGTH", 0 if two_buckets else 1 << 30)
    counted = _CountedLaunches(triton_kernels._launch_dq)
    monkeypatch.setattr(triton_kernels, "_launch_dq", counted)
    test_triton_attention_matches_the_twin_forward_and_backward(lengths, dtype, heads, 50, 64, targets, context_len)
    assert counted.calls == (-(-len(scaled) // 3) if sum(scaled) else 0)  # (no rows: no launch)


@pytest.mark.parametrize("targets,context_len", [(False, 0), (True, 0), (True, 3)])
@pytest.mark.parametrize("two_buckets", [False, True])
def test_backward_recomputing_the_scores_matches_the_twin(monkeypatch, targets, context_len, two_buckets):
    """The backward where a sequence's dS does not fit the buffer: dQ and the biases'
    gradients recomputed from the scores in one kernel, no stored dS read."""
    monkeypatch.setattr(triton_kernels, "SCORE_GRADS_BUFFER_BYTES", 0)
    monkeypatch.setattr(triton_kernels, "TWO_BUCKET_MIN_LENGTH", 0 if two_buckets else 1 << 30)
    counted = _CountedLaunches(triton_kernels._launch_dq)
    monkeypatch.setattr(triton_kernels, "_launch_dq", counted)
    test_triton_attention_matches_the_twin_forward_and_backward(LENGTHS[0], torch.float16, 2, 50, 64, targets, context_len)
    assert counted.calls == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("targets,context_len", [(False, 0), (True, 3)])
@pytest.mark.parametrize("two_buckets", [False, True])
def test_dq_and_bias_grads_from_score_grads_match_the_twins(monkeypatch, dtype, targets, context_len, two_buckets):
    """dq_from_score_grads and bias_grads_from_score_grads on their own, against their
    twins, with every entry of ds a row does not attend to NaN: neither reads one."""
    monkeypatch.setattr(triton_kernels, "TWO_BUCKET_MIN_LENGTH", 0 if two_buckets else 1 << 30)
    lengths = [n * SCALE for n in LENGTHS[0]] * SCALE
    max_seq_len, heads = max(lengths) + 5, 3
    tensors, offsets, num_targets = case(11, lengths, heads, 40, 40, max_seq_len, dtype, targets)
    gen = torch.Generator().manual_seed(3)
    ds = torch.full((len(lengths), heads, max_seq_len, max_seq_len), float("nan"))
    for b, n in enumerate(lengths):
        attended = reference.allowed_pairs(n, int(num_targets[b]) if targets else 0, context_len, "cpu")
        ds[b, :, :n, :n] = torch.where(attended, torch.randn(heads, n, n, generator=gen), float("nan"))
    ds = ds.to(DEVICE, dtype)
    k, stamps = tensors["k"].detach(), tensors["timestamps"]
    args = (offsets, stamps, max_seq_len)
    got = triton_kernels.dq_from_score_grads(ds, k, *args, num_targets, context_len)
    want = reference.dq_from_score_grads(ds, k, *args, num_targets, context_len)
    assert got.dtype == dtype and close(got, want, TOLERANCE[dtype])
    got = triton_kernels.bias_grads_from_score_grads(ds, *args, NUM_BUCKETS, num_targets, context_len)
    want = reference.bias_grads_from_score_grads(ds, *args, NUM_BUCKETS, num_targets, context_len)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape and close(g, w, 2e-5)


# the interpreter's tiling; blocks of fewer rows than keys (as most of the GPU's tilings):
# the tiles of a band then share key blocks with the tiles before them; and blocks of more
# rows than keys (as the GPU's 64 x 32): the bands from the diagonal's up to BLOCK_M - 1
# keys past it then hold the diagonal blocks' pairs past their first BLOCK_N keys
BAND_TILINGS = [None, triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BAND_TILES": 2}, num_warps=4, num_stages=2),
                triton.Config({"BLOCK_M": 32, "BLOCK_N": 8, "BAND_TILES": 2}, num_warps=4, num_stages=2)]


@pytest.mark.parametrize("tiling", BAND_TILINGS, ids=["interpreter", "16x32x2", "32x8x2"])
@pytest.mark.parametrize("context_len", [0, 3, 40])
def test_bias_grads_of_blocks_of_targets_match_the_twin(context_len, tiling):
    """bias_grads_from_score_grads where whole blocks of rows are targets (which attend to
    the history and themselves) and a context prefix, shorter than a block or not, attends
    to every key of the history, every entry of ds a row does not attend to NaN."""
    lengths, targets = [150, 97, 64, 130], [70, 33, 0, 129]
    max_seq_len, heads = 160, 2
    gen = torch.Generator().manual_seed(5)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    stamps = torch.cumsum(torch.exp(torch.rand(sum(lengths), generator=gen) * 12).long(), 0)
    ds = attended_score_grads(lengths, targets, context_len, heads, max_seq_len, gen)
    args = (offsets.to(DEVICE), stamps.to(DEVICE), max_seq_len, NUM_BUCKETS, torch.tensor(targets).to(DEVICE), context_len)
    assert bias_grads_match_the_twin(ds, args, tiling)


def attended_score_grads(lengths, targets, context_len, heads, max_seq_len, gen):
    """(sequences, heads, max_seq_len, max_seq_len) float16 dS, random where a row attends
    (reference.allowed_pairs), NaN elsewhere."""
    ds = torch.full((len(lengths), heads, max_seq_len, max_seq_len), float("nan"))
    for b, (n, t) in enumerate(zip(lengths, targets)):
        attended = reference.allowed_pairs(n, t, context_len, "cpu")
        ds[b, :, :n, :n] = torch.where(attended, torch.randn(heads, n, n, generator=gen), float("nan"))
    return ds.to(DEVICE, torch.float16)


def bias_grads_match_the_twin(ds, args, tiling) -> bool:
    """Whether bias_grads_from_score_grads(ds, *args) at tiling (None: the tuner's own
    configurations) is within 2e-5 of the twin's."""
    with tuned_to(*[(score_grads._bias_grads, tiling)] if tiling is not None else []):
        got = triton_kernels.bias_grads_from_score_grads(ds, *args)
    want = reference.bias_grads_from_score_grads(ds, *args)
    return all(close(g, w, 2e-5) for g, w in zip(got, want))


@pytest.mark.parametrize("tiling", score_grads.BIAS_CONFIGS, ids=config_blocks)
def test_bias_grads_of_long_bands_of_changing_buckets_match_the_twin(monkeypatch, tiling):
    """bias_grads_from_score_grads with the tiles of two time buckets on, at the GPU's
    tilings, whose programs walk many tiles of a band: timestamps evenly spaced (a band's
    buckets stay the same along it), spaced ever wider (they change every tile or two),
    and spaced at random, so that a program's run of unmasked tiles holds tiles of the
    same lower bucket in a row, changes of bucket, and tiles of three buckets or more
    between them; every entry of ds a row does not attend to NaN."""
    monkeypatch.setattr(triton_kernels, "TWO_BUCKET_MIN_LENGTH", 0)
    gen = torch.Generator().manual_seed(6)
    lengths, max_seq_len, heads = [512, 480, 300], 512, 2
    steps = [torch.full((512,), 7), (5 * 1.015 ** torch.arange(480)).round().long(),
             torch.exp(torch.rand(300, generator=gen) * 8).long() + 1]
    stamps = torch.cat([torch.cumsum(s, 0) for s in steps])
    # the case the test is for: along a band far from the diagonal the buckets change
    widening = time_buckets(torch.cumsum(steps[1], 0)[None], NUM_BUCKETS)[0]
    assert len({int(widening[r, r - 256]) for r in range(256, 480, 16)}) > 3
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ds = attended_score_grads(lengths, [0] * len(lengths), 0, heads, max_seq_len, gen)
    assert bias_grads_match_the_twin(ds, (offsets.to(DEVICE), stamps.to(DEVICE), max_seq_len, NUM_BUCKETS), tiling)


def test_the_score_grads_buffer_takes_at_most_a_share_of_the_gpus_memory(monkeypatch):
    """On a GPU the stored-dS buffer holds at most 1 / SCORE_GRADS_MEMORY_SHARE of its
    memory: fewer sequences a pass on a small GPU, none (the recomputing path) where one
    sequence's dS does not fit; elsewhere SCORE_GRADS_BUFFER_BYTES alone."""
    one = 4 * 100 * 104 * 2  # a sequence's dS: 4 heads, max_seq_len 100 (rows of 104 entries), bfloat16
    monkeypatch.setattr(triton_kernels, "_device_memory", lambda device: triton_kernels.SCORE_GRADS_MEMORY_SHARE * 3 * one)
    chunk = triton_kernels._score_grads_chunk
    assert chunk(10, 4, 100, torch.bfloat16, torch.device("cuda")) == 3
    assert chunk(10, 4, 200, torch.bfloat16, torch.device("cuda")) == 0
    assert chunk(10, 4, 200, torch.bfloat16, torch.device("cpu")) == 10
    monkeypatch.setattr(triton_kernels, "SCORE_GRADS_BUFFER_BYTES", 2 * one)
    assert chunk(10, 4, 100, torch.bfloat16, torch.device("cuda")) == 2
