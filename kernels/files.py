"""Durable file helpers for every writer of checkpoints, dumps, models and exports.

A file's digest for checking it against its manifest, fsync, JSON written through a
temporary file and a rename, and a directory written aside then put in place, so that a
crash never leaves a half-written file or directory where a reader looks.
"""
import ctypes
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

READ_BLOCK = 1 << 20  # bytes read at a time while hashing
AT_FDCWD = -100  # renameat2's "relative to the working directory" (Linux)
RENAME_EXCHANGE = 2  # renameat2's flag: swap the two paths atomically (Linux 3.15+)


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


def commit_directory(tmp: str | Path, path: str | Path, replace: bool = True) -> None:
    """Puts the complete directory `tmp` in place at `path`: its files and entries flushed
    to disk, then renamed. An existing `path` (only with `replace`, else FileExistsError)
    is swapped with `tmp` in one atomic step where the system has one (Linux's renameat2),
    so that `path` holds the old directory or the new one at every instant, then removed;
    elsewhere it is renamed aside first (a crash between the two renames leaves both, the
    old one as `.NAME.old`)."""
    tmp, path = Path(tmp), Path(path)
    for root, _, files in os.walk(tmp):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(root)
    if not path.exists():
        os.replace(tmp, path)
    elif not replace:
        raise FileExistsError(f"{path}: already exists")
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # the old directory, now under tmp's name
    else:
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    fsync_path(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths atomically (renameat2 with RENAME_EXCHANGE); False where the system
    or the file system has no such call."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
