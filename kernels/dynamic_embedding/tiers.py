"""Moving rows between the device tier and the host tier of a tiered table in one pass.

`swap_in` gives a call's keys device rows: rows found in host memory move up, the device
rows their inserts evict move down, and new keys get their initial rows, all by lanes
(one key each) with masks, so that nothing waits for the GPU. It serves Triton tables in
fast mode whose tiers are allocated at their full capacity (they never grow); other
tables take DynamicEmbedding's general path, its oracle in the tests.
"""
from typing import NamedTuple

import torch

from .hashing import EMPTY_KEY
from .claim_kernels import claim
from .probe_kernels import probe
from .slot_kernels import copy_rows, initial_rows
from .triton_table import TritonHashTable


class Swapped(NamedTuple):
    """swap_in's result, on the device. Per lane (N,): slots, the device slot (-1: none);
    inserted, whether the lane's key was inserted there (one copy of a key is); promoted,
    whether its row came up from the host tier; held, whether a key without a device row
    has a host row after the call; made, whether that host row was made by the call.
    Counts: demoted, device rows moved to the host tier; lost, rows that no tier kept."""

    slots: torch.Tensor
    inserted: torch.Tensor
    promoted: torch.Tensor
    held: torch.Tensor
    made: torch.Tensor
    demoted: torch.Tensor
    lost: torch.Tensor


def swap_in(
    device: TritonHashTable, host: TritonHashTable, keys: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor,
    init: tuple[int, float, int],
) -> Swapped:
    """Device rows for `keys` (N,) with `scores` (EMPTY_KEY lanes: skipped; copies of a
    key share its row, and one of them is reported inserted).

    rows (N, row_dim) float32, contiguous, receives for each key without a device row, or
    inserted there, the row it had outside the device tier: its host row where host
    memory has one, else its initial row (init: seed, scale and dim of the embedding: as
    DynamicEmbedding.initial_rows). A key found in host memory moves to the device
    (promoted); a key in neither tier is inserted with its initial row. Device rows that
    the inserts evict move to host memory (demoted). A key the device tier cannot take
    (its bucket's rows all used by this call, or of higher scores) keeps its host row,
    whose score it raises, or is given one there with its initial row: its row is then
    trained in host memory. The host tier takes both in one claim, so none of them evicts
    another's row; a full host bucket evicts its lowest-score row not used by the call
    (lost).
    """
    n = keys.numel()
    host_slots = probe(host.stack, keys, host.bucket_size, host.row_stride)
    copy_rows(host.values, host_slots, rows, None, host.row_dim)
    slots, inserted, evicted, victim_keys, victim_scores = claim(device.stack, keys, scores, device.bucket_size)
    device.placements += 1
    initial_rows(keys, host_slots, slots, inserted, rows, *init)
    promoted = inserted & (host_slots >= 0)
    host._clear(torch.where(promoted, host_slots, -1))  # their rows are in `rows` now
    # one host claim per lane: an evicting lane's victim (its slot still holds the
    # victim's row: it moves down before the new row comes in), or a key left without a
    # device row
    rowless = (slots < 0) & (keys != EMPTY_KEY)
    down, down_inserted, host_evicted, _, _ = claim(
        host.stack, torch.where(evicted, victim_keys, torch.where(rowless, keys, EMPTY_KEY)),
        torch.where(evicted, victim_scores, scores), host.bucket_size,
    )
    host.placements += 1
    copy_rows(device.values, torch.where(evicted, slots, -1), host.values, down, device.row_dim, whole_rows=True)
    made = rowless & down_inserted
    copy_rows(rows, torch.where(made, torch.arange(n, device=keys.device), -1), host.values, down, device.row_dim, whole_rows=True)
    copy_rows(rows, None, device.values, torch.where(inserted, slots, -1), device.row_dim)
    demoted = (evicted & (down >= 0)).sum()
    lost = (evicted & (down < 0)).sum() + host_evicted.sum()
    return Swapped(slots, inserted, promoted, rowless & (down >= 0), made, demoted, lost)
