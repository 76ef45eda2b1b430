"""The per-key batch reductions both table backends use, against a dict model."""
import torch

from kernels.dynamic_embedding.batch_keys import first_copy, highest_per_key, last_copy, sum_by_key


def test_reductions_equal_a_dict_model():
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-5, 5, (200,), generator=g)
    keys[:3] = torch.iinfo(torch.int64).max  # extremes reduce like any key
    rows = torch.randn(200, 3, generator=g, dtype=torch.float64)
    scores = torch.randint(-100, 100, (200,), generator=g)
    uniq, sums, inverse = sum_by_key(keys, rows)
    assert torch.equal(uniq[inverse], keys) and uniq.tolist() == sorted(set(keys.tolist()))
    top = highest_per_key(uniq.numel(), inverse, scores)
    firsts, lasts = first_copy(keys), last_copy(keys)
    for u, k in enumerate(uniq.tolist()):
        lanes = [i for i, x in enumerate(keys.tolist()) if x == k]
        assert torch.allclose(sums[u], rows[lanes].sum(0))
        assert int(top[u]) == max(int(scores[i]) for i in lanes)
        assert torch.nonzero(firsts[lanes]).flatten().tolist() == [0]
        assert torch.nonzero(lasts[lanes]).flatten().tolist() == [len(lanes) - 1]
