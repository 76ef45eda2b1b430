"""The claim (claim_kernels.claim) in plain PyTorch and Python: claim_reference has
claim's signature and is its twin in the differential tests (tests/test_claim_kernels.py).

The twin takes the call's keys one after the other, in lane order, where the kernel's
threads race: in its first phase a key finds itself or takes its bucket's first empty
slot; a key whose bucket is full joins the bucket's list, and in the second phase each
list is taken from its last key to its first (the kernel's lists are stacks, pushed in an
order that thread timing sets). So the twin gives one of the outcomes the kernel may
give: the same where no two keys of a call race for one bucket, and one the kernel could
have reached where they do (the tests compare invariants there).

It reads the stack's tables as tensors (keys, scores, values) and each table's insertion
mode from its descriptor; it keeps the rows this call uses in a set, where the kernel
marks them with the call's id (the twin leaves the marks as they were). Nothing here
calls a kernel or shares a helper with one (the digests are slot_reference's).
"""
import torch

from .counters import EVICTIONS, HITS, INSERTS
from .hashing import EMPTY_KEY, bucket_of
from .probe_kernels import _MODE, EVICT, GROW, READ_ONLY
from .slot_reference import _digests

GROW_SLOT, WAITING = -2, -3  # a key's slot when its full bucket must grow, or while it waits to evict


class _Table:
    """One table's keys and scores as Python lists while the call runs, written back after."""

    def __init__(self, table, bucket_size: int, mode: int):
        self.table, self.bucket_size, self.mode = table, bucket_size, mode
        self.keys, self.scores = table.keys.tolist(), table.scores.tolist()
        self.num_buckets = len(self.keys) // bucket_size
        self.used: set[int] = set()  # slots this call found or stored
        self.stored: dict[int, int] = {}  # slot -> key, of the slots this call stored

    def bucket(self, key: int) -> int:
        return int(bucket_of(torch.tensor([key]), self.num_buckets)[0])

    def columns(self, bucket: int) -> range:
        return range(bucket * self.bucket_size, (bucket + 1) * self.bucket_size)

    def store(self, slot: int, key: int, score: int) -> None:
        self.keys[slot], self.scores[slot] = key, score
        self.used.add(slot)
        self.stored[slot] = key

    def write_back(self) -> None:
        t = self.table
        t.scores.copy_(torch.tensor(self.scores))  # found rows' scores rise too
        if self.stored:
            slots = sorted(self.stored)
            at = torch.tensor(slots, device=t.keys.device)
            t.keys[at] = torch.tensor([self.stored[s] for s in slots], device=t.keys.device)
            t.digests[at] = _digests(t.keys[at])


