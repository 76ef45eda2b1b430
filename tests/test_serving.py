"""`hstu serve` over real HTTP: answers equal the export's own Recommender, bad requests get
4xx with a message, streamed rows are seen by the next request, and a snapshot swap under
load fails no request and mixes no versions."""
import json
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
import torch
import uvicorn

from conftest import free_port
from lightning_modules import export as export_lib
from lightning_modules import model_files
from lightning_modules.export import Recommender
from lightning_modules.serving import ServingConfig
from pipelines.serve import create_app

CONFIG = ServingConfig(device_rows=64, host_rows=128, bucket_size=8)  # small caches: every tier is used


@contextmanager
def serving(export, tmp_path, **kwargs):
    """The server on a free port, in a thread of this process → its address."""
    port = free_port()
    app = create_app(export, CONFIG, "cpu", tmp_path / "serve-work", **kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def call(url: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict | str]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if r.headers.get_content_type() == "application/json" else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


@pytest.fixture(scope="module")
def exports(pipeline_run, tmp_path_factory):
    """The pipeline's export (version "1") and a second version of it with other attention
    weights (its rankings differ), as `hstu export` writes them."""
    first = pipeline_run / "export"
    root = tmp_path_factory.mktemp("exports")
    model, items, info = model_files.load_model(pipeline_run / "model")
    with torch.no_grad():
        model.blocks[0].uvqk.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    model_files.save(root / "model-2", model, items, metadata=info["metadata"])
    second = export_lib.export(root / "model-2", pipeline_run / "data", root / "export-2", model_version="2")
    return first, second


def histories(rec: Recommender, n: int) -> list[list[int]]:
    catalog = rec.item_ids.tolist()
    return [catalog[i * 7 % len(catalog) : i * 7 % len(catalog) + 1 + i % 9] for i in range(n)]


def test_serve_answers_as_the_export_and_reports_health_and_metrics(exports, tmp_path):
    export = exports[0]
    rec = Recommender.load(export)
    version = json.loads((export / "export.json").read_text())["model_version"]
    with serving(export, tmp_path) as (url, _):
        assert call(url, "/health") == (200, {"status": "ok", "version": version})
        for history in histories(rec, 6):
            status, body = call(url, "/recommend", {"history": history, "k": 5})
            expected = rec.recommend(history, k=5)
            assert status == 200 and body["version"] == version and body["items"] == [i for i, _ in expected]
            assert body["scores"] == pytest.approx([s for _, s in expected], abs=1e-5)
        history, candidates = histories(rec, 3)[2], rec.item_ids[:6].tolist()
        status, body = call(url, "/score", {"history": history, "candidates": candidates})
        every = dict(rec.recommend(history, k=len(rec.item_ids), exclude_history=False))
        assert status == 200 and body["scores"] == pytest.approx([every[c] for c in candidates], abs=1e-5)

        threads = [threading.Thread(target=call, args=(url, "/recommend", {"history": h})) for h in histories(rec, 40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        status, text = call(url, "/metrics")
        assert status == 200
        metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
        assert metrics[f'hstu_model_version{{version="{version}"}}'] == 1
        assert metrics['hstu_requests_total{endpoint="/recommend",status="200"}'] == 46
        assert metrics["hstu_batch_size_count"] < 47  # concurrent requests ran in shared batches
        tiers = {t: metrics[f'hstu_embedding_hit_rate{{tier="{t}"}}'] for t in ("device", "host", "disk")}
        assert tiers["device"] > 0 and tiers["disk"] > 0 and sum(tiers.values()) <= 1
        assert metrics['hstu_embedding_rows{tier="disk"}'] > 0 and metrics['hstu_embedding_bytes{tier="device"}'] > 0


def test_bad_requests_get_a_4xx_with_a_message(exports, tmp_path):
    with serving(exports[0], tmp_path) as (url, _):
        bad = [
            ("/recommend", {"history": [1, 2], "color": "red"}),  # unknown field
            ("/recommend", {"history": "1,2"}),  # wrong type
            ("/recommend", {"history": [1, "2"]}),
            ("/recommend", {"history": [1.5]}),
            ("/recommend", {"history": []}),  # empty
            ("/recommend", {"history": list(range(CONFIG.max_history + 1))}),  # huge
            ("/recommend", {"history": [2**63]}),  # outside int64
            ("/recommend", {"history": [-(2**63)]}),  # the reserved empty key
            ("/recommend", {"history": [1, 2], "timestamps": [5]}),
            ("/recommend", {"history": [1], "timestamps": [2**63]}),  # a time outside int64
            ("/recommend", {"history": [1], "k": 0}),
            ("/score", {"history": [1]}),  # no candidates
            ("/score", {"history": [1], "candidates": []}),
            ("/admin/update", {"ids": [1, 2], "rows": [[0.0]]}),
            ("/admin/update", {"ids": [1], "rows": [[0.0, 1.0]]}),  # wrong width
            ("/admin/update", {"dump": "/nonexistent"}),
            ("/admin/snapshot", {"export": "/nonexistent"}),
            ("/admin/snapshot", {"export": str(exports[0])}),  # the version served already
        ]
        for path, body in bad + [("/recommend", None)]:
            status, answer = call(url, path, body)
            assert 400 <= status < 500, (path, body, status, answer)
            assert answer.get("detail") or answer.get("error"), (path, body)
        status, answer = call(url, "/recommend", raw=b"{not json")
        assert status == 422
        assert call(url, "/health")[0] == 200  # and the server is fine


def test_streamed_rows_are_seen_by_the_next_request(exports, tmp_path, pipeline_run):
    rec = Recommender.load(exports[0])
    history = histories(rec, 2)[1]
    with serving(exports[0], tmp_path) as (url, _):
        _, before = call(url, "/recommend", {"history": history, "k": 3})
        # an item the model ranked last, given the row of the query's best item
        last = rec.recommend(history, k=len(rec.item_ids))[-1][0]
        best_row = rec.items.item_table.lookup(torch.tensor([before["items"][0]]), train=False)[0]
        status, body = call(url, "/admin/update", {"ids": [last], "rows": [best_row.tolist()]})
        assert status == 200 and body["rows"] == 1
        _, after = call(url, "/recommend", {"history": history, "k": 3})
        assert last in after["items"] and last not in before["items"]
        _, scored = call(url, "/score", {"history": history, "candidates": [last, before["items"][0]]})
        assert scored["scores"][0] == pytest.approx(scored["scores"][1], abs=1e-5)
        # a row with NaN (it would rank its item first for every request) is refused whole
        nan_row = [float("nan")] + best_row.tolist()[1:]
        status, body = call(url, "/admin/update", {"ids": [before["items"][1], last], "rows": [best_row.tolist(), nan_row]})
        assert status == 422 and "NaN" in body["error"]
        assert call(url, "/recommend", {"history": history, "k": 3})[1] == after


def test_a_snapshot_swap_under_load_fails_no_request_and_mixes_no_versions(exports, tmp_path):
    first, second = exports
    expected = {v: Recommender.load(e) for v, e in (("1", first), ("2", second))}
    queries = histories(expected["1"], 12)
    answers = {v: [[i for i, _ in r.recommend(h, k=5)] for h in queries] for v, r in expected.items()}
    assert answers["1"] != answers["2"]
    results, stop = [], threading.Event()

    def client(seed):
        i = seed
        while not stop.is_set():
            q = i % len(queries)
            results.append((q, *call(url, "/recommend", {"history": queries[q], "k": 5})))
            i += 1

    with serving(first, tmp_path) as (url, app):
        clients = [threading.Thread(target=client, args=(s,)) for s in range(6)]
        for c in clients:
            c.start()
        time.sleep(1.0)
        status, body = call(url, "/admin/snapshot", {"export": str(second)})
        assert status == 200 and body == {"version": "2", "previous": "1"}
        time.sleep(1.0)
        stop.set()
        for c in clients:
            c.join()
        snapshots = app.state.serving["snapshots"]
        assert snapshots.version == "2" and snapshots.closed == ["1"]  # the old version released
        stores = list((tmp_path / "serve-work" / "stores").iterdir())
        assert len(stores) == 1  # its disk store's files gone
        assert call(url, "/health")[1]["version"] == "2"
    assert all(status == 200 for _, status, _ in results), [r for r in results if r[1] != 200][:3]
    versions = [body["version"] for _, _, body in results]
    assert set(versions) == {"1", "2"} and len(results) > 50
    for q, _, body in results:  # every answer wholly of the version it names
        assert body["items"] == answers[body["version"]][q]
