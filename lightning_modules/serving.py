"""One exported model version, served: the dense HSTU model, its item rows through a tiered
inference table (kernels.dynamic_embedding.inference), and the catalog's embeddings on
the device for ranking every candidate.

Requests come in batches (pipelines/serve.py gathers them): every history of a batch goes
through the model as one jagged batch, and

- `recommend`: the top k of the whole catalog after each history (the history's items
  excluded, as evaluation does), brute force on the device, CATALOG_CHUNK candidates at a
  time with a running top k;
- `score`: the scores of given candidates after each history (the ranking use).

A score is the cosine-scaled product the model ranks by: the history's output at its last
position against the candidate's normalized embedding, as `export.Recommender` computes.
"""
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kernels.dynamic_embedding.inference import InferenceTable, Lease

from .export import read_export_info
from . import model_files

CATALOG_CHUNK = 1 << 16  # candidates scored per product in recommend


@dataclass(frozen=True)
class ServingConfig:
    device_rows: int = 1 << 20  # item rows the device cache holds
    host_rows: int = 0  # item rows the host cache holds (0: none)
    missing: str = "initial"  # rows of ids in no tier: the training table's initial row, or zeros
    bucket_size: int = 32
    max_history: int = 10_000  # longer requests are refused (the model reads the last max_seq_len)
    max_candidates: int = 10_000
    max_k: int = 1_000


@dataclass
class Query:
    """One request's history, oldest first."""

    history: list[int]
    timestamps: list[int] | None = None


