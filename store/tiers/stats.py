"""Counters a store keeps: the raw material of the hit-rate and security-audit metrics."""
from __future__ import annotations

import threading
from collections import Counter


class StoreStats:
    """Thread-safe named counters (``hits``, ``misses``, ``expired``, ``corrupt``,
    ``mismatched``, ``quarantined``, ``refused``, ``read_through``, ``unavailable``...)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def as_dict(self) -> dict[str, int]:
        """A snapshot of all counters."""
        with self._lock:
            return dict(self._counts)
