"""`hstu serve`: an exported model online, over HTTP (FastAPI on uvicorn).

    POST /recommend        {"history": [ids], "timestamps"?: [...], "k"?: 10}  → items, scores, version
    POST /score            {"history": [ids], "timestamps"?: [...], "candidates": [ids]}  → scores, version
    GET  /health           the version served
    GET  /metrics          Prometheus: requests, latency, batch sizes, the inference table's tiers
    POST /admin/update     {"ids": [...], "rows": [[...]]} or {"dump": DIR}: item rows streamed in
    POST /admin/snapshot   {"export": DIR, "version"?: V}: a new export loaded aside, then swapped in

Concurrent requests are gathered into batches (`Batcher`: at most max_batch, a request
waits at most max_wait_ms for others) that run on the device as one; the item rows of the
requests queued behind a batch are prefetched while it computes. Every response names the
model version that answered it: a request runs on one version from start to end, and a
snapshot swap lets the requests in flight finish on the old one, which is then released.
A bad request (unknown field, wrong type, empty or oversized list, an id or a time outside
int64, a streamed row with NaN or inf) gets a 4xx with a message.
"""
import asyncio
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernels.dynamic_embedding import DumpError
from kernels.dynamic_embedding.snapshots import Snapshots
from lightning_modules.export import check_aligned
from lightning_modules.serving import Query, ServedModel, ServingConfig

ItemId = Annotated[int, Field(ge=-(2**63) + 1, le=2**63 - 1)]  # int64; its minimum marks empty slots
Timestamp = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # int64
LIMITS = ServingConfig()  # request size limits (the model's own config can narrow them)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class HistoryRequest(Strict):
    history: list[ItemId] = Field(min_length=1, max_length=LIMITS.max_history)
    timestamps: list[Timestamp] | None = Field(None, max_length=LIMITS.max_history)

    @model_validator(mode="after")
    def _aligned(self):
        check_aligned(self.history, self.timestamps)
        return self

    def query(self) -> Query:
        return Query(self.history, self.timestamps)


class RecommendRequest(HistoryRequest):
    k: int = Field(10, ge=1, le=LIMITS.max_k)


class ScoreRequest(HistoryRequest):
    candidates: list[ItemId] = Field(min_length=1, max_length=LIMITS.max_candidates)


class UpdateRequest(Strict):
    ids: list[ItemId] | None = Field(None, max_length=1_000_000)
    rows: list[list[float]] | None = None
    dump: str | None = None

    @model_validator(mode="after")
    def _one_source(self):
        if (self.dump is None) == (self.ids is None):
            raise ValueError("give either ids and rows, or dump")
        if self.ids is not None and (self.rows is None or len(self.rows) != len(self.ids)):
            raise ValueError("rows must hold one row per id")
        return self


class SnapshotRequest(Strict):
    export: str
    version: str | None = None


@dataclass
class Job:
    kind: str  # "recommend" or "score"
    request: RecommendRequest | ScoreRequest
    future: Future
    queued_at: float


