"""A Triton kernel for the sharded collection's routing: each lane's route code, one int64
whose sort groups the lanes by owner rank, then table, then id (see route_codes). One
launch in place of the dozen elementwise operations of hashing, owner and table in
PyTorch. The PyTorch twin of the same signature is in route_reference.py
(tests/test_route_kernels.py holds them together).
"""
import torch
import triton
import triton.language as tl

from ..launch import cdiv, launch
from .probe_kernels import _hash

ROUTE_BLOCK = 1024  # lanes a program codes


@triton.jit(do_not_specialize=["n"])
def _route_code_kernel(keys_ptr, tids_ptr, n, world, tables, shift, codes_ptr, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = p < n
    h = _hash(tl.load(keys_ptr + p, mask=live, other=0))
    owner = ((h >> 32) & 0x7FFFFFFF).to(tl.int64) % world
    bin = owner * tables + tl.load(tids_ptr + p, mask=live, other=0).to(tl.int64)
    low = ((h & 0x7FFFFFFFFFFFFFFF) >> (63 - shift)).to(tl.int64)
    tl.store(codes_ptr + p, (bin << shift) | low, mask=live)


def route_codes(keys: torch.Tensor, tids: torch.Tensor, world: int, tables: int, shift: int) -> torch.Tensor:
    """(N,) int64 codes of the lanes' int64 keys (N,) and tables tids (N,): the lane's bin
    (owner · tables + table, the owner shard_of's) in the bits from `shift` up, below it
    the top bits of the key's 63-bit hash; every bin < 2^(63 - shift), so codes are >= 0.
    Sorted codes keep each bin in one span and copies of an id adjacent (ids whose hashes
    share those top bits may interleave: the caller tells them apart by key)."""
    n = keys.numel()
    codes = torch.empty(n, dtype=torch.int64, device=keys.device)
    if n:
        launch(_route_code_kernel, (cdiv(n, ROUTE_BLOCK),), keys, tids, n, world, tables, shift, codes, BLOCK=ROUTE_BLOCK)
    return codes
