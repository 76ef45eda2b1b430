"""The grouped path's operations (multi_table_kernels.py) in plain PyTorch: each function
here has the signature of the launcher of the same name there, less `_reference`, and is
its twin in the differential tests (tests/test_multi_table_kernels.py).

A twin reads tables as tensors (`stack.tables`: each table's keys, scores, digests and
values), where the kernels read their descriptors (`stack.desc`); gradients as tensors
(`grads.tensors`), where the kernels read their addresses. Nothing here calls a kernel or
shares a helper with the kernels: a bug in either shows as a difference.
"""
import torch

from .counters import ADMISSION_REJECTIONS, ADMISSIONS, HITS, LOOKUPS, REJECTIONS
from .hashing import EMPTY_KEY, uniform_from_keys
from .optimizers import update

SLOT_BITS = 40  # a packed row: table << SLOT_BITS | slot (multi_table_kernels.SLOT_BITS)
SLOT_MASK = (1 << SLOT_BITS) - 1


def _initial_embeddings(keys: torch.Tensor, seeds: torch.Tensor, scales: torch.Tensor, dim: int) -> torch.Tensor:
    """(N, dim) float32: each key's initial embedding under its own seed and scale."""
    out = torch.empty(keys.numel(), dim, dtype=torch.float32, device=keys.device)
    for seed in seeds.unique().tolist():
        mine = seeds == seed
        u = uniform_from_keys(keys[mine], dim, seed)
        out[mine] = ((2 * u - 1) * scales[mine].to(torch.float64)[:, None]).to(torch.float32)
    return out


