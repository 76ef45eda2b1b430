"""A trained model on disk, the unit that dump, evaluate and export pass along:

    model.json            written last: format, config, sha256 of dense weights
    dense.safetensors     HSTU weights
    embeddings/           the item table's dump (kernels.dynamic_embedding.dump); with
                          item features, the genre table's in embeddings/genre/
    item_features.safetensors   with item features: each item's genre ids (ItemFeatures)

The SASRec baseline's directory holds its weights (its item embedding among them) and
the catalog its item indices refer to, `items.safetensors`, under format "sasrec-model".

The directory is built under a hidden temporary name and renamed into place, so it exists
complete or not at all; loading checks every checksum. No pickle.
"""
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kernels.dynamic_embedding import DumpError, read_manifest
from kernels.dynamic_embedding.dump import barrier, read_format_json
from kernels.files import commit_directory, file_digest, write_json_atomic

from .config import HSTUConfig
from .hstu import HSTU
from .item_embedding import GENRE, ItemEmbedding, dump_path
from .item_features import ItemFeatures
from .sasrec import SASRec, SASRecConfig

FORMAT = "hstu-model"
SASREC_FORMAT = "sasrec-model"
VERSION = 1
FEATURES_FILE = "item_features.safetensors"


def save(path: str | Path, model: HSTU, items: ItemEmbedding, metadata: dict | None = None) -> Path:
    """Collective over the tables' ranks; rank 0 writes the dense part and commits."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    world, rank, group = items.tables.world_size, items.tables.rank, items.tables.group
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world, group)
    items.dump(tmp / "embeddings", metadata=metadata)
    if rank == 0:
        dense = tmp / "dense.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, dense)
        info = {
            "format": FORMAT,
            "version": VERSION,
            "config": model.config.to_dict(),
            "dense_sha256": file_digest(dense),
            "metadata": metadata or {},
        }
        if items.features is not None:
            save_file({k: v.cpu().contiguous() for k, v in items.features.as_tensors().items()}, tmp / FEATURES_FILE)
            info["item_features_sha256"] = file_digest(tmp / FEATURES_FILE)
        write_json_atomic(tmp / "model.json", info)
        commit_directory(tmp, path)
    barrier(world, group)
    return path


def read_info(path: str | Path) -> dict:
    """model.json of a complete model directory, after verifying every file."""
    path = Path(path)
    info = read_format_json(path / "model.json", FORMAT, VERSION, f"{path}: not a complete model directory (no model.json)")
    dense = path / "dense.safetensors"
    if not dense.is_file() or file_digest(dense) != info["dense_sha256"]:
        raise DumpError(f"{dense}: missing or checksum mismatch (corrupted)")
    read_manifest(path / "embeddings")
    if "item_features_sha256" in info:
        features = path / FEATURES_FILE
        if not features.is_file() or file_digest(features) != info["item_features_sha256"]:
            raise DumpError(f"{features}: missing or checksum mismatch (corrupted)")
        read_manifest(dump_path(path / "embeddings", GENRE))
    return info


def load_model(path: str | Path, device: torch.device | str = "cpu", item_table: bool = True) -> tuple[HSTU, ItemEmbedding, dict]:
    """(model in eval mode, its item embeddings, model.json) from a verified model directory.

    The tables take the keys this process owns: all of them without a process group.
    Without item_table the item table is left empty (serving reads its dump itself)."""
    path = Path(path)
    info = read_info(path)
    config = HSTUConfig.from_dict(info["config"])
    model = HSTU(config)
    model.load_state_dict(load_file(path / "dense.safetensors"))
    model.to(device).eval()
    features = None
    if "item_features_sha256" in info:
        features = ItemFeatures.from_tensors(load_file(path / FEATURES_FILE), str(path / FEATURES_FILE))
    items = ItemEmbedding(config, device, features)
    items.load(path / "embeddings", item_table)
    return model, items, info


def save_sasrec(path: str | Path, model: SASRec, catalog: torch.Tensor, metadata: dict | None = None) -> Path:
    """The SASRec baseline's directory, committed by rename (one process writes it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dense, items = tmp / "dense.safetensors", tmp / "items.safetensors"
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, dense)
    save_file({"item_ids": catalog.detach().cpu().contiguous()}, items)
    write_json_atomic(tmp / "model.json", {
        "format": SASREC_FORMAT, "version": VERSION, "config": model.config.to_dict(),
        "dense_sha256": file_digest(dense), "items_sha256": file_digest(items), "metadata": metadata or {},
    })
    commit_directory(tmp, path)
    return path


def load_sasrec(path: str | Path, device: torch.device | str = "cpu") -> tuple[SASRec, torch.Tensor, dict]:
    """(model in eval mode, its catalog, model.json) from a verified SASRec directory."""
    path = Path(path)
    info = read_format_json(path / "model.json", SASREC_FORMAT, VERSION, f"{path}: not a complete SASRec model (no model.json)")
    for name, key in (("dense.safetensors", "dense_sha256"), ("items.safetensors", "items_sha256")):
        if not (path / name).is_file() or file_digest(path / name) != info[key]:
            raise DumpError(f"{path / name}: missing or checksum mismatch (corrupted)")
    model = SASRec(SASRecConfig.from_dict(info["config"]))
    model.load_state_dict(load_file(path / "dense.safetensors"))
    return model.to(device).eval(), load_file(path / "items.safetensors")["item_ids"], info
