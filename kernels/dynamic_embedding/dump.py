"""Distributed dump and load of dynamic embedding tables.

A dump is a directory:

    shard-00000-of-00002.safetensors   keys (int64), embeddings, optimizer_state, scores (int64)
    shard-00001-of-00002.safetensors
    manifest.json                      written last: config, step, rows and sha256 per shard

Every rank writes its shard into a hidden temporary directory; rank 0 checksums them,
writes the manifest, fsyncs and renames the directory into place. A directory without a
manifest, or whose files do not match it, is refused. No pickle anywhere.

Loading works on any world size: each rank reads every shard and keeps the keys it owns.
An incremental dump holds only rows whose score reached `min_score` (with LRU scores:
rows touched since a step); load it after its base to bring the table up to date.
"""
import json
import os
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..files import commit_directory, file_digest, fsync_path, write_json_atomic
from .embedding import EmbeddingConfig
from .sharded import ShardedDynamicEmbedding
from .hashing import shard_of

FORMAT = "hstu-dynamic-embedding-dump"
VERSION = 1
MANIFEST = "manifest.json"
_TENSORS = ("keys", "embeddings", "optimizer_state", "scores")


class DumpError(RuntimeError):
    """A dump that is missing, partial, corrupt or does not fit the table."""


def barrier(world_size: int, group) -> None:
    if world_size > 1:
        dist.barrier(group=group)


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def dump(
    table: ShardedDynamicEmbedding,
    path: str | Path,
    min_score: int | None = None,
    metadata: dict | None = None,
    replace: bool = False,
) -> Path:
    """Collective: writes every rank's rows (or those with score >= min_score) to `path`.

    The directory appears complete or not at all. An existing `path` is an error unless
    `replace`, which swaps the new dump in only once it is complete.
    """
    path = Path(path)
    world, rank, group = table.world_size, table.rank, table.group
    tmp = path.with_name(f".{path.name}.partial")
    if path.exists() and not replace:  # every rank checks: one raising alone would hang the rest
        raise DumpError(f"{path}: already exists (pass replace=True to overwrite)")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed dump
        tmp.mkdir(parents=True)
    barrier(world, group)

    _write_shard(tmp, rank, world, table.local.export_rows(min_score))
    barrier(world, group)
    if rank == 0:
        _commit(tmp, path, world, table.step, table.config.to_dict(), min_score, metadata, replace)
    barrier(world, group)
    return path


def _write_shard(directory: Path, rank: int, world: int, rows: tuple) -> None:
    """One rank's shard, fsynced, and beside it its completion record (bytes, sha256, rows)."""
    shard = directory / shard_name(rank, world)
    save_file({k: v.detach().contiguous().cpu() for k, v in zip(_TENSORS, rows)}, shard)
    fsync_path(shard)
    record = {"file": shard.name, "bytes": shard.stat().st_size, "sha256": file_digest(shard), "rows": len(rows[0])}
    write_json_atomic(_record_path(directory, rank, world), record)


def _record_path(directory: Path, rank: int, world: int) -> Path:
    return directory / f"{shard_name(rank, world)}.done"


def _commit(
    directory: Path, path: Path, world: int, step: int, config: dict, min_score, metadata, replace: bool = False
) -> None:
    """Rank 0, once every rank's record is there: the manifest written last, then the
    directory renamed into place (swapping out an existing dump only with replace)."""
    records = [_record_path(directory, r, world) for r in range(world)]
    shards = [json.loads(r.read_text()) for r in records]
    for r in records:
        r.unlink()
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "kind": "full" if min_score is None else "incremental",
        "min_score": min_score,
        "step": step,
        "world_size": world,
        "total_rows": sum(s["rows"] for s in shards),
        "config": config,
        "metadata": metadata or {},
        "shards": shards,
    }
    write_json_atomic(directory / MANIFEST, manifest)
    if path.exists() and not replace:
        raise DumpError(f"{path}: already exists")
    commit_directory(directory, path)


