"""Moving rows between the device tier and the host tier of a tiered table in one pass.

`swap_in` gives a call's keys device rows: rows found in host memory move up, the device
rows their inserts evict move down, and new keys get their initial rows, all by lanes
(one key each) with masks, so that nothing waits for the GPU. It serves Triton tables in
fast mode whose tiers are allocated at their full capacity (they never grow); other
tables take DynamicEmbedding's general path, its oracle in the tests.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..launch import launch, next_power_of_2
from .hashing import EMPTY_KEY
from .multi_table_kernels import _initial_embedding
from .claim_kernels import claim
from .probe_kernels import K_EMPTY_KEY, _grid, probe
from .slot_kernels import copy_rows
from .triton_table import TritonHashTable

INIT_BLOCK = 64  # lanes per program of row initialisation, which most lanes skip


@triton.jit
def _initial_rows_kernel(
    key_ptr, host_slot_ptr, slot_ptr, inserted_ptr, rows_ptr, n, seed, scale, dim, row_dim,
    BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr,
):
    """rows[i] = key i's initial row (embedding, zero optimizer state) where the key has no
    host row and needs one: it was inserted on the device, or it has no device row."""
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lanes < n
    key = tl.load(key_ptr + lanes, mask=live, other=K_EMPTY_KEY)
    need = live & (key != K_EMPTY_KEY) & (tl.load(host_slot_ptr + lanes, mask=live, other=0) < 0)
    need = need & ((tl.load(inserted_ptr + lanes, mask=live, other=0) != 0) | (tl.load(slot_ptr + lanes, mask=live, other=0) < 0))
    if tl.max(need.to(tl.int32), axis=0) > 0:
        row = rows_ptr + lanes[:, None].to(tl.int64) * row_dim
        seeds, scales = seed + tl.zeros([BLOCK], tl.int64), scale + tl.zeros([BLOCK], tl.float64)
        for c in range(0, dim, DIM_BLOCK):
            cols = c + tl.arange(0, DIM_BLOCK)
            tl.store(row + cols[None, :], _initial_embedding(key, seeds, scales, cols), mask=need[:, None] & (cols[None, :] < dim))
        for c in range(dim, row_dim, DIM_BLOCK):
            cols = c + tl.arange(0, DIM_BLOCK)
            tl.store(row + cols[None, :], tl.zeros([BLOCK, DIM_BLOCK], tl.float32), mask=need[:, None] & (cols[None, :] < row_dim))


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
    host_slots = probe(host.descriptor(), keys, host.bucket_size, host.row_stride)
    copy_rows(host.values, host_slots, rows, None, host.row_dim)
    slots, inserted, evicted, victim_keys, victim_scores = claim(device.descriptor(), keys, scores, device.bucket_size)
    device.placements += 1
    seed, scale, dim = init
    if n:
        launch(
            _initial_rows_kernel, _grid(n, INIT_BLOCK),
            keys, host_slots, slots, inserted.view(torch.int8), rows, n, seed, scale, dim, device.row_dim, BLOCK=INIT_BLOCK,
            DIM_BLOCK=min(64, next_power_of_2(dim)),
        )
    promoted = inserted & (host_slots >= 0)
    host._clear(torch.where(promoted, host_slots, -1))  # their rows are in `rows` now
    # one host claim per lane: an evicting lane's victim (its slot still holds the
    # victim's row: it moves down before the new row comes in), or a key left without a
    # device row
    rowless = (slots < 0) & (keys != EMPTY_KEY)
    down, down_inserted, host_evicted, _, _ = claim(
        host.descriptor(), torch.where(evicted, victim_keys, torch.where(rowless, keys, EMPTY_KEY)),
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
