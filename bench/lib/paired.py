"""Paired timing for the store benchmark (``bench/store_bench.py``): ours against a raw baseline.

Each measurement is one untimed warm-up pair, then timed pairs with ours and raw
alternating which goes first. Before every timed operation, untimed: ``os.sync()``, a GC
pass, and touching then freeing ``Timer.warm_bytes`` of memory (see :func:`warm_memory`).
:func:`summarise` gives the medians as MB/s and their ratio.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass
class Pair:
    ours: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)


def warm_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and free it. On a VM whose balloon reports free
    pages to the host (this one: virtio-balloon free page reporting), memory freed a
    couple of seconds ago costs a host fault per page when it is touched again, so the
    first writer of new page cache or the first reader into a new buffer pays a cost that
    depends on what ran before. Touching (and freeing) the memory an operation is about to
    take puts every operation, ours and raw, on the same footing."""
    if nbytes > 0:
        np.ones(nbytes, dtype=np.uint8)


@dataclass
class Timer:
    """Times operations; ``warm_bytes`` is the memory touched and freed before each (set per snapshot size)."""

    warm_bytes: int = 0

    def timed(self, fn: Callable[[], object], prepare: Callable[[], object] | None = None) -> float:
        """Seconds ``fn`` takes, after ``prepare``, ``os.sync()``, a GC pass and warming memory
        (all untimed)."""
        if prepare is not None:
            prepare()
        os.sync()
        gc.collect()
        warm_memory(self.warm_bytes)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def alternate(reps: int, ours: Callable[[], float], raw: Callable[[], float], warmup: int = 1) -> Pair:
    """``warmup`` untimed pairs, then ``reps`` timed pairs; even pairs run ours first."""
    out = Pair()
    for i in range(warmup + reps):
        order = ((ours, out.ours), (raw, out.raw)) if i % 2 == 0 else ((raw, out.raw), (ours, out.ours))
        for fn, sink in order:
            t = fn()
            if i >= warmup:
                sink.append(t)
    return out


def summarise(pair: Pair, nbytes: int) -> dict:
    """Medians as MB/s of ``nbytes``, the ratio ours/raw throughput (of medians and of minima), every time."""
    o, r = statistics.median(pair.ours), statistics.median(pair.raw)
    return {
        "ours_mb_s": round(nbytes / o / 1e6, 1),
        "raw_mb_s": round(nbytes / r / 1e6, 1),
        "ratio": round(r / o, 3),
        "ratio_of_min": round(min(pair.raw) / min(pair.ours), 3),
        "ours_s": [round(x, 6) for x in pair.ours],
        "raw_s": [round(x, 6) for x in pair.raw],
    }