def read_format_json(path: Path, fmt: str, version: int, missing: str) -> dict:
    """A JSON file that names its format and version; DumpError(missing) if absent."""
    if not path.is_file():
        raise DumpError(missing)
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DumpError(f"{path}: unreadable: {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != fmt or obj.get("version") != version:
        raise DumpError(f"{path}: not a {fmt} v{version} file")
    return obj


def read_manifest(path: str | Path) -> dict:
    """The manifest of a complete dump, after checking every shard against it."""
    path = Path(path)
    manifest = read_format_json(
        path / MANIFEST, FORMAT, VERSION, f"{path}: not a complete dump (no {MANIFEST}); it may be partial"
    )
    for s in manifest["shards"]:
        f = path / s["file"]
        if not f.is_file():
            raise DumpError(f"{f}: shard listed in the manifest is missing")
        if f.stat().st_size != s["bytes"]:
            raise DumpError(f"{f}: {f.stat().st_size} bytes, manifest says {s['bytes']} (truncated?)")
        if file_digest(f) != s["sha256"]:
            raise DumpError(f"{f}: checksum mismatch (corrupted)")
    return manifest


def read_shard(path: Path, entry: dict, dim: int) -> dict[str, torch.Tensor]:
    f = path / entry["file"]
    try:
        t = load_file(f)
    except (SafetensorError, OSError) as e:
        raise DumpError(f"{f}: unreadable shard: {e}") from None
    if set(t) != set(_TENSORS):
        raise DumpError(f"{f}: expected tensors {_TENSORS}, found {sorted(t)}")
    n = t["keys"].numel()
    if n != entry["rows"] or t["embeddings"].shape != (n, dim) or t["scores"].numel() != n:
        raise DumpError(f"{f}: shapes do not match the manifest ({n} keys, dim {dim})")
    return t


def load(table: ShardedDynamicEmbedding, path: str | Path) -> dict:
    """Loads a verified dump into the table, keeping this rank's keys; returns the manifest.

    The table's embedding dim and optimizer must match the dump's. Its step becomes the
    dump's step.
    """
    path = Path(path)
    manifest = read_manifest(path)
    saved = EmbeddingConfig.from_dict(manifest["config"])
    cfg = table.config
    if saved.dim != cfg.dim or saved.optimizer.name != cfg.optimizer.name:
        raise DumpError(
            f"{path}: dump has dim {saved.dim} / optimizer {saved.optimizer.name}, "
            f"table has dim {cfg.dim} / optimizer {cfg.optimizer.name}"
        )
    for entry in manifest["shards"]:
        t = read_shard(path, entry, saved.dim)
        mine = shard_of(t["keys"], table.world_size) == table.rank
        table.local.import_rows(*(t[name][mine] for name in _TENSORS))
    table.local.step = max(table.local.step, manifest["step"])
    return manifest


class PendingDump:
    """A dump being written in the background; wait() returns its path or raises."""

    def __init__(self, path: Path):
        self.path = path
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _run(self, fn) -> None:
        def target():
            try:
                fn()
            except BaseException as e:  # handed to wait()
                self._error = e

        self._thread = threading.Thread(target=target, name=f"dump {self.path.name}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.path}: dump still being written after {timeout} s")
        if self._error is not None:
            raise DumpError(f"{self.path}: background dump failed: {self._error}") from self._error
        return self.path


def dump_async(
    table: ShardedDynamicEmbedding,
    path: str | Path,
    min_score: int | None = None,
    metadata: dict | None = None,
    commit_timeout_s: float = 3600.0,
) -> PendingDump:
    """Collective at the call, then non-blocking: the table's rows as they are now.

    Each rank exports its rows at the call (the snapshot: a copy, on the table's device,
    held until written); a background thread moves it to the host, writes the shard and a
    completion record; rank 0's thread writes the manifest and renames the directory into
    place once every rank's record is there. The threads use the filesystem, not the
    process group, so training may keep using it.
    """
    path = Path(path)
    world, rank, group = table.world_size, table.rank, table.group
    if path.exists():
        raise DumpError(f"{path}: already exists")
    # names this dump's files; not from torch's generator, which training's randomness uses
    token = torch.tensor([int.from_bytes(os.urandom(7), "little")], device=table.local.device)
    if world > 1:
        dist.broadcast(token, src=0, group=group)
    tmp = path.with_name(f".{path.name}.partial-{int(token)}")
    snapshot = table.local.export_rows(min_score)  # a copy: training may go on
    step, config = table.step, table.config.to_dict()
    pending = PendingDump(path)

    def write() -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        _write_shard(tmp, rank, world, snapshot)
        if rank != 0:
            return
        deadline = time.monotonic() + commit_timeout_s
        while not all(_record_path(tmp, r, world).is_file() for r in range(world)):
            if time.monotonic() > deadline:
                raise DumpError(f"{tmp}: not every rank finished its shard in {commit_timeout_s} s")
            time.sleep(0.05)
        _commit(tmp, path, world, step, config, min_score, metadata)

    pending._run(write)
    return pending