def claim_reference(
    stack, keys: torch.Tensor, scores: torch.Tensor, bucket_size: int, tids: torch.Tensor | None = None,
    table_scores: bool = False, counts: torch.Tensor | None = None, count: torch.Tensor | None = None,
    refuse: torch.Tensor | None = None, rows: torch.Tensor | None = None, row_stride: int = 0, victims: bool = True,
    assign: bool = False, score_offset: int = 0, barred: torch.Tensor | None = None, force: bool = False,
):
    """claim's result and effects, the keys taken in lane order (module docstring).
    Returns (slots, inserted, evicted, victim_keys, victim_scores) (N,); the last three
    None without victims. Lanes past `count`, and every lane when `refuse` is set, are
    left -1 and not inserted, and the tables are left as they were."""
    n, dev = keys.numel(), keys.device
    slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
    flags = torch.zeros(2, n, dtype=torch.bool, device=dev)  # inserted, evicted
    victim_keys, victim_scores = torch.zeros(n, dtype=torch.int64, device=dev), torch.zeros(n, dtype=torch.int64, device=dev)
    live = n if count is None else int(count.reshape(-1)[0])
    if refuse is not None and bool(refuse.reshape(-1)[0]):
        live = 0
    key_list, score_list = keys.tolist(), scores.tolist()
    table_of = tids.tolist() if tids is not None else [0] * n
    barred_list = barred.tolist() if barred is not None else [False] * n
    modes = stack.desc.view(len(stack.tables), -1)[:, _MODE.value].tolist()
    tables = [_Table(t, bucket_size, m) for t, m in zip(stack.tables, modes)]
    slot_of = [-1] * n

    def score(i: int) -> int:
        return score_list[table_of[i]] + score_offset if table_scores else score_list[i]

    def inserted_at(i: int, t: int, slot: int) -> None:
        slot_of[i] = slot
        flags[0, i] = True
        if counts is not None:
            counts[t, INSERTS] += 1
            counts[t, HITS] -= 1

    # phase 0: find, or take the bucket's first empty slot; a key of a full bucket waits
    lists: dict[tuple[int, int], list[int]] = {}
    for i in range(live):
        key, t = key_list[i], table_of[i]
        if key == EMPTY_KEY:
            continue
        tab = tables[t]
        b = tab.bucket(key)
        cols = tab.columns(b)
        hit = next((s for s in cols if tab.keys[s] == key), None)
        if hit is not None:
            tab.scores[hit] = max(tab.scores[hit], score(i))
            tab.used.add(hit)
            slot_of[i] = hit
            continue
        may_insert = tab.mode != READ_ONLY and not barred_list[i]
        empty = next((s for s in cols if tab.keys[s] == EMPTY_KEY), None)
        if may_insert and empty is not None:
            tab.store(empty, key, score(i))
            inserted_at(i, t, empty)
        elif may_insert and tab.mode == GROW:
            slot_of[i] = GROW_SLOT
        elif may_insert and tab.mode == EVICT:
            slot_of[i] = WAITING
            lists.setdefault((t, b), []).append(i)
    # phase 1: each list from its last key to its first, alone in its bucket
    for (t, b), waiting in lists.items():
        tab = tables[t]
        stored_here: dict[int, int] = {}  # key -> slot, of the keys this list stored
        for i in reversed(waiting):
            key = key_list[i]
            if key in stored_here:  # a copy of a key the list stored
                s = stored_here[key]
                tab.scores[s] = max(tab.scores[s], score(i))
                slot_of[i] = s
                continue
            free = [s for s in tab.columns(b) if s not in tab.used]
            victim = min(free, key=lambda s: (tab.scores[s], s), default=None)
            if victim is None or (tab.scores[victim] > score(i) and not force):
                slot_of[i] = -1
                continue
            victim_keys[i], victim_scores[i] = tab.keys[victim], tab.scores[victim]
            flags[1, i] = True
            if counts is not None:
                counts[t, EVICTIONS] += 1
            tab.store(victim, key, score(i))
            inserted_at(i, t, victim)
            stored_here[key] = victim
    for tab in tables:
        tab.write_back()
    slots.copy_(torch.tensor(slot_of, dtype=torch.int64))
    if rows is not None:
        _move_rows(stack.tables[0], slots, flags[0], rows, assign)
    if not victims:
        return slots, flags[0], None, None, None
    return slots, flags[0], flags[1], victim_keys, victim_scores


def _move_rows(table, slots: torch.Tensor, inserted: torch.Tensor, rows: torch.Tensor, assign: bool) -> None:
    """rows (N, d) of one table's claim: assign, every key stored gets its row of rows (of
    copies of a key, the first lane's); else inserted keys store theirs and every other
    key stored gets its stored row back in rows."""
    d = rows.shape[1]
    stored = slots >= 0
    if assign:
        firsts: dict[int, int] = {}
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                firsts.setdefault(s, i)
        lanes = torch.tensor(list(firsts.values()), dtype=torch.int64, device=rows.device)
        table.values[slots[lanes], :d] = rows[lanes]
        return
    table.values[slots[inserted], :d] = rows[inserted]
    old = stored & ~inserted
    rows[old] = table.values[slots[old], :d]
