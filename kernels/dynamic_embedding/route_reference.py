"""PyTorch twin of route_kernels.py, with the same signature."""
import torch

from .hashing import hash64, shard_of

_LOW63 = (1 << 63) - 1


def route_codes_reference(keys: torch.Tensor, tids: torch.Tensor, world: int, tables: int, shift: int) -> torch.Tensor:
    """(N,) int64: (shard_of(key) · tables + table) << shift, or'ed with the key's 63-bit
    hash shifted right by 63 - shift."""
    bins = shard_of(keys, world) * tables + tids.to(torch.int64)
    return (bins << shift) | ((hash64(keys) & _LOW63) >> (63 - shift))
