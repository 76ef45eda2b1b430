"""Per-key reductions over a batch of ids with copies: each key's highest score, the sum of
its rows, its first or last copy. Both table backends, the embedding and its sharded form
reduce batches with these."""
import torch


def highest_per_key(n_keys: int, inverse: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """(n_keys,) int64: the highest of the scores whose inverse index names each key."""
    out = torch.full((n_keys,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=inverse.device)
    return out.scatter_reduce_(0, inverse, scores.to(inverse.device, torch.int64), "amax")


def sum_by_key(
    keys: torch.Tensor, rows: torch.Tensor, deterministic: bool = True, dedup: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique keys ascending, sum of each key's rows, inverse index). deterministic: rows
    are added in a fixed order on every device; else on CUDA with atomics (index_add_),
    much faster, in an order that varies in the last bits. dedup: torch.unique's (keys,
    inverse, counts) of `keys`, when known."""
    uniq, inverse, counts = dedup or torch.unique(keys, return_inverse=True, return_counts=True)
    if deterministic and keys.is_cuda and keys.numel():
        order = torch.argsort(inverse, stable=True)
        return uniq, torch.segment_reduce(rows[order], "sum", lengths=counts, axis=0), inverse
    sums = rows.new_zeros(uniq.numel(), *rows.shape[1:]).index_add_(0, inverse, rows)  # in order on CPU
    return uniq, sums, inverse


def _nth_copy(keys: torch.Tensor, reduce: str) -> torch.Tensor:
    """(N,) bool: True at the first (amin) or last (amax) copy of each key."""
    uniq, inverse = torch.unique(keys, return_inverse=True)
    pick = torch.zeros(uniq.numel(), dtype=torch.int64, device=keys.device)
    pick.scatter_reduce_(0, inverse, torch.arange(keys.numel(), device=keys.device), reduce, include_self=False)
    mask = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
    mask[pick] = True
    return mask


def first_copy(keys: torch.Tensor) -> torch.Tensor:
    return _nth_copy(keys, "amin")


def last_copy(keys: torch.Tensor) -> torch.Tensor:
    return _nth_copy(keys, "amax")
