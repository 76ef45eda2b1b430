"""The reference hash table against a dict, and its stated semantics."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kernels.dynamic_embedding import EMPTY_KEY, MISSING, ReferenceHashTable

KEYS = st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1)
SMALL_KEYS = st.integers(min_value=-50, max_value=50)
ops = st.lists(
    st.tuples(st.sampled_from(["find_or_insert", "insert_or_assign", "erase", "find"]), st.lists(st.one_of(KEYS, SMALL_KEYS), max_size=40)),
    max_size=25,
)


def rows_for(keys: torch.Tensor, dim: int, salt: int) -> torch.Tensor:
    return (keys[:, None].double() % 1000 + salt + torch.arange(dim)).float()


@settings(max_examples=60, deadline=None)
@given(ops)
def test_growing_table_behaves_like_a_dict(sequence):
    table = ReferenceHashTable(row_dim=3, capacity=8, max_capacity=1 << 16, bucket_size=4)
    model: dict[int, list[float]] = {}
    for step, (op, key_list) in enumerate(sequence):
        keys = torch.tensor(key_list, dtype=torch.int64)
        if op == "find_or_insert":
            slots, inserted, evicted = table.find_or_insert(keys, torch.full_like(keys, step))
            assert evicted.keys.numel() == 0  # below max capacity the table grows instead
            assert bool((slots != MISSING).all())
            new = set(key_list) - set(model)
            assert {k for k, i in zip(key_list, inserted.tolist()) if i} == new
            for k in new:
                model[k] = None  # a new row's values are unspecified until the caller writes them
        elif op == "insert_or_assign":
            rows = rows_for(keys, 3, step)
            table.insert_or_assign(keys, rows, torch.full_like(keys, step))
            for k, r in zip(key_list, rows.tolist()):
                model[k] = r  # last copy wins
        elif op == "erase":
            removed = table.erase(keys)
            assert removed == len(set(key_list) & set(model))
            for k in key_list:
                model.pop(k, None)
        slots = table.find(keys)
        for k, s in zip(key_list, slots.tolist()):
            assert (s != MISSING) == (k in model)
            if model.get(k) is not None:
                assert table.values[s].tolist() == pytest.approx(model[k])
        assert table.size() == len(model)
    keys, rows, _ = table.export()
    assert sorted(keys.tolist()) == sorted(model)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(KEYS, min_size=1, max_size=60), min_size=1, max_size=12))
def test_full_table_evicts_lowest_scores_and_loses_nothing_silently(batches):
    table = ReferenceHashTable(row_dim=2, capacity=16, max_capacity=16, bucket_size=4)
    stored: set[int] = set()
    for step, key_list in enumerate(batches, start=1):
        keys = torch.tensor(key_list, dtype=torch.int64)
        before_scores = dict(zip(*(t.tolist() for t in table.export()[::2])))
        slots, inserted, evicted = table.find_or_insert(keys, torch.full_like(keys, step))
        ev = set(evicted.keys.tolist())
        assert not ev & set(key_list), "keys used by this call are never evicted"
        assert ev <= stored
        for k in ev:  # victims are rows last scored before this call
            assert before_scores[k] < step
        rejected = {k for k, s in zip(key_list, slots.tolist()) if s == MISSING}
        assert not rejected & stored
        stored = (stored - ev) | (set(key_list) - rejected)
        assert set(table.export()[0].tolist()) == stored
        assert table.size() <= table.capacity == 16


def test_eviction_returns_rows_and_picks_lowest_score():
    table = ReferenceHashTable(row_dim=1, capacity=4, max_capacity=4, bucket_size=4)  # one bucket
    keys = torch.tensor([10, 20, 30, 40])
    table.insert_or_assign(keys, torch.tensor([[1.0], [2.0], [3.0], [4.0]]), torch.tensor([5, 1, 7, 3]))
    slots, inserted, evicted = table.find_or_insert(torch.tensor([50]), torch.tensor([9]))
    assert evicted.keys.tolist() == [20] and evicted.rows.tolist() == [[2.0]] and evicted.scores.tolist() == [1]
    assert bool(inserted[0]) and int(table.find(torch.tensor([20]))[0]) == MISSING
    # a new key scoring below every row is not stored
    slots, inserted, evicted = table.find_or_insert(torch.tensor([60]), torch.tensor([0]))
    assert int(slots[0]) == MISSING and not bool(inserted[0]) and evicted.keys.numel() == 0


def test_duplicates_in_one_call_share_a_slot_and_take_max_score():
    table = ReferenceHashTable(row_dim=1, capacity=8)
    slots, inserted, _ = table.find_or_insert(torch.tensor([7, 7, 3, 7]), torch.tensor([1, 5, 2, 3]))
    assert slots[0] == slots[1] == slots[3] != slots[2]
    assert inserted.tolist() == [True, True, True, True]
    assert int(table.scores[slots[0]]) == 5


def test_layout_is_deterministic():
    keys = torch.randint(-(2**40), 2**40, (500,))
    a, b = ReferenceHashTable(2, capacity=64), ReferenceHashTable(2, capacity=64)
    for t in (a, b):
        t.find_or_insert(keys, torch.arange(500))
    assert torch.equal(a.keys, b.keys) and torch.equal(a.scores, b.scores)


def test_growth_keeps_every_row():
    table = ReferenceHashTable(row_dim=2, capacity=8, max_capacity=1 << 16, bucket_size=4, max_load_factor=0.5)
    keys = torch.arange(1000, dtype=torch.int64) * 7919
    table.insert_or_assign(keys, rows_for(keys, 2, 0), torch.zeros_like(keys))
    assert table.capacity >= 2000 and table.size() == 1000
    assert torch.equal(table.values[table.find(keys)], rows_for(keys, 2, 0))


def test_reserved_key_and_empty_calls():
    table = ReferenceHashTable(row_dim=2)
    with pytest.raises(ValueError, match="reserved"):
        table.find(torch.tensor([EMPTY_KEY]))
    with pytest.raises(TypeError):
        table.find(torch.tensor([1.0]))
    empty = torch.empty(0, dtype=torch.int64)
    assert table.find(empty).numel() == 0
    slots, inserted, evicted = table.find_or_insert(empty, empty)
    assert slots.numel() == inserted.numel() == evicted.keys.numel() == 0
    assert table.erase(empty) == 0 and table.export()[0].numel() == 0 and table.load_factor() == 0
