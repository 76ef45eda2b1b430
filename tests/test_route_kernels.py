"""The route codes of route_kernels.py against their PyTorch twin (route_reference.py):
int64 extremes, every table and owner, an empty call; and that sorted codes group lanes by
owner and table as shard_of places them. On CPU the kernel runs under TRITON_INTERPRET=1."""
import pytest
import torch

from kernels.dynamic_embedding import shard_of
from kernels.dynamic_embedding.route_kernels import ROUTE_BLOCK, route_codes
from kernels.dynamic_embedding.route_reference import route_codes_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXTREMES = [-(2**63), -(2**63) + 1, -1, 0, 1, 2**63 - 1]


@pytest.mark.parametrize("n, world, tables", [(ROUTE_BLOCK + 37, 2, 10), (300, 8, 3), (5, 3, 1), (0, 2, 2)])
def test_route_codes_match_the_twin_and_group_by_owner_and_table(n, world, tables):
    g = torch.Generator().manual_seed(n + world)
    keys = torch.cat([torch.tensor(EXTREMES), torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)])[: n + len(EXTREMES) * (n > 0)]
    copies = n // 3
    if copies:
        keys[-copies:] = keys[:copies]  # copies of ids
    tids = torch.randint(0, tables, (keys.numel(),), generator=g, dtype=torch.int32)
    shift = 63 - max(1, (world * tables - 1).bit_length())
    want = route_codes_reference(keys, tids, world, tables, shift)
    got = route_codes(keys.to(DEVICE), tids.to(DEVICE), world, tables, shift).cpu()
    assert torch.equal(got, want)
    assert bool((got >= 0).all())
    assert torch.equal(got >> shift, shard_of(keys, world) * tables + tids)  # the bin: owner, then table
    same_key = keys[:, None] == keys[None, :]
    assert bool((got[:, None] == got[None, :])[same_key & (tids[:, None] == tids[None, :])].all())  # copies: one code
