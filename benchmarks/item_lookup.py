"""Host time of a training step's item-table work: the lookup of a batch's ids (train=True)
and the update from their gradients, at a preset's sizes, with no model.

    python benchmarks/item_lookup.py [--preset hstu] [--iters 400] [--rounds 3]

The table is the preset's item table (growing from its initial capacity, as in training);
each iteration looks up a batch of history ids (batch_size sequences of 70-100% of
max_seq_len, ids drawn with a power-law skew over a catalog of CATALOG items) and the
whole catalog (the full-softmax presets' negatives), gives every row a gradient of ones
and applies it. Nothing waits for the GPU inside a round, so at these sizes the figure is
the host's time to issue the calls (what bounds the `hstu` preset's step:
train_throughput.md). Per round: ms per iteration, a synchronize at each end.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import write_results  # noqa: E402
from lightning_modules.config import PRESETS, preset  # noqa: E402
from lightning_modules.item_embedding import ItemEmbedding  # noqa: E402

CATALOG = 3706  # MovieLens-1M's items, the paper presets' data
WARMUP = 40  # iterations before the rounds: compilation, the table's first growths
SKEW = 3  # ids drawn as CATALOG * u ** SKEW: a few items take most draws


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="hstu", choices=sorted(PRESETS))
    p.add_argument("--iters", type=int, default=400, help="iterations per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = preset(a.preset)
    items = ItemEmbedding(config, device)
    gen = torch.Generator().manual_seed(0)
    catalog = torch.arange(1, CATALOG + 1)

    def step() -> None:
        length = int(torch.randint(int(0.7 * config.max_seq_len), config.max_seq_len + 1, (1,), generator=gen))
        history = (torch.rand(config.batch_size * length, generator=gen) ** SKEW * CATALOG).long() + 1
        looked = items.lookup(torch.cat([history, catalog]).to(device, non_blocking=True), train=True)
        for rows in looked.rows.values():
            rows.grad = torch.ones_like(rows)
        items.apply_gradients(looked)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(WARMUP):
        step()
    sync()
    times = []
    for _ in range(a.rounds):
        start = time.perf_counter()
        for _ in range(a.iters):
            step()
        sync()
        times.append(1000 * (time.perf_counter() - start) / a.iters)
    print(f"{'preset':<12}{'batch':>7}{'rows':>10}" + "".join(f"{f'round {i + 1}':>11}" for i in range(a.rounds)) + "  (ms per lookup + update)")
    print(f"{a.preset:<12}{config.batch_size:>7}{items.item_table.stats().size:>10}" + "".join(f"{t:>11.3f}" for t in times))
    write_results("item_lookup", [{
        "device": device, "preset": a.preset, "batch_size": config.batch_size, "max_seq_len": config.max_seq_len,
        "iters": a.iters, "ms_per_iter": times, "ms_best": min(times),
    }], a.out, device, command=" ".join(sys.argv))


if __name__ == "__main__":
    main()
