"""Counters a store keeps: the raw material of the hit-rate and security-audit metrics.

Each figure of the store is counted here once. Readers of a figure read it from here:
``Store.stats`` for the CLI and the prefill job, the loader's ``stats()["store"]``, and
the loader's ``kvwarm_loader_refused_cross_tenant`` series (the store refuses, and counts,
every cross-tenant attempt; nothing else counts it again).
"""
from __future__ import annotations

import threading
from collections import Counter


class StoreStats:
    """Thread-safe named counters (``hits``, ``misses``, ``expired``, ``corrupt``,
    ``mismatched``, ``unknown_version``, ``undecryptable``, ``quarantined``, ``refused``,
    ``read_through``, ``unavailable``, ``writes``, ``writes_skipped``; ``audit_differed`` from
    ``prefill store audit``)."""

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
