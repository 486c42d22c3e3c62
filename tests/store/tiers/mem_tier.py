"""A toy tier that keeps snapshots in a dict: what adding a storage tier takes.

One module (this one) and one registry line (``TIERS["mem"] = "tests.store.tiers.mem_tier:MemTier"``,
which the tests set with ``monkeypatch``). It is local (in-process), stores bytes, maps
nothing and keeps no cap: the capabilities a tier does not claim are the store's to
handle (existence checks before writes, sealing, GC by age).
"""
from __future__ import annotations

import threading
import time
from typing import Iterator, Sequence

import pyarrow as pa

from store.config import StoreConfig
from store.errors import ConfigError
from store.format.encode import EncodedSnapshot, snapshot_bytes
from store.tiers.base import SUFFIX, Entry, Tier


class MemTier(Tier):
    """Snapshots in this process's memory under ``mem://name``."""

    scheme = "mem"
    remote = False
    kind = "mem"

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._meta: dict[str, bytes] = {}
        self._quarantine: dict[str, bytes] = {}

    @classmethod
    def from_url(cls, url: str, settings: StoreConfig, *, create_bucket: bool = False) -> "MemTier":
        if not url.startswith("mem://") or len(url) <= len("mem://"):
            raise ConfigError(f"store.url: {url!r} is not a memory tier URL (expected mem://name)")
        return cls(url.rstrip("/"))

    def read(self, name: str, *, readahead: bool = False) -> pa.Buffer | None:
        with self._lock:
            found = self._objects.get(name)
        return None if found is None else pa.py_buffer(found[0])

    def write(self, name: str, data: EncodedSnapshot | bytes | pa.Buffer, *, expires_at: float) -> bool:
        raw = snapshot_bytes(data) if isinstance(data, EncodedSnapshot) else bytes(memoryview(data))
        with self._lock:
            self._objects[name] = (raw, time.time())
        return True

    def exists(self, name: str) -> bool:
        with self._lock:
            return name in self._objects

    def probe(self, names: Sequence[str]) -> int:
        with self._lock:
            n = 0
            while n < len(names) and names[n] in self._objects:
                n += 1
            return n

    def delete(self, name: str) -> bool:
        with self._lock:
            return self._objects.pop(name, None) is not None

    def entries(self, prefix: str = "") -> Iterator[Entry]:
        with self._lock:
            found = sorted((n, len(raw), t) for n, (raw, t) in self._objects.items() if n.startswith(prefix))
        for name, size, mtime in found:
            yield Entry(name, size, mtime)

    def quarantine(self, name: str, reason: str) -> str | None:
        with self._lock:
            found = self._objects.pop(name, None)
            if found is None:
                return None
            where = f"{self.url}/_quarantine/{name.replace('/', '__')}.{len(self._quarantine)}{SUFFIX}"
            self._quarantine[where] = found[0]
        return where

    def quarantined(self) -> list[Entry]:
        with self._lock:
            return [Entry(w.rsplit("/", 1)[-1], len(raw), 0.0) for w, raw in sorted(self._quarantine.items())]

    def evidence(self, where: str) -> bytes:
        """The bytes a :meth:`quarantine` kept at ``where`` (for tests)."""
        with self._lock:
            return self._quarantine[where]

    def get_meta(self, name: str) -> bytes | None:
        with self._lock:
            return self._meta.get(name)

    def put_meta(self, name: str, data: bytes) -> None:
        with self._lock:
            self._meta[name] = bytes(data)

    def list_meta(self, prefix: str) -> list[str]:
        with self._lock:
            return sorted(n for n in self._meta if n.startswith(prefix))
