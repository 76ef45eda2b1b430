"""The exported model: one versioned directory that serves top-k recommendations.

    export.json          written last: format, model version, candidate count, metrics
    items.safetensors    candidate item ids (the catalog)
    model/               the model directory (config, dense weights, embedding dump)

`Recommender.load(path)` verifies it and answers `recommend(history, k)`.
"""
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kernels.dynamic_embedding import DumpError
from kernels.dynamic_embedding.dump import read_format_json
from kernels.files import commit_directory, file_digest, write_json_atomic

from . import model_files
from .data import Sequences

FORMAT = "hstu-export"
VERSION = 1


def export(model_dir: str | Path, data_dir: str | Path, out_dir: str | Path, model_version: str, metrics: dict | None = None) -> Path:
    """Packs a verified model directory and the dataset's item catalog into `out_dir`."""
    model_files.read_info(model_dir)
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(model_dir, tmp / "model")
    catalog = Sequences(Path(data_dir) / "test.parquet", 1).all_items()
    save_file({"item_ids": torch.from_numpy(catalog)}, tmp / "items.safetensors")
    write_json_atomic(
        tmp / "export.json",
        {
            "format": FORMAT,
            "version": VERSION,
            "model_version": str(model_version),
            "candidates": int(len(catalog)),
            "items_sha256": file_digest(tmp / "items.safetensors"),
            "metrics": metrics or {},
        },
    )
    commit_directory(tmp, out)
    return out


def read_export_info(path: Path) -> dict:
    """An export directory's export.json, after checking its format and the item file's
    checksum (DumpError names the file that is wrong)."""
    info = read_format_json(path / "export.json", FORMAT, VERSION, f"{path}: not an exported model (no export.json)")
    if file_digest(path / "items.safetensors") != info["items_sha256"]:
        raise DumpError(f"{path / 'items.safetensors'}: checksum mismatch (corrupted)")
    return info


def check_aligned(history, timestamps) -> None:
    """A request's timestamps (None: none given) name one time per history item, or
    ValueError says how many each has."""
    if timestamps is not None and len(timestamps) != len(history):
        raise ValueError(f"timestamps has {len(timestamps)} entries, history {len(history)}")


@dataclass
class Recommender:
    model: torch.nn.Module
    items: object  # item_embedding.ItemEmbedding
    item_ids: torch.Tensor  # (M,) sorted candidates
    item_emb: torch.Tensor  # (M, D) normalized
    info: dict

    @staticmethod
    def load(path: str | Path, device: str = "cpu") -> "Recommender":
        path = Path(path)
        info = read_export_info(path)
        model, items, _ = model_files.load_model(path / "model", device)
        item_ids = load_file(path / "items.safetensors")["item_ids"].to(device)
        item_emb = F.normalize(items.embed(item_ids), dim=-1)
        return Recommender(model, items, item_ids, item_emb, info)

    @torch.no_grad()
    def recommend(
        self, history: list[int] | np.ndarray, timestamps: list[int] | None = None, k: int = 10, exclude_history: bool = True
    ) -> list[tuple[int, float]]:
        """Top-k (item id, cosine score) to follow a history of item ids (oldest first) and
        the times of its items (in the training data's unit; None: all 0, which the model's
        time bias reads as no gaps); the history's items excluded unless exclude_history is
        False."""
        check_aligned(history, timestamps)
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        max_len = self.model.config.max_seq_len
        ids = torch.as_tensor(np.asarray(history, dtype=np.int64)[-max_len:])
        ts = torch.as_tensor(np.asarray(timestamps if timestamps is not None else np.zeros(len(history)), dtype=np.int64)[-max_len:])
        device = self.item_emb.device
        n = ids.numel()
        scores = torch.zeros(len(self.item_ids), device=device)
        if n:
            emb = self.items.embed(ids.to(device))
            out = self.model(emb, ts.to(device), torch.tensor([0, n], device=device))
            scores = self.item_emb @ out[n - 1]
        if exclude_history and len(history):  # the whole history, not only the window the model read
            seen = torch.as_tensor(np.asarray(history, dtype=np.int64), device=device)
            pos = torch.searchsorted(self.item_ids, seen).clamp(max=len(self.item_ids) - 1)
            known = self.item_ids[pos] == seen
            scores[pos[known]] = float("-inf")
        top = torch.topk(scores, min(k, len(self.item_ids)))
        # fewer than k where the history leaves fewer candidates: excluded items never come back
        return [(int(i), float(s)) for i, s in zip(self.item_ids[top.indices].tolist(), top.values.tolist()) if s != float("-inf")]
