"""Durable file helpers for every writer of checkpoints, dumps, models and exports.

A file's digest for checking it against its manifest, fsync, and JSON written through a
temporary file and a rename, so that a crash never leaves a half-written file in place.
"""
import hashlib
import json
import os
from pathlib import Path

READ_BLOCK = 1 << 20  # bytes read at a time while hashing


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """The hex digest of a file's bytes, read in blocks (files may be larger than memory)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(READ_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: str | Path) -> None:
    """Flushes a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str | Path, obj) -> None:
    """Writes JSON through a temporary file, fsync and rename: never a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    fsync_path(tmp)
    os.replace(tmp, path)
