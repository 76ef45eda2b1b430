"""Full-ranking evaluation: the metrics, ties and NaN scores, and the history's exclusion
through evaluate_rankers on prepared data."""
import itertools
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from lightning_modules.datasets import Interactions, build_sequences
from lightning_modules.evaluate import MISS, evaluate_rankers, ranking_metrics, target_ranks, whole_histories


def test_ranking_metrics_and_history_exclusion():
    m = ranking_metrics(torch.tensor([0, 9, 10, 199]), ks=(10, 200))
    assert m["hr@10"] == 0.5 and m["hr@200"] == 1.0
    torch.testing.assert_close(torch.tensor(m["ndcg@10"]), torch.tensor((1 + 1 / torch.log2(torch.tensor(11.0)).item()) / 4))
    torch.testing.assert_close(m["mrr"], (1 + 1 / 10 + 1 / 11 + 1 / 200) / 4)
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    no_history = torch.zeros(1, 4, dtype=torch.bool)
    assert [r.item() for r in target_ranks(scores, torch.tensor([2]), no_history)] == [2, 0]
    exclude = torch.tensor([[True, False, False, True]])  # items 0 and 3 are history
    assert [r.item() for r in target_ranks(scores, torch.tensor([2]), exclude)] == [1, 0]
    # a target in the history (a repeat) is a miss: not ranked among the history's other items
    repeat = torch.tensor([[True, False, True, False]])
    ranks, ties = target_ranks(scores, torch.tensor([2]), repeat)
    assert ranks.item() == MISS and ranking_metrics(ranks, ties, ks=(1, 4)) == {"hr@1": 0.0, "ndcg@1": 0.0, "hr@4": 0.0, "ndcg@4": 0.0, "mrr": 0.0}


def _metrics_over_every_order(scores: torch.Tensor, target: int, ks) -> dict[str, float]:
    """The metrics of one user averaged over every order of the items scored equal: each
    permutation of the catalog breaks ties by its position, the target's rank counted
    one by one (a model of metric_sums and target_ranks, sharing no code with them)."""
    totals = dict.fromkeys([f"{m}@{k}" for k in ks for m in ("hr", "ndcg")] + ["mrr"], 0.0)
    orders = list(itertools.permutations(range(len(scores))))
    for order in orders:
        place = {item: p for p, item in enumerate(order)}
        rank = sum(1 for j in range(len(scores)) if j != target and (scores[j] > scores[target] or (scores[j] == scores[target] and place[j] < place[target])))
        for k in ks:
            totals[f"hr@{k}"] += rank < k
            totals[f"ndcg@{k}"] += 1 / math.log2(rank + 2) if rank < k else 0.0
        totals["mrr"] += 1 / (rank + 1)
    return {name: v / len(orders) for name, v in totals.items()}


def test_ties_count_as_their_expectation_over_a_random_order():
    gen = torch.Generator().manual_seed(0)
    ks = (1, 2, 3)
    for _ in range(30):
        scores = torch.randint(0, 3, (1, 6), generator=gen).double()  # few values: many ties
        target = int(torch.randint(0, 6, (1,), generator=gen))
        got = ranking_metrics(*target_ranks(scores, torch.tensor([target]), torch.zeros(1, 6, dtype=torch.bool)), ks=ks)
        want = _metrics_over_every_order(scores[0].tolist(), target, ks)
        for name, value in want.items():
            assert got[name] == pytest.approx(value, abs=1e-12), (name, scores, target)


def test_a_ranker_that_scores_everything_alike_or_nan_is_not_rewarded():
    catalog, users = 1000, 4
    target = torch.tensor([0, 10, 500, 999])
    none = torch.zeros(users, catalog, dtype=torch.bool)
    alike = ranking_metrics(*target_ranks(torch.zeros(users, catalog), target, none))
    assert alike["hr@10"] == pytest.approx(10 / catalog) and alike["hr@200"] == pytest.approx(200 / catalog)
    nan = ranking_metrics(*target_ranks(torch.full((users, catalog), float("nan")), target, none))
    assert nan["hr@200"] == 0.0 and nan["mrr"] == 0.0
    scores = torch.randn(users, catalog)
    scores[:, 1::2] = float("nan")  # NaN items rank ahead of a finite target
    ahead, tied = target_ranks(scores, target, none)
    assert (ahead >= catalog // 2 - 1).all() and (tied == 0).all()


class HistoryLover:
    """Scores each item by how often the history holds it (repeats first), then by id: a
    ranker that would be told the target by a protocol leaving a repeated target alone
    among the history's excluded items."""

    max_seq_len = 50

    def __init__(self, catalog: torch.Tensor):
        self.catalog = catalog

    def scores(self, items, timestamps, lengths):
        out = torch.zeros(len(lengths), len(self.catalog), dtype=torch.float64)
        for b, n in enumerate(lengths.tolist()):
            out[b].index_add_(0, torch.searchsorted(self.catalog, items[b, :n]), torch.ones(n, dtype=torch.float64))
        return out + torch.arange(len(self.catalog)) * 1e-6


def test_a_target_repeating_a_history_item_is_a_miss_and_the_others_are_ranked(tmp_path):
    # users 1..4 end on an item of their history; users 5..8 on one they never had
    users, items, times = [], [], []
    for u in range(1, 9):
        seq = [10 * u + j for j in range(5)] + ([10 * u + 2] if u <= 4 else [7])
        users += [u] * len(seq)
        items += seq
        times += list(range(len(seq)))
    x = Interactions(np.array(users), np.array(items), np.array(times), np.full(len(users), np.nan))
    splits, _ = build_sequences(x)
    pq.write_table(splits["test"], tmp_path / "test.parquet")
    full = whole_histories(tmp_path, "test")
    catalog = torch.from_numpy(np.unique(np.array(items)))
    metrics = evaluate_rankers({"lover": HistoryLover(catalog)}, full, catalog)["lover"]
    # the repeats are misses (a protocol leaving them in would rank them first); item 7, the
    # lowest of the catalog's 41 ids and never in a history, ranks last of the 36 items
    # outside each history: 35 ahead of it
    assert metrics["users"] == 8
    assert metrics["hr@50"] == pytest.approx(0.5) and metrics["hr@10"] == 0.0
    assert metrics["mrr"] == pytest.approx(0.5 / 36)


def test_hstu_trained_on_synthetic_sequences_ranks_far_above_most_popular(tmp_path):
    """The training command's model on the test split, beside the popularity baseline:
    three epochs over 300 synthetic users learn their sequential habit (about 0.12 HR@10
    against most-popular's 0.02 with seed 0)."""
    from lightning_modules import model_files
    from lightning_modules.evaluate import HSTURanker, PopularityRanker, catalog_of
    from pipelines.cli import main as hstu

    data, out = tmp_path / "data", tmp_path / "train"
    assert hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "300", "--out", str(data)]) == 0
    assert hstu(["train", "--data-dir", str(data), "--out", str(out), "--workers", "1", "--epochs", "3",
                 "--train-args", "--max-seq-len 50"]) == 0  # (the habit is short-range: a shorter window trains faster)
    catalog = catalog_of(data)
    model, items = model_files.load_model(out / "model")[:2]
    rankers = {"model": HSTURanker(model, items, catalog), "popular": PopularityRanker(data, catalog)}
    metrics = evaluate_rankers(rankers, whole_histories(data, "test"), catalog)
    model, popular = metrics["model"], metrics["popular"]
    assert model["users"] == popular["users"] == 300
    assert model["hr@10"] > max(0.08, 3 * popular["hr@10"]) and model["ndcg@10"] > 3 * popular["ndcg@10"], metrics
