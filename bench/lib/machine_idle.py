"""How busy the machine is, for benches that must not measure one step's background work in the next.

A bench on a shared 2-core machine waits, between the steps it compares, until the work a step
leaves behind (kvwarm's write-back and uploads, its node, a peer's server, the stand-in S3) has
stopped using the cores, and reports how long it waited; the same wait for every system.
"""
from __future__ import annotations

import os
import time


def machine_cpu() -> tuple[float, float]:
    """CPU seconds so far of the whole machine (every core's busy time, /proc/stat) and of this process."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    mine = os.times()
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), mine.user + mine.system


def others_cpu_s(start: tuple[float, float], end: tuple[float, float]) -> float:
    """CPU seconds the machine's other processes spent between two :func:`machine_cpu` readings."""
    return max(0.0, (end[0] - start[0]) - (end[1] - start[1]))


def wait_quiet(timeout_s: float, *, every_s: float = 0.5, below: float = 0.1, include_self: bool = False) -> float:
    """Wait until the machine's other processes (with ``include_self``, this one's threads too: call it from
    a thread that is otherwise idle) use less than ``below`` of a core over ``every_s``, at most
    ``timeout_s``; returns the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        a = machine_cpu()
        time.sleep(every_s)
        b = machine_cpu()
        busy = (b[0] - a[0]) if include_self else others_cpu_s(a, b)
        if busy < below * every_s:
            break
    return time.perf_counter() - t0
