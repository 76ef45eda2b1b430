"""Test-split quality of HSTU with and without item features (genres), several seeds.

    python benchmarks/item_features_quality.py --data-dir DATA --seeds 0 1 2 3

DATA is a prepared MovieLens set (`hstu prepare --dataset ml-100k --out DATA`, which
writes items.parquet). Each (seed, setting) trains as `hstu run` does (200 epochs at most,
patience 20 on validation NDCG@10, the best validated model kept), then the test split is
ranked in full. Runs go in parallel, one process each (--parallel), on the GPU where
there is one. Prints a table (each run, then the mean per setting) and writes JSON to
benchmarks/results/.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_path import result_path, write_results  # noqa: E402

METRICS = ("hr@10", "ndcg@10", "hr@50", "mrr")
EPOCHS, PATIENCE = 200, 20  # as `hstu run`


def one_run(data_dir: str, work: Path, seed: int, features: bool) -> dict:
    """Trains in a subprocess of its own and evaluates there → its test metrics."""
    out = work / f"seed{seed}-{'with' if features else 'without'}"
    code = (
        "import json, sys, torch\n"
        "from lightning_modules import train, model_files\n"
        "from lightning_modules.evaluate import HSTURanker, catalog_of, evaluate_rankers, whole_histories\n"
        "data, out, args = sys.argv[1], sys.argv[2], sys.argv[3:]\n"
        "train.main(['--data-dir', data, '--out-dir', out] + args)\n"
        "model, items, info = model_files.load_model(out + '/model', 'cuda' if torch.cuda.is_available() else 'cpu')\n"
        "catalog = catalog_of(data)\n"
        "m = evaluate_rankers({'model': HSTURanker(model, items, catalog, items.device)}, whole_histories(data, 'test'), catalog)\n"
        "print('RESULT', json.dumps(m['model'] | {'steps': info['metadata']['global_step']}))\n"
    )
    args = [
        "--epochs", str(EPOCHS), "--patience", str(PATIENCE), "--seed", str(seed), "--loader-workers", "1",
        "--no-progress-bar", "--item-features" if features else "--no-item-features",
    ]
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", code, data_dir, str(out), *args], capture_output=True, text=True, cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"run seed {seed} features {features} failed:\n{done.stderr[-3000:]}")
    return {"seed": seed, "item_features": features, **json.loads(lines[-1][len("RESULT "):])}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--parallel", type=int, default=8, help="runs at once")
    p.add_argument("--out", help="JSON path (default benchmarks/results/item_features_quality_<dataset>_<device>.json)")
    args = p.parse_args(argv)
    dataset = Path(args.data_dir).name
    with tempfile.TemporaryDirectory() as work, ThreadPoolExecutor(args.parallel) as pool:
        jobs = [(s, f) for s in args.seeds for f in (False, True)]
        rows = list(pool.map(lambda j: one_run(args.data_dir, Path(work), *j), jobs))
    print(f"{dataset}: test split, full ranking")
    print(f"{'seed':>4} {'features':>8} " + " ".join(f"{m:>8}" for m in METRICS) + f" {'steps':>6}")
    for r in rows:
        print(f"{r['seed']:>4} {str(r['item_features']):>8} " + " ".join(f"{r[m]:>8.4f}" for m in METRICS) + f" {r['steps']:>6}")
    for f in (False, True):
        mine = [r for r in rows if r["item_features"] == f]
        print(f"{'mean':>4} {str(f):>8} " + " ".join(f"{sum(r[m] for r in mine) / len(mine):>8.4f}" for m in METRICS))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out or str(result_path(f"item_features_quality_{dataset}", device))
    write_results("item_features_quality", rows, out, device, dataset=dataset, epochs=EPOCHS, patience=PATIENCE)


if __name__ == "__main__":
    main()