class Batcher:
    """Runs queued requests in batches on the current model version (see the module's
    docstring); prefetches the rows of the requests waiting behind each batch."""

    def __init__(self, snapshots: Snapshots, max_batch: int = 64, max_wait_s: float = 0.002, on_batch=None):
        """on_batch(n): told the size of every batch run (metrics)."""
        self.snapshots, self.max_batch, self.max_wait_s = snapshots, max_batch, max_wait_s
        self.on_batch = on_batch or (lambda n: None)
        self.queue: queue.Queue[Job] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._thread.start()

    def submit(self, kind: str, request) -> Future:
        job = Job(kind, request, Future(), time.monotonic())
        self.queue.put(job)
        return job.future

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _take(self) -> list[Job]:
        try:
            batch = [self.queue.get(timeout=0.1)]
        except queue.Empty:
            return []
        deadline = batch[0].queued_at + self.max_wait_s
        while len(batch) < self.max_batch:
            try:
                batch.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        prefetched = None  # (ExitStack holding its version, version, model, future lease)
        while not self._stop.is_set():
            batch = self._take()
            if not batch:
                if prefetched is not None:  # idle: let its rows and its version go
                    self._release(prefetched)
                    prefetched = None
                continue
            self.on_batch(len(batch))
            with self.snapshots.use() as (version, model):
                with self.queue.mutex:
                    waiting = list(self.queue.queue)[: self.max_batch]  # the next batch, most likely
                following = None
                if waiting:
                    stack = ExitStack()
                    v, m = stack.enter_context(self.snapshots.use())
                    ids = m.item_ids([j.request.query() for j in waiting],
                                     [j.request.candidates for j in waiting if j.kind == "score"])
                    following = (stack, v, m, m.table.prefetch(ids))
                lease = None
                if prefetched is not None and prefetched[1] == version:
                    lease = prefetched[3].result()
                self._answer(version, model, batch, lease)
            if prefetched is not None:
                self._release(prefetched)
            prefetched = following

    @staticmethod
    def _release(prefetched) -> None:
        stack, _, model, future = prefetched
        model.table.release(future.result())
        stack.close()

    def _answer(self, version: str, model: ServedModel, batch: list[Job], lease) -> None:
        for kind in ("recommend", "score"):
            jobs = [j for j in batch if j.kind == kind]
            if not jobs:
                continue
            try:
                results = self._compute(model, kind, jobs, lease)
            except Exception:  # one request's failure must not fail the others: each alone
                results = []
                for j in jobs:
                    try:
                        results.append(self._compute(model, kind, [j], lease)[0])
                    except Exception as e:
                        results.append(e)
            for job, result in zip(jobs, results):
                if isinstance(result, Exception):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result | {"version": version})

    @staticmethod
    def _compute(model: ServedModel, kind: str, jobs: list[Job], lease) -> list[dict]:
        queries = [j.request.query() for j in jobs]
        if kind == "recommend":
            out = model.recommend(queries, [j.request.k for j in jobs], lease)
            return [{"items": items, "scores": scores} for items, scores in out]
        return [{"scores": s} for s in model.score(queries, [j.request.candidates for j in jobs], lease)]


