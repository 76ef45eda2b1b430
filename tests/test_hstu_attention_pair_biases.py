"""HSTU attention reading both biases of each pair from the prepass's buffer
(kernels/hstu_attention/bias_tiles.py): the prepass against its twin, the rows read through
tensor descriptors or pointers, and the forward's buffer kept for the backward within its
budget (kept_biases.py); the kernels' outputs and gradients against the twin throughout,
with test_hstu_attention.py's cases."""
import pytest
import torch

import test_hstu_attention as base
from kernels.hstu_attention import allowed_pairs, bias_tiles, hstu_attention, kept_biases, reference, triton_kernels
from test_hstu_attention import DEVICE, LENGTHS, NUM_BUCKETS, SCALE, TOLERANCE

pytestmark = pytest.mark.usefixtures("poisoned_memory")  # (conftest.py)


def _assert_attended_pairs_match(offsets, timestamps, position_bias, time_bias, max_seq_len, dtype, num_targets, context_len):
    """The prepass (bias_tiles.pair_biases) against its twin on every pair a row attends to
    (the buffer comes NaN-filled: an attended pair left unwritten fails), with the tiles
    of two buckets at most run where the length allows (triton_kernels._time_tables)."""
    tables = triton_kernels._time_tables(NUM_BUCKETS, offsets, timestamps, max_seq_len)
    args = (offsets, timestamps, position_bias, time_bias, max_seq_len, tables, dtype, num_targets, context_len)
    got, want = bias_tiles.pair_biases(*args), reference.pair_biases(*args)
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    for b, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        n = end - start
        attended = allowed_pairs(n, int(num_targets[b]) if num_targets is not None else 0, context_len, DEVICE)
        assert torch.equal(got[b, :n, :n][attended], want[b, :n, :n][attended]), b


