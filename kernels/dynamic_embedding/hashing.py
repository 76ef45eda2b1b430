"""Key hashing shared by bucket placement and shard placement.

The hash is MurmurHash3's 64-bit finalizer computed with wrapping int64 arithmetic, so the
same function runs on CPU and CUDA tensors (and in a Triton kernel on uint64).
"""
import torch

# The one reserved key value: marks an empty slot. Every other int64 is a valid id.
EMPTY_KEY = -(2**63)

_M1 = 0xFF51AFD7ED558CCD - 2**64  # the finalizer's constants as signed int64
_M2 = 0xC4CEB9FE1A85EC53 - 2**64
_LOW31 = (1 << 31) - 1
_LOW63 = (1 << 63) - 1


def _xorshift33(x: torch.Tensor) -> torch.Tensor:
    # logical right shift by 33 on int64: arithmetic shift, then drop the sign-extended bits
    return x ^ ((x >> 33) & _LOW31)


def hash64(keys: torch.Tensor) -> torch.Tensor:
    """Mixes int64 keys into well-spread int64 hashes (wrapping arithmetic)."""
    h = _xorshift33(keys.to(torch.int64))
    h = _xorshift33(h * _M1)
    return _xorshift33(h * _M2)


def bucket_of(keys: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket index in [0, num_buckets) from the hash's low 63 bits."""
    return (hash64(keys) & _LOW63) % num_buckets


def shard_of(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """Owning rank from the hash's high 31 bits, independent of the bucket bits."""
    return ((hash64(keys) >> 32) & _LOW31) % world_size


def uniform_from_keys(keys: torch.Tensor, columns: int, seed: int) -> torch.Tensor:
    """Deterministic uniform [0, 1) numbers, one per (key, column), as float64 (N, columns).

    A row's initial value depends only on its key and the seed, never on which rank or in
    which order it was first seen, so every world size builds the same table.
    """
    col = torch.arange(columns, dtype=torch.int64, device=keys.device)
    mixed = hash64(hash64(keys.to(torch.int64) ^ seed)[:, None] + col[None, :])
    return ((mixed >> 11) & ((1 << 53) - 1)).to(torch.float64) * (1.0 / (1 << 53))