class ServedModel:
    """An export loaded for serving. `version` is the export's model version."""

    def __init__(self, export_dir: Path, store_dir: Path, config: ServingConfig, device: torch.device | str = "cpu"):
        info = read_export_info(export_dir)
        self.info, self.version, self.config = info, str(info["model_version"]), config
        self.device = torch.device(device)
        self.model, self.items, _ = model_files.load_model(export_dir / "model", self.device, item_table=False)
        self.max_len = self.model.config.max_seq_len
        self.table = InferenceTable.from_dump(
            export_dir / "model" / "embeddings", store_dir, config.device_rows, config.host_rows, self.device,
            config.missing, config.bucket_size,
        )
        self.catalog = load_file(export_dir / "items.safetensors")["item_ids"].to(self.device)  # sorted ids
        self.catalog_emb = torch.empty(self.catalog.numel(), self.model.config.embedding_dim, device=self.device)
        for start in range(0, self.catalog.numel(), CATALOG_CHUNK):  # straight from disk: the caches stay cold
            ids = self.catalog[start : start + CATALOG_CHUNK]
            self.catalog_emb[start : start + ids.numel()] = self._normalized(ids, self.table.peek)

    # ---- embeddings -----------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor, rows_of=None, lease: Lease | None = None) -> torch.Tensor:
        rows_of = rows_of or (lambda i: self.table.lookup(i, lease))
        return self.items.embed(ids, item_rows=rows_of)

    def _normalized(self, ids: torch.Tensor, rows_of=None, lease: Lease | None = None) -> torch.Tensor:
        return F.normalize(self._embed(ids, rows_of, lease), dim=-1)

    def item_ids(self, queries: list[Query], candidates: list[list[int]] | None = None) -> torch.Tensor:
        """Every item id a batch will look up (for prefetch)."""
        ids = [i for q in queries for i in q.history[-self.max_len :]] + [i for c in candidates or [] for i in c]
        return torch.tensor(ids, dtype=torch.int64)

    # ---- requests -------------------------------------------------------------------------
    @torch.no_grad()
    def _queries(self, queries: list[Query], lease: Lease | None) -> torch.Tensor:
        """(B, D): the model's output at the last position of each history."""
        windows = [q.history[-self.max_len :] for q in queries]
        lengths = torch.tensor([len(w) for w in windows], dtype=torch.int64)
        if (lengths == 0).any():
            raise ValueError("a history is empty")
        ids = torch.tensor([i for w in windows for i in w], dtype=torch.int64, device=self.device)
        times = torch.tensor(
            [t for q, w in zip(queries, windows) for t in ((q.timestamps or [0] * len(q.history))[-len(w) :])],
            dtype=torch.int64, device=self.device,
        )
        offsets = torch.zeros(len(windows) + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        out = self.model(self._embed(ids, lease=lease), times, offsets.to(self.device))
        return out[offsets[1:].to(self.device) - 1]

    @torch.no_grad()
    def recommend(self, queries: list[Query], ks: list[int], lease: Lease | None = None) -> list[tuple[list[int], list[float]]]:
        """Top k (item ids, scores) of the catalog after each history, its items excluded
        (fewer than k where the catalog has fewer other items)."""
        q = self._queries(queries, lease)
        k = min(max(ks), self.catalog.numel())
        # the catalog positions of each history's items: (request, position) pairs
        seen = [torch.tensor(x.history, dtype=torch.int64, device=self.device) for x in queries]
        rows = torch.cat([torch.full((s.numel(),), b, device=self.device) for b, s in enumerate(seen)])
        seen = torch.cat(seen)
        pos = torch.searchsorted(self.catalog, seen).clamp(max=self.catalog.numel() - 1)
        known = self.catalog[pos] == seen
        rows, pos = rows[known], pos[known]
        best_scores = torch.full((len(queries), k), float("-inf"), device=self.device)
        best_index = torch.zeros((len(queries), k), dtype=torch.int64, device=self.device)
        for start in range(0, self.catalog.numel(), CATALOG_CHUNK):
            chunk = self.catalog_emb[start : start + CATALOG_CHUNK]
            scores = q.float() @ chunk.T  # (B, C)
            inside = (pos >= start) & (pos < start + chunk.shape[0])
            scores[rows[inside], pos[inside] - start] = float("-inf")
            top = scores.topk(min(k, chunk.shape[0]), dim=1)
            merged = torch.cat([best_scores, top.values], 1)
            index = torch.cat([best_index, top.indices + start], 1)
            best_scores, order = merged.topk(k, dim=1)
            best_index = index.gather(1, order)
        ids, scores = self.catalog[best_index].tolist(), best_scores.tolist()
        out = []
        for i, s, kk in zip(ids, scores, ks):  # excluded items (-inf) never come back: fewer than k then
            keep = [j for j in range(min(kk, len(s))) if s[j] != float("-inf")]
            out.append(([i[j] for j in keep], [s[j] for j in keep]))
        return out

    @torch.no_grad()
    def score(self, queries: list[Query], candidates: list[list[int]], lease: Lease | None = None) -> list[list[float]]:
        """Scores of each request's candidates after its history."""
        q = self._queries(queries, lease)
        flat = torch.tensor([c for cs in candidates for c in cs], dtype=torch.int64, device=self.device)
        owner = torch.cat([torch.full((len(cs),), b, device=self.device) for b, cs in enumerate(candidates)])
        scores = (self._normalized(flat, lease=lease) * q.float()[owner]).sum(1).tolist()
        out, at = [], 0
        for cs in candidates:
            out.append(scores[at : at + len(cs)])
            at += len(cs)
        return out

    # ---- updates --------------------------------------------------------------------------
    def update(self, ids: torch.Tensor, rows: torch.Tensor, lag_s: float = 0.0) -> None:
        """Streams item rows in: the inference table's tiers, and the catalog's embeddings."""
        self.table.update(ids, rows, lag_s)
        self._refresh_catalog(ids)

    def apply_dump(self, path: str | Path) -> int:
        """Streams a training dump's rows in (an incremental one: the rows trained since)."""
        keys = self.table.apply_dump(path)
        self._refresh_catalog(keys)
        return keys.numel()

    def _refresh_catalog(self, ids: torch.Tensor) -> None:
        ids = ids.to(self.device, torch.int64)
        pos = torch.searchsorted(self.catalog, ids).clamp(max=max(self.catalog.numel() - 1, 0))
        known = (self.catalog[pos] == ids) if self.catalog.numel() else torch.zeros_like(ids, dtype=torch.bool)
        if known.any():
            self.catalog_emb[pos[known]] = self._normalized(ids[known])

    def close(self) -> None:
        """Releases the version: its tables, its disk store's files, its device memory."""
        self.table.close(remove_files=True)
        self.model = self.items = self.catalog_emb = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