@pytest.mark.parametrize("two_buckets", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("targets,context_len", [(False, 0), (True, 0), (True, 3)])
def test_pair_biases_match_the_twin_where_rows_attend(monkeypatch, two_buckets, dtype, targets, context_len):
    """Sequences of odd and empty lengths, gaps from seconds to years; with and without
    the tiles of two buckets at most."""
    monkeypatch.setattr(triton_kernels, "TWO_BUCKET_MIN_LENGTH", 0 if two_buckets else 1 << 30)
    lengths = [n * SCALE for n in [5, 0, 33, 1, 64, 70, 17, 130]]
    max_seq_len = max(lengths) + 3
    tensors, offsets, num_targets = base.case(7, lengths, 1, 16, 16, max_seq_len, dtype, targets)
    _assert_attended_pairs_match(
        offsets, tensors["timestamps"], tensors["position_bias"].detach(), tensors["time_bias"].detach(), max_seq_len, dtype,
        num_targets if targets else None, context_len,
    )


@pytest.mark.parametrize("targets", [False, True])
def test_pair_biases_of_tiles_of_one_two_and_three_buckets_match_the_twin(monkeypatch, targets):
    """Sequences whose second half starts a jump after the first, placed inside a bucket
    or just below an edge (tiles across the jump span one or two buckets), and evenly
    spaced ones (a tile two blocks below the diagonal spans three, which must not be
    taken for two): every attended pair equals the twin's."""
    monkeypatch.setattr(triton_kernels, "TWO_BUCKET_MIN_LENGTH", 0)
    edges = torch.tensor(reference.time_bucket_edges(NUM_BUCKETS), dtype=torch.float32).tolist()
    gen = torch.Generator().manual_seed(3)
    n = 256
    stamps = []
    for jump in [int(edges[b]) - 300 for b in (40, 80, 120)] + [int(1.15 * edges[b]) for b in (50, 110)]:
        steps = torch.randint(0, 4, (n,), generator=gen)
        steps[n // 2] += jump
        stamps.append(torch.cumsum(steps, 0))
    for step in (7, 13, 29):
        stamps.append(step * torch.arange(n))
    spans = {int(reference.time_buckets(s, NUM_BUCKETS)[192:, :64].unique().numel()) for s in stamps}
    assert {1, 2, 3} <= spans, spans  # (the tiles of the last row block against the first key block)
    offsets = torch.arange(0, n * len(stamps) + 1, n).to(DEVICE)
    num_targets = torch.randint(0, 5, (len(stamps),), generator=gen).to(DEVICE) if targets else None
    _assert_attended_pairs_match(
        offsets, torch.cat(stamps).to(DEVICE), torch.randn(2 * n - 1, generator=gen).to(DEVICE),
        torch.randn(NUM_BUCKETS + 1, generator=gen).to(DEVICE), n, torch.float32, num_targets, 0,
    )


def test_rows_by_descriptor_only_where_a_descriptor_reads_them(monkeypatch):
    """A head's rows go through a descriptor only where they start 16 bytes apart, the
    tensor at a multiple of 16 bytes and contiguous, from the head-dim floor on."""
    def rows(dim, dtype=torch.float16):
        return torch.zeros(10, 2, dim, dtype=dtype)

    assert triton_kernels._rows_by_descriptor(rows(128), rows(128, torch.float32))
    assert not triton_kernels._rows_by_descriptor(rows(128), rows(64))  # below ROWS_BY_DESCRIPTOR_MIN_HEAD_DIM
    monkeypatch.setattr(triton_kernels, "ROWS_BY_DESCRIPTOR_MIN_HEAD_DIM", 16)
    assert triton_kernels._rows_by_descriptor(rows(64), rows(24))
    assert not triton_kernels._rows_by_descriptor(rows(50))  # rows 100 bytes apart
    assert not triton_kernels._rows_by_descriptor(torch.zeros(10 * 2 * 64 + 1, dtype=torch.float16)[1:].view(10, 2, 64))
    assert not triton_kernels._rows_by_descriptor(torch.zeros(10, 2, 128, dtype=torch.float16)[..., :64])
    monkeypatch.setattr(triton_kernels, "ROWS_BY_DESCRIPTOR", False)
    assert not triton_kernels._rows_by_descriptor(rows(128))


@pytest.mark.parametrize("rows_by_descriptor", [False, True])
def test_rows_through_descriptors_and_through_pointers_match_the_twin(monkeypatch, rows_by_descriptor):
    """K and V in the forward, Q and dO in the dK dV kernel, read through tensor descriptors
    of a head's rows (with the biases from the prepass, one head a program) or through
    pointers (with the biases from the prepass, or per tile; two heads a program): all
    match the twin, and each launch reads the rows as asked."""
    monkeypatch.setattr(triton_kernels, "ROWS_BY_DESCRIPTOR", rows_by_descriptor)
    monkeypatch.setattr(triton_kernels, "ROWS_BY_DESCRIPTOR_MIN_HEAD_DIM", 32)  # (the case's head dims: 64 and 32)
    launches = []

    def recorded(name):
        launch = getattr(triton_kernels, name)

        def record(grid, args, constants):
            launches.append((name, constants["ROWS_BY_DESCRIPTOR"], constants.get("PAIR")))
            return launch(grid, args, constants)
        return record

    for name in ("_forward", "_backward_kv"):
        monkeypatch.setattr(triton_kernels, name, recorded(name))
    for floor in (0, 1 << 20):  # the prepass, and the biases per tile
        monkeypatch.setattr(triton_kernels, "PAIR_BIAS_TILES_MIN_LENGTH", floor)
        base.test_triton_attention_matches_the_twin_forward_and_backward(LENGTHS[0], torch.float16, 2, 64, 32, True, 3)
    # the prepass's forward and dK dV kernel, then the same per tile
    with_prepass = [("_forward", rows_by_descriptor, not rows_by_descriptor), ("_backward_kv", rows_by_descriptor, None)]
    assert launches == with_prepass + [("_forward", False, True), ("_backward_kv", False, None)]


def test_the_backward_reads_the_pair_biases_the_forward_kept(monkeypatch):
    """With KEEP_PAIR_BIASES the backward reads the forward's pair biases, a view of each
    chunk's sequences where the stored dS runs some sequences at a time (here two chunks:
    the first from sequence 0, the second from the middle), and runs no prepass of its
    own; outputs and gradients match the twin."""
    monkeypatch.setattr(triton_kernels, "KEEP_PAIR_BIASES", True)
    monkeypatch.setattr(triton_kernels, "PAIR_BIAS_TILES_MIN_LENGTH", 0)
    # one head's biases of every sequence fit the budget, two heads' dS of half of them
    lengths = [n * SCALE for n in LENGTHS[0]] * SCALE  # (as the twin test makes them)
    max_seq_len = max(lengths) + 3
    entry = max_seq_len * triton_kernels.score_grads_row_length(max_seq_len) * torch.float16.itemsize
    monkeypatch.setattr(triton_kernels, "SCORE_GRADS_BUFFER_BYTES", len(lengths) * entry)
    chunk = triton_kernels._score_grads_chunk(len(lengths), 2, max_seq_len, torch.float16, torch.device(DEVICE))
    assert chunk == len(lengths) // 2
    calls = []

    def counted(*args):
        calls.append(args[0])
        return bias_tiles.pair_biases(*args)

    monkeypatch.setattr(triton_kernels, "pair_biases", counted)
    base.test_triton_attention_matches_the_twin_forward_and_backward(LENGTHS[0], torch.float16, 2, 50, 64, True, 3)
    assert len(calls) == 1  # the forward's


def test_the_buffers_kept_for_the_backward_stay_within_their_budget(monkeypatch):
    """Two layers' forwards where the budget holds one buffer: the first keeps its pair
    biases, the second's backward runs the prepass again; the gradients match the twin's,
    every buffer is released after the backward, and a forward without gradients keeps
    nothing."""
    monkeypatch.setattr(triton_kernels, "KEEP_PAIR_BIASES", True)
    monkeypatch.setattr(triton_kernels, "PAIR_BIAS_TILES_MIN_LENGTH", 0)
    lengths = [n * SCALE for n in LENGTHS[0]] * SCALE
    max_seq_len = max(lengths) + 3
    tensors, offsets, num_targets = base.case(7, lengths, 2, 32, 32, max_seq_len, torch.float16, True)
    one = len(lengths) * max_seq_len * triton_kernels.score_grads_row_length(max_seq_len) * torch.float16.itemsize
    device = tensors["q"].device
    before = kept_biases.held(device)
    monkeypatch.setattr(kept_biases, "budget", lambda d: before + one)
    calls = []

    def counted(*args):
        calls.append(args[0])
        return bias_tiles.pair_biases(*args)

    monkeypatch.setattr(triton_kernels, "pair_biases", counted)
    grads = {}
    for backend in ("triton", "reference"):
        inputs = {name: t.detach().clone().requires_grad_(t.requires_grad) for name, t in tensors.items()}
        args = (offsets, inputs["timestamps"], inputs["position_bias"], inputs["time_bias"], max_seq_len, num_targets, 3)
        first = hstu_attention(inputs["q"], inputs["k"], inputs["v"], *args, backend=backend)
        second = hstu_attention(first, inputs["k"], inputs["v"], *args, backend=backend)
        if backend == "triton":
            assert kept_biases.held(device) == before + one and len(calls) == 2
        second.float().square().sum().backward()
        grads[backend] = {name: t.grad for name, t in inputs.items() if t.requires_grad}
    assert len(calls) == 3  # both forwards', and the second layer's backward's
    assert kept_biases.held(device) == before
    for name, want in grads["reference"].items():
        assert base.close(grads["triton"][name], want, TOLERANCE[torch.float16] * 8), name
    kept = []
    monkeypatch.setattr(triton_kernels, "keep", lambda biases: kept.append(biases))
    with torch.no_grad():
        hstu_attention(tensors["q"], tensors["k"], tensors["v"], *args, backend="triton")
    assert len(calls) == 4 and not kept
    hstu_attention(tensors["q"], tensors["k"], tensors["v"], *args, backend="triton")
    assert len(calls) == 5 and len(kept) == 1


@pytest.mark.parametrize("by_descriptor", [False, True])
@pytest.mark.parametrize("targets,context_len", [(False, 0), (True, 3)])
def test_attention_from_pair_biases_and_from_biases_per_tile_match_the_twin(monkeypatch, by_descriptor, targets, context_len):
    """The forward and the dK dV kernel reading the prepass's pair biases (through a tensor
    descriptor, or pointers as before Hopper), and computing them per tile (below
    PAIR_BIAS_TILES_MIN_LENGTH), both match the twin; the reads take place (a prepass that
    writes 0 fails). The backward runs its own prepass here (KEEP_PAIR_BIASES off)."""
    monkeypatch.setattr(triton_kernels, "KEEP_PAIR_BIASES", False)
    monkeypatch.setattr(triton_kernels, "_descriptor_stores", lambda device: by_descriptor)
    monkeypatch.setattr(triton_kernels, "PAIR_BIAS_TILES", True)
    monkeypatch.setattr(triton_kernels, "PAIR_BIAS_TILES_MIN_LENGTH", 0)
    calls = []

    def counted(*args):
        calls.append(args[0])
        return bias_tiles.pair_biases(*args)

    monkeypatch.setattr(triton_kernels, "pair_biases", counted)
    base.test_triton_attention_matches_the_twin_forward_and_backward(LENGTHS[0], torch.float16, 2, 50, 64, targets, context_len)
    assert len(calls) == 2  # the forward's, and the backward's again
    monkeypatch.setattr(triton_kernels, "PAIR_BIAS_TILES_MIN_LENGTH", 1 << 20)  # below the floor: per tile
    base.test_triton_attention_matches_the_twin_forward_and_backward(LENGTHS[0], torch.float16, 2, 50, 64, targets, context_len)
    assert len(calls) == 2


@pytest.mark.parametrize("targets,context_len", [(False, 0), (True, 3)])
def test_runs_of_unmasked_tiles_match_the_twin(monkeypatch, targets, context_len):
    """Sequences of several unmasked tiles in a row (the interpreter's tiles are 64 rows),
    where the forward and the dK dV kernel load each tile's pair biases while the tile
    before it computes: outputs and gradients match the twin (biases of the wrong tile, or
    of none, fail)."""
    monkeypatch.setattr(triton_kernels, "PAIR_BIAS_TILES_MIN_LENGTH", 0)
    base.test_triton_attention_matches_the_twin_forward_and_backward([200, 131, 0, 7], torch.float16, 2, 16, 32, targets, context_len)
