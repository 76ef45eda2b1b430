"""The probe (probe_kernels.probe) against its PyTorch twin (probe_reference.py) on fresh
random tables: one table and several (tids), bucket sizes that read digests in one word,
in one half or in two, stored, absent, duplicated and reserved keys, a key whose hash's
top byte is 0, a device count of keys, rows wider and narrower than what is read. On CPU
the kernel runs under TRITON_INTERPRET=1."""
import pytest
import torch

from kernels.dynamic_embedding.hashing import EMPTY_KEY, hash64
from kernels.dynamic_embedding.probe_kernels import TableStack, probe
from kernels.dynamic_embedding.probe_reference import probe_reference
from kernels.dynamic_embedding.triton_table import TritonHashTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROW_DIM = 6


def low_digest_key() -> int:
    """A key whose hash's top byte is 0 (its digest is stored as 1)."""
    k = torch.arange(1, 5000, dtype=torch.int64)
    return int(k[((hash64(k) >> 56) & 0xFF) == 0][0])


def stack_of(seed: int, tables: int, bucket_size: int) -> TableStack:
    g = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(tables):
        t = TritonHashTable(ROW_DIM, capacity=2 * bucket_size, max_capacity=2 * bucket_size, bucket_size=bucket_size,
                            device=DEVICE, deterministic=False)
        keys = torch.cat([torch.randint(-300, 300, (bucket_size + bucket_size // 2,), generator=g),
                          torch.tensor([low_digest_key()])]).unique()
        t.insert_or_assign(keys.to(DEVICE), torch.randn(keys.numel(), ROW_DIM, generator=g).to(DEVICE),
                           torch.randint(1, 50, (keys.numel(),), generator=g).to(DEVICE))
        made.append(t)
    return TableStack(torch.stack([t.descriptor() for t in made]), made)


def queries(seed: int, n: int, tables: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-400, 400, (n,), generator=g)
    keys[::7] = EMPTY_KEY
    keys[1::11] = low_digest_key()
    tids = torch.randint(0, tables, (n,), generator=g)
    return keys.to(DEVICE), tids.to(DEVICE)


@pytest.mark.parametrize("bucket_size,tables", [(4, 3), (16, 1), (16, 3), (128, 1)])
def test_probe_finds_what_its_twin_finds(bucket_size, tables):
    stack = stack_of(bucket_size + tables, tables, bucket_size)
    keys, tids = queries(bucket_size * tables, 160, tables)
    tids = tids if tables > 1 else None
    row_stride = stack.tables[0].row_stride
    results = []
    for fn in (probe, probe_reference):
        out = torch.full((keys.numel(), ROW_DIM - 2), -7.0, device=DEVICE)  # untouched where not found
        scores = torch.full((keys.numel(),), -5, dtype=torch.int64, device=DEVICE)
        slots = fn(stack, keys, bucket_size, row_stride, tids, out=out, scores=scores)
        found = fn(stack, keys, bucket_size, row_stride, tids, found_only=True)
        results.append((slots, found, out, scores))
    (slots, found, out, scores), (want_slots, want_found, want_out, want_scores) = results
    assert torch.equal(slots, want_slots) and torch.equal(found, want_found) and torch.equal(found, slots >= 0)
    assert torch.equal(out, want_out) and torch.equal(scores, want_scores)
    assert 0 < int(found.sum()) < keys.numel() and not bool(found[keys == EMPTY_KEY].any())
    assert bool(found[keys == low_digest_key()].any())  # stored in some table: found there


def test_probe_of_a_device_count_leaves_the_rest():
    stack = stack_of(1, 3, 8)
    keys, tids = queries(2, 100, 3)
    count = torch.tensor([61], dtype=torch.int32, device=DEVICE)
    got = [fn(stack, keys, 8, 0, tids, count=count) for fn in (probe, probe_reference)]
    assert torch.equal(got[0][:61], got[1][:61])


def test_probe_of_nothing():
    stack = stack_of(3, 1, 8)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert probe(stack, empty, 8, stack.tables[0].row_stride).numel() == 0
    assert probe_reference(stack, empty, 8, stack.tables[0].row_stride).numel() == 0
