"""Versions of a served object (an inference table, a served model) swapped without
downtime.

One version is current. A user takes it for the length of a request (`use`), so a request
sees one version from its start to its end, whatever swaps happen meanwhile. `swap`
makes a new version current at once; the old one is closed (its memory and files
released) when its last user is done, or at once if it has none.
"""
import threading
from contextlib import contextmanager
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Snapshots(Generic[T]):
    def __init__(self, version: str, obj: T, close: Callable[[T], None]):
        self._lock = threading.Lock()
        self._close = close
        self._current = (version, obj)
        self._users: dict[str, int] = {version: 0}
        self._retired: dict[str, T] = {}  # swapped out, still in use
        self.closed: list[str] = []  # versions closed so far, oldest first

    @property
    def version(self) -> str:
        return self._current[0]

    @contextmanager
    def use(self):
        """(version, object) of the current version, held until the block ends."""
        with self._lock:
            version, obj = self._current
            self._users[version] += 1
        try:
            yield version, obj
        finally:
            self._leave(version)

    def swap(self, version: str, obj: T) -> str:
        """Makes `version` current; returns the one it replaced."""
        with self._lock:
            if version in self._users:
                raise ValueError(f"version {version!r} is already loaded")
            old, old_obj = self._current
            self._current = (version, obj)
            self._users[version] = 0
            self._retired[old] = old_obj
            idle = self._users[old] == 0
        if idle:
            self._retire(old)
        return old

    def close(self) -> None:
        """Closes the current version (and any retired one still open): serving is over."""
        with self._lock:
            versions = list(self._retired) + [self._current[0]]
            self._retired[self._current[0]] = self._current[1]
        for v in versions:
            self._retire(v)

    def _leave(self, version: str) -> None:
        with self._lock:
            self._users[version] -= 1
            idle = self._users[version] == 0 and version in self._retired
        if idle:
            self._retire(version)

    def _retire(self, version: str) -> None:
        with self._lock:
            obj = self._retired.pop(version, None)
            if obj is None:
                return
            del self._users[version]
        self._close(obj)
        self.closed.append(version)
