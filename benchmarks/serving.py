"""Load test of `hstu serve`: requests per second and latency at several concurrencies,
while a loop streams row updates in and a snapshot swap happens mid-run.

    python benchmarks/serving.py [--device cuda] [--concurrency 1 16 64] [--seconds 10] [--items 100000]

The server runs in a process of its own (pipelines/serve.py) on a synthetic export built
here: an HSTU model of the `hstu` preset with random weights and `--items` item rows (the
quality is beside the point; the work per request is a real model's). Clients (aiohttp)
send /recommend requests of histories of 10 to 200 random catalog items, k 10, as fast as
the server answers, `c` at a time, after warm-up requests of every history length (the
first request of a length class compiles its GPU kernels). Meanwhile an updater POSTs 256 new rows to
/admin/update every 100 ms, and halfway through each run /admin/snapshot swaps in the
other of two exports. Reported per concurrency: requests/s, p50 and p99 latency, errors
(any non-200 answer or a mixed version), the p99 of the requests that began while the swap
was under way against the p99 of the others, and the versions answered. Prints a table
and writes JSON to benchmarks/results/serving_<device>.json.
"""
import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_path import write_results  # noqa: E402
from lightning_modules import export as export_lib  # noqa: E402
from lightning_modules import model_files  # noqa: E402
from lightning_modules.config import preset  # noqa: E402
from lightning_modules.hstu import HSTU  # noqa: E402
from lightning_modules.item_embedding import ItemEmbedding  # noqa: E402

UPDATE_ROWS, UPDATE_EVERY_S = 256, 0.1
HISTORY = (10, 200)


def synthetic_export(root: Path, items: int, seed: int, version: str) -> tuple[Path, list[int]]:
    """An export of a randomly initialized `hstu` model over `items` item rows."""
    torch.manual_seed(seed)
    config = preset("hstu").override(seed=seed)
    model, table = HSTU(config), ItemEmbedding(config)
    ids = torch.randperm(items * 10, generator=torch.Generator().manual_seed(0))[:items] * 7 + 1
    rows = table.item_table.lookup(ids)  # a training lookup: every item gets its (seeded) row
    table.item_table.apply_gradients(ids, torch.randn_like(rows) * 0.1)  # and a step away from it
    model_dir = model_files.save(root / f"model-{version}", model, table, metadata={"global_step": 1})
    data = root / f"data-{version}"
    data.mkdir(parents=True, exist_ok=True)
    catalog = ids.tolist()
    pq.write_table(pa.table({"user_id": [0], "item_ids": [catalog], "timestamps": [list(range(len(catalog)))]}), data / "test.parquet")
    return export_lib.export(model_dir, data, root / f"export-{version}", model_version=version), catalog


def start_server(export: Path, port: int, device: str, work: Path, items: int) -> subprocess.Popen:
    code = (
        "import sys; from pipelines.serve import serve; from lightning_modules.serving import ServingConfig\n"
        f"serve({str(export)!r}, '127.0.0.1', {port}, config=ServingConfig(device_rows={max(1024, items // 100)},"
        f" host_rows={max(2048, items // 10)}), device={device!r}, work_dir={str(work)!r})\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_ready(session, url: str, server: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, "the server exited"
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError("the server did not start")


async def one_run(url: str, concurrency: int, seconds: float, catalog: list[int], swap_to: tuple[str, str], dim: int) -> dict:
    import aiohttp

    rng = random.Random(concurrency)
    records = []  # (start, latency, ok, version)
    swap = {}
    stop = time.monotonic() + seconds

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4)) as session:
        async def client():
            while time.monotonic() < stop:
                body = {"history": rng.sample(catalog, rng.randint(*HISTORY)), "k": 10}
                start = time.monotonic()
                try:
                    async with session.post(url + "/recommend", json=body) as r:
                        answer = await r.json()
                        ok = r.status == 200 and len(answer["items"]) == 10
                        version = answer.get("version")
                except (aiohttp.ClientError, ValueError):
                    ok, version = False, None
                records.append((start, time.monotonic() - start, ok, version))

        async def updater():
            while time.monotonic() < stop:
                ids = rng.sample(catalog, UPDATE_ROWS)
                rows = np.random.default_rng(len(records)).standard_normal((UPDATE_ROWS, dim)).astype(np.float32) * 0.02
                async with session.post(url + "/admin/update", json={"ids": ids, "rows": rows.tolist()}) as r:
                    assert r.status == 200, await r.text()
                await asyncio.sleep(UPDATE_EVERY_S)

        async def swapper():
            await asyncio.sleep(seconds / 2)
            swap["start"] = time.monotonic()
            async with session.post(url + "/admin/snapshot", json={"export": swap_to[0], "version": swap_to[1]}) as r:
                swap["status"] = r.status
            swap["end"] = time.monotonic()

        await asyncio.gather(*(client() for _ in range(concurrency)), updater(), swapper())
    lat = np.array([r[1] for r in records]) * 1000
    during = np.array([r[1] * 1000 for r in records if swap["start"] <= r[0] <= swap["end"]])
    steady = np.array([r[1] * 1000 for r in records if not swap["start"] <= r[0] <= swap["end"]])
    return {
        "concurrency": concurrency, "requests": len(records), "rps": len(records) / seconds,
        "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
        "errors": sum(not r[2] for r in records), "swap_status": swap["status"], "swap_s": swap["end"] - swap["start"],
        "p99_during_swap_ms": float(np.percentile(during, 99)) if during.size else None, "requests_during_swap": int(during.size),
        "p99_steady_ms": float(np.percentile(steady, 99)), "versions": sorted({r[3] for r in records if r[3]}),
    }


async def main_async(args) -> list[dict]:
    import aiohttp

    work = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    exports = [synthetic_export(work, args.items, seed, v) for seed, v in ((0, "a"), (1, "b"))]
    catalog = exports[0][1]
    port = args.port
    server = start_server(exports[0][0], port, args.device, work / "serve", args.items)
    url = f"http://127.0.0.1:{port}"
    dim = preset("hstu").embedding_dim
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url, server)
            for n in range(1, HISTORY[1] + 1, 7):  # compiles the kernels for every length class before timing
                async with session.post(url + "/recommend", json={"history": catalog[:n], "k": 10}) as r:
                    assert r.status == 200, await r.text()
        results = []
        for i, c in enumerate(args.concurrency):
            target = exports[(i + 1) % 2][0]
            results.append(await one_run(url, c, args.seconds, catalog, (str(target), f"{'ab'[(i + 1) % 2]}{i + 1}"), dim))
            r = results[-1]
            print(f"{c:>5} {r['rps']:>9,.0f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['errors']:>6} "
                  f"{r['p99_during_swap_ms'] or 0:>10.1f} {r['p99_steady_ms']:>10.1f} {r['swap_s']:>7.2f}  {','.join(r['versions'])}",
                  flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--out")
    args = p.parse_args(argv)
    print(f"{'conc':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'p99 swap':>10} {'p99 steady':>10} {'swap s':>7}  versions")
    results = asyncio.run(main_async(args))
    write_results("serving", results, args.out, device=args.device, items=args.items, seconds=args.seconds,
                  update_rows=UPDATE_ROWS, update_every_s=UPDATE_EVERY_S, history=HISTORY, k=10)


if __name__ == "__main__":
    main()