class Metrics:
    """Prometheus metrics of the server and of the served version's inference table."""

    def __init__(self, snapshots: Snapshots):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("hstu_requests", "Requests answered", ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("hstu_request_seconds", "Request latency", ["endpoint"], registry=self.registry,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.batch = Histogram("hstu_batch_size", "Requests per device batch", registry=self.registry,
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.snapshots = snapshots
        self.registry.register(self)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        with self.snapshots.use() as (version, model):
            stats = model.table.stats()
        info = GaugeMetricFamily("hstu_model_version", "The model version served", labels=["version"])
        info.add_metric([version], 1)
        yield info
        for name, help_, values in (
            ("hstu_embedding_hit_rate", "Share of ids each tier served", {t: stats.hit_rate(t) for t in ("device", "host", "disk")}),
            ("hstu_embedding_rows", "Rows each tier holds", {"device": stats.device_rows, "host": stats.host_rows, "disk": stats.disk_rows}),
            ("hstu_embedding_bytes", "Bytes each tier takes", {"device": stats.device_bytes, "host": stats.host_bytes, "disk": stats.disk_bytes}),
            ("hstu_embedding_evictions", "Rows evicted from each cache", {"device": stats.device_evictions, "host": stats.host_evictions}),
        ):
            family = GaugeMetricFamily(name, help_, labels=["tier"])
            for tier, value in values.items():
                family.add_metric([tier], value)
            yield family
        for name, value, help_ in (
            ("hstu_embedding_lookups", stats.lookups, "Distinct ids looked up"),
            ("hstu_embedding_missing", stats.missing, "Ids found in no tier"),
            ("hstu_embedding_prefetched", stats.prefetched, "Ids prefetched"),
            ("hstu_embedding_prefetch_hits", stats.prefetch_hits, "Ids on the device thanks to prefetch"),
            ("hstu_embedding_locked", stats.locked, "Ids locked on the device"),
            ("hstu_embedding_updates", stats.updates, "Rows streamed in"),
            ("hstu_embedding_update_lag_seconds", stats.update_lag_s, "Age of the last applied dump"),
        ):
            yield GaugeMetricFamily(name, help_, value=value)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def check_export(export: str | Path) -> Path:
    """export as a Path, if it holds an export.json (ServedModel checks the rest as it
    loads); else FileNotFoundError."""
    export = Path(export)
    if not (export / "export.json").is_file():
        raise FileNotFoundError(f"{export}: not an exported model (no export.json)")
    return export


def loader(config: ServingConfig, device: torch.device | str, work_dir: Path):
    """A function export dir → ServedModel, each version's disk store in a directory of
    its own under work_dir."""
    def load(export: str | Path) -> ServedModel:
        return ServedModel(check_export(export), work_dir / "stores" / uuid.uuid4().hex, config, device)

    return load


def create_app(export: str | Path, config: ServingConfig = ServingConfig(), device: str = "cpu",
               work_dir: str | Path = "serve-work", max_batch: int = 64, max_wait_ms: float = 2.0) -> FastAPI:
    """The server for an export (loaded when the app starts)."""
    load = loader(config, device, Path(work_dir))
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        model = await asyncio.to_thread(load, export)
        state["snapshots"] = Snapshots(model.version, model, lambda m: m.close())
        state["metrics"] = Metrics(state["snapshots"])
        state["batcher"] = Batcher(state["snapshots"], max_batch, max_wait_ms / 1000, state["metrics"].batch.observe)
        state["swap"] = asyncio.Lock()
        yield
        state["batcher"].stop()
        state["snapshots"].close()

    app = FastAPI(title="hstu", lifespan=lifespan)
    app.state.serving = state

    @app.middleware("http")
    async def measure(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        if "metrics" in state:
            endpoint = request.url.path
            state["metrics"].requests.labels(endpoint, str(response.status_code)).inc()
            state["metrics"].latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    async def run(kind: str, body) -> dict:
        try:
            return await asyncio.wrap_future(state["batcher"].submit(kind, body))
        except ValueError as e:  # the request's content (an id the table refuses, ...)
            raise HTTPException(422, str(e)) from None

    @app.post("/recommend")
    async def recommend(body: RecommendRequest) -> dict:
        return await run("recommend", body)

    @app.post("/score")
    async def score(body: ScoreRequest) -> dict:
        return await run("score", body)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "version": state["snapshots"].version}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = await asyncio.to_thread(state["metrics"].text)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/admin/update")
    async def update(body: UpdateRequest) -> dict:
        def apply() -> tuple[str, int]:
            with state["snapshots"].use() as (version, model):
                if body.dump is not None:
                    return version, model.apply_dump(body.dump)
                rows = torch.tensor(body.rows, dtype=torch.float32)
                if rows.shape[1:] != (model.table.dim,):
                    raise ValueError(f"rows must have {model.table.dim} values each, got shape {tuple(rows.shape)}")
                model.update(torch.tensor(body.ids, dtype=torch.int64), rows)
                return version, len(body.ids)

        try:
            version, n = await asyncio.to_thread(apply)
        except (ValueError, OSError, DumpError) as e:
            raise HTTPException(422, str(e)) from None
        return {"version": version, "rows": n}

    @app.post("/admin/snapshot")
    async def snapshot(body: SnapshotRequest) -> dict:
        async with state["swap"]:  # one load at a time
            try:
                model = await asyncio.to_thread(load, body.export)  # aside: requests go on meanwhile
            except (OSError, DumpError, ValueError, KeyError) as e:
                raise HTTPException(422, f"{body.export}: {e}") from None
            version = body.version or model.version
            if version == state["snapshots"].version:
                await asyncio.to_thread(model.close)
                raise HTTPException(409, f"version {version} is already served (name the new one with \"version\")")
            model.version = version
            previous = state["snapshots"].swap(version, model)
        return {"version": version, "previous": previous}

    @app.exception_handler(HTTPException)
    async def message(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse({"error": e.detail}, status_code=e.status_code)

    return app


def serve(export: str, host: str = "0.0.0.0", port: int = 8080, **kwargs) -> None:
    import uvicorn

    check_export(export)  # a path without an export is the command's error, not the server's startup failure
    uvicorn.run(create_app(export, **kwargs), host=host, port=port, log_level="info")
