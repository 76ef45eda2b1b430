"""tier_kernels.py's launchers in plain PyTorch: each function here has the signature of
the launcher of the same name there, less `_reference`, and is its twin in the
differential tests (tests/test_tier_kernels.py). Twins read the tables as tensors
(`stack.tables`), where the kernels read their descriptors; nothing here shares code with
the kernels."""
import torch

from .counters import EVICTIONS, HITS, INSERTS, LOOKUPS, REJECTIONS
from .hashing import EMPTY_KEY

PROTECT, RELEASE = 0, 1  # mark_tier_slots' actions (tier_kernels.PROTECT, RELEASE)
HIGHEST_SCORE = 2**63 - 1


def _live(n: int, count: torch.Tensor | None, device) -> torch.Tensor:
    lanes = torch.arange(n, device=device)
    return lanes < (int(count[0]) if count is not None else n)


def _full_rows(table) -> torch.Tensor:
    """A table's rows with their padding, as stored: (capacity, row_stride)."""
    v = table.values
    return torch.as_strided(v, (v.shape[0], v.stride(0)), (v.stride(0), 1))


def exchange_tier_rows_reference(stack, tids, slots, down, up, host, width, count=None, tiles=None) -> None:
    # (tiles, the kernel's tiling, changes nothing that moves)
    live = _live(tids.numel(), count, tids.device) & (slots >= 0)
    lanes = live.nonzero().flatten().tolist()
    # every row read first, then written
    going = {i: stack.tables[int(tids[i])].values[int(slots[i]), :width].clone() for i in lanes if int(down[i]) >= 0}
    coming = {i: stack.tables[int(tids[i]) + host].values[int(up[i]), :width].clone() for i in lanes if int(up[i]) >= 0}
    for i, row in going.items():
        full = _full_rows(stack.tables[int(tids[i]) + host])[int(down[i])]
        full[:width], full[width:] = row, 0
    for i, row in coming.items():
        stack.tables[int(tids[i])].values[int(slots[i]), :width] = row


def mark_tier_slots_reference(stack, tids, slots, offset, action, count=None) -> None:
    live = _live(tids.numel(), count, tids.device) & (slots >= 0)
    for lane in live.nonzero().flatten().tolist():
        table, slot = stack.tables[int(tids[lane]) + offset], int(slots[lane])
        if action == PROTECT:
            table.scores[slot] = HIGHEST_SCORE
        else:
            table.keys[slot], table.scores[slot], table.digests[slot] = EMPTY_KEY, 0, 0


def count_swap_reference(tids, keys, swapped, count, inserting, counts, moves, train) -> None:
    live = _live(tids.numel(), count, tids.device)
    table = tids.long()[live]
    s = {name: getattr(swapped, name)[live] for name in ("slots", "inserted", "promoted", "held", "made", "demoted", "lost")}

    def add(target: torch.Tensor, column: int, lanes: torch.Tensor) -> None:
        target[:, column] += torch.bincount(table[lanes], minlength=target.shape[0])

    add(moves, 0, s["promoted"])
    add(moves, 1, s["demoted"])
    add(counts, EVICTIONS, s["lost"])
    if train:
        on_device = s["slots"] >= 0
        add(counts, LOOKUPS, torch.ones_like(table, dtype=torch.bool))
        # a hit: found on the device, or brought up, or found in host memory and kept there
        add(counts, HITS, (on_device & ~s["inserted"]) | s["promoted"] | (s["held"] & ~s["made"]))
        # an insert: a new row on the device, or made in host memory
        add(counts, INSERTS, (s["inserted"] & ~s["promoted"]) | s["made"])
        no_row = (keys[live] != EMPTY_KEY) & ~on_device & ~s["held"]
        add(counts, REJECTIONS, no_row & inserting.bool()[table])


def host_claim_lanes_reference(
    keys, tids, slots, inserted, evicted, victim_keys, victim_scores, from_host, barred, scores, score_offset, table_scores, count,
):
    live = _live(keys.numel(), count, keys.device) & (keys != EMPTY_KEY)
    inserted, evicted = inserted & live, evicted & live
    promoted = inserted & (from_host >= 0)
    up = torch.where(promoted, from_host, torch.full_like(from_host, -1))
    rowless = live & (slots < 0) & (~barred if barred is not None else True)
    if table_scores:
        lane_scores = scores[torch.where(live, tids.long(), 0)] + score_offset
    else:
        lane_scores = scores
    host_keys = torch.full_like(keys, EMPTY_KEY)
    host_keys[rowless] = keys[rowless]
    host_keys[evicted] = victim_keys[evicted]
    host_scores = torch.where(live, lane_scores, 0)  # (unread where the key is reserved)
    host_scores[evicted] = victim_scores[evicted]
    return inserted, evicted, promoted, up, rowless, host_keys, host_scores


def swap_outcome_reference(keys, inserted, evicted, promoted, rowless, down, down_inserted, host_evicted, count):
    live = _live(keys.numel(), count, keys.device) & (keys != EMPTY_KEY)
    evicted, rowless = evicted & live, rowless & live
    with_row = live & (down >= 0)
    going = torch.where(evicted, down, -1)
    fresh = live & inserted & ~promoted
    made = rowless & down_inserted
    return going, fresh, made, rowless & with_row, evicted & with_row, (evicted & ~with_row) | (live & host_evicted)