def number_segments_reference(keys: torch.Tensor, tids: torch.Tensor):
    """(number, count, seg_keys, seg_tids, rows, rowless): segments, one per distinct
    (table, id), numbered in the order of their first lanes; per-segment tensors of N
    entries, count[0] used; rows and rowless: segment_rows' outputs, rowless zeroed."""
    n = keys.numel()
    pairs = torch.stack([tids.to(torch.int64), keys], 1)
    distinct, inverse = torch.unique(pairs, dim=0, return_inverse=True)
    lanes = torch.arange(n, device=keys.device)
    first = torch.full((distinct.shape[0],), n, device=keys.device).scatter_reduce_(0, inverse, lanes, "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=keys.device)
    seg_keys = torch.zeros(n, dtype=torch.int64, device=keys.device)
    seg_tids = torch.zeros(n, dtype=torch.int64, device=keys.device)
    seg_keys[: order.numel()] = distinct[order, 1]
    seg_tids[: order.numel()] = distinct[order, 0]
    count = torch.tensor([order.numel()], dtype=torch.int32, device=keys.device)
    rows, rowless = torch.empty(n, dtype=torch.int64, device=keys.device), torch.zeros(1, dtype=torch.int32, device=keys.device)
    return rank[inverse].to(torch.int32), count, seg_keys, seg_tids, rows, rowless


def segment_rows_reference(seg_tids, slots, count, rows, rowless, counts, inserting, counted) -> None:
    """rows[s] = (table << SLOT_BITS) | slot of each of the count[0] segments, -1 where slot < 0;
    rowless[0] = 1 if some segment has none. counted True / False: the lookup is counted
    (lookups, hits; when training, ids left without a row count as rejections of tables
    that insert); None: nothing is counted."""
    c = int(count[0])
    t, s = seg_tids[:c].to(torch.int64), slots[:c]
    stored = s >= 0
    rows[:c] = torch.where(stored, (t << SLOT_BITS) | s, -1)
    if bool((~stored).any()):
        rowless.fill_(1)
    if counted is None:
        return
    for table in range(counts.shape[0]):
        mine = t == table
        lookups, hits = int(mine.sum()), int((mine & stored).sum())
        counts[table, LOOKUPS] += lookups
        counts[table, HITS] += hits
        if counted:
            counts[table, REJECTIONS] += (lookups - hits) * int(inserting[table])


def growth_checks_reference(seg_tids, slots, count, stack, growing, bucket_size: int, max_capacity: int) -> torch.Tensor:
    """(T, 2) int64: per table, its segments (of the first count[0]) with slot -2, and
    for the tables in growing the keys stored (not the reserved key); 0 for the others."""
    out = torch.zeros(len(stack.tables), 2, dtype=torch.int64, device=slots.device)
    c = int(count[0])
    t = seg_tids[:c].to(torch.int64)
    out[:, 0].index_add_(0, t, (slots[:c] == -2).to(torch.int64))
    for i in growing.tolist():
        out[i, 1] = int((stack.tables[i].keys != EMPTY_KEY).sum())
    return out


def init_rows_reference(keys, tids, slots, inserted, count, stack, seeds, scales, dim: int, whole_rows: bool = False) -> None:
    """Rows of the inserted ones of the count[0] segments: their initial embedding, then
    zeros to the row's end (the optimizer state), or with whole_rows to its stride."""
    c = int(count[0])
    new = inserted[:c].bool()
    k, t, s = keys[:c][new], tids[:c][new].to(torch.int64), slots[:c][new]
    emb = _initial_embeddings(k, seeds[t], scales[t], dim)
    for table in t.unique().tolist():
        mine = t == table
        values = stack.tables[table].values
        if whole_rows:  # the padding past row_dim too
            values = torch.as_strided(values, (values.shape[0], values.stride(0)), (values.stride(0), 1))
        values[s[mine], :dim] = emb[mine]
        values[s[mine], dim:] = 0


def gather_embeddings_reference(number, rows, seg_keys, seg_tids, rowless, stack, seeds, scales, out) -> None:
    """out[lane] = the embedding of its segment's row, or the initial embedding of its id
    where the segment has no row."""
    dim = out.shape[1]
    packed = rows[number.to(torch.int64)]
    for lane, p in enumerate(packed.tolist()):
        if p >= 0:
            out[lane] = stack.tables[p >> SLOT_BITS].values[p & SLOT_MASK, :dim]
    fresh = packed < 0
    if bool(fresh.any()):
        s = number.to(torch.int64)[fresh]
        t = seg_tids[s]
        out[fresh] = _initial_embeddings(seg_keys[s], seeds[t], scales[t], dim)


def admission_gate_reference(tids, counted, uses, count, admits, thresholds):
    """(seen, barred) of the count[0] segments before their claim (see
    multi_table_kernels.admission_gate); past the count, seen is 0 and barred unset."""
    n = tids.numel()
    live = torch.arange(n, device=tids.device) < count[0]
    t = torch.where(live, tids, 0).to(torch.int64)
    seen = torch.where(live, counted + uses, 0)
    return seen, live & (admits[t] != 0) & (seen < thresholds[t])


def admit_reference(keys, tids, slots, inserted, found, seen, count, admits, thresholds, counter_stack, counts):
    """Admission of the count[0] segments after their claim (see multi_table_kernels.admit):
    returns claim_keys (N,); empties the admitted ids' counter slots and counts
    admissions, admission rejections and (less) rejections per table."""
    n = keys.numel()
    live = torch.arange(n, device=keys.device) < count[0]
    t = torch.where(live, tids, 0).to(torch.int64)
    new = live & ((slots < 0) | inserted) & (admits[t] != 0)
    admitted = new & (seen >= thresholds[t])
    refused = new & ~admitted
    claim_keys = torch.where(refused, keys, EMPTY_KEY)
    for table in range(len(counter_stack.tables)):
        mine = t == table
        clear = admitted & mine & (found >= 0)
        if bool(clear.any()):
            counters = counter_stack.tables[table]
            counters.keys[found[clear]] = EMPTY_KEY
            counters.scores[found[clear]] = 0
            counters.digests[found[clear]] = 0
        took, left = int((admitted & mine).sum()), int((refused & mine).sum())
        counts[table, ADMISSIONS] += took
        counts[table, ADMISSION_REJECTIONS] += left
        counts[table, REJECTIONS] -= left
    return claim_keys


def update_segments_reference(number, rows, count, grads, stack, dim: int, optimizer) -> None:
    """One optimizer step (optimizers.update) for each segment with a row, with the sum of
    its lanes' gradients (grads.tensors: each table's (lanes, dim) gradients, the lanes of
    the group in table order)."""
    g = torch.cat([x.reshape(-1, dim).to(torch.float32) for x in grads.tensors])
    c = int(count[0])
    summed = torch.zeros(c, dim, dtype=torch.float32, device=g.device).index_add_(0, number.to(torch.int64), g)
    packed = rows[:c]
    for table in (packed[packed >= 0] >> SLOT_BITS).unique().tolist():
        mine = (packed >= 0) & ((packed >> SLOT_BITS) == table)
        slots = packed[mine] & SLOT_MASK
        values = stack.tables[table].values
        values[slots] = update(optimizer, values[slots], summed[mine], dim).to(values.dtype)
