"""Timing shared by the benchmark scripts: the median wall time of a call over repeats.

The scripts run as ``python bench/<x>.py`` with the repository root on ``sys.path``,
so they import this as ``bench.lib.timing`` (a helper module, not a benchmark).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def timed_median(fn: Callable[[], T], reps: int, *, warmup: int = 0) -> tuple[float, T]:
    """Call ``fn`` ``warmup`` times untimed, then ``reps`` times timed.

    Returns:
        (median wall seconds of the timed calls, the result of the last call).

    Raises:
        ValueError: ``reps`` is below 1 (there is no median of nothing).
    """
    if reps < 1:
        raise ValueError(f"reps must be at least 1 to take a median, got {reps!r}")
    for _ in range(warmup):
        fn()
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def median_time(fn: Callable[[], object], reps: int, *, warmup: int = 0) -> float:
    """The median wall seconds of ``reps`` calls of ``fn`` (after ``warmup`` untimed calls)."""
    return timed_median(fn, reps, warmup=warmup)[0]
