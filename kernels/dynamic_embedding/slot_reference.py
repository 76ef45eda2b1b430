"""The slot and row operations of slot_kernels.py in plain PyTorch: each function here has
the signature of the launcher of the same name there, less `_reference`, and is its twin
in tests/test_slot_kernels.py. Loops over lanes where that states the rule plainest; no
helper is shared with the kernels.
"""
import torch

from .hashing import EMPTY_KEY, hash64

EXPORT_BLOCK = 256  # as slot_kernels.EXPORT_BLOCK: count_rows reports where each block starts


def _digests(keys: torch.Tensor) -> torch.Tensor:
    """The hash's top byte, 1 where it is 0 (0 marks an empty slot)."""
    d = (hash64(keys) >> 56) & 0xFF
    return torch.where(d == 0, 1, d).to(torch.uint8)


def release_slots_reference(slots, keys, scores, digests) -> None:
    s = slots[slots >= 0]
    keys[s], scores[s], digests[s] = EMPTY_KEY, 0, 0


def choose_slots_reference(buckets, ranks, new_scores, keys, digests, scores, marks, call, bucket_size, evict):
    m = buckets.numel()
    slots = torch.full((m,), -1, dtype=torch.int64, device=buckets.device)
    victim_keys = victim_scores = victims = None
    if evict:
        victim_keys, victim_scores = torch.zeros_like(slots), torch.zeros_like(slots)
        victims = torch.zeros(m, dtype=torch.int8, device=buckets.device)
    for i in range(m):
        bucket_slots = torch.arange(int(buckets[i]) * bucket_size, (int(buckets[i]) + 1) * bucket_size, device=buckets.device)
        free = bucket_slots[digests[bucket_slots] == 0]
        rank = int(ranks[i])
        if rank < free.numel():
            slots[i] = free[rank]
            continue
        if not evict:
            continue
        held = bucket_slots[(digests[bucket_slots] != 0) & (marks[bucket_slots] != call)]
        # the lowest (score, slot) first: a stable sort by score of slots in order
        held = held[torch.sort(scores[held], stable=True).indices]
        nth = rank - free.numel()
        if nth < held.numel() and int(scores[held[nth]]) <= int(new_scores[i]):
            slots[i] = held[nth]
            victim_keys[i], victim_scores[i], victims[i] = keys[held[nth]], scores[held[nth]], 1
    return slots, victim_keys, victim_scores, victims


def write_slots_reference(slots, new_keys, new_scores, keys, scores, digests) -> None:
    ok = slots >= 0
    s, k = slots[ok], new_keys[ok]
    keys[s], scores[s], digests[s] = k, new_scores[ok], _digests(k)


def count_rows_reference(keys, scores, min_score):
    kept = keys != EMPTY_KEY
    if min_score is not None:
        kept &= scores >= min_score
    blocks = -(-keys.numel() // EXPORT_BLOCK)
    per_block = torch.zeros(blocks * EXPORT_BLOCK, dtype=torch.int64, device=keys.device)
    per_block[: keys.numel()] = kept.long()
    counts = per_block.view(blocks, EXPORT_BLOCK).sum(1)
    return torch.cumsum(counts, 0) - counts, int(counts.sum())


def export_rows_reference(keys, scores, values, min_score, starts, out_keys, out_values, out_scores) -> None:
    kept = keys != EMPTY_KEY
    if min_score is not None:
        kept &= scores >= min_score
    out_keys[:], out_values[:], out_scores[:] = keys[kept], values[kept], scores[kept]


def copy_rows_reference(src, src_slots, dst, dst_slots, width, whole_rows=False, marks=None) -> None:
    n = (src_slots if src_slots is not None else dst_slots).numel()
    lanes = torch.arange(n, device=dst.device)
    s = src_slots if src_slots is not None else lanes
    d = dst_slots if dst_slots is not None else lanes
    # rows whole to their stride: the storage's columns past the view's
    full = torch.as_strided(dst, (dst.shape[0], dst.stride(0)), (dst.stride(0), 1)) if whole_rows else dst
    written = set()
    for i in range(n):
        si, di = int(s[i]), int(d[i])
        if si < 0 or di < 0 or (marks is not None and di in written):
            continue  # with marks, one lane per destination writes (the kernel's first to swap)
        written.add(di)
        full[di, :width] = src[si, :width]
        if whole_rows:
            full[di, width:] = 0
        if marks is not None:
            marks[di] = -1


def gather_victims_reference(evicted, slots, victim_keys, victim_scores, values, out_keys, out_scores, out_rows, count) -> None:
    """gather_victims, the victims in lane order."""
    lanes = evicted.nonzero().squeeze(1)
    start = int(count)
    end = start + lanes.numel()
    out_keys[start:end] = victim_keys[lanes]
    out_scores[start:end] = victim_scores[lanes]
    out_rows[start:end] = values[slots[lanes]]
    count += lanes.numel()
