"""What the native gather is handed: the real module, with a record of each call's jobs.

A native job reads one head of one stored part of one block, so the offsets the jobs are
handed name exactly the bytes read (tests of a worker's share: tests/store/kernels/test_share.py,
tests/store/engines/vllm/test_worker_parallel.py).
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np


class Recorder:
    """Delegates every call to the native module it wraps, and keeps the jobs' source offsets."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.fp8_jobs: list[np.ndarray] = []  # per call: payload offsets (or addresses) of the FP8 heads read
        self.copy_jobs: list[np.ndarray] = []  # per call: payload offsets of the unquantised heads copied

    def isa(self) -> str:
        return self._native.isa()

    def gather_blocks(self, bases: Any, src: Any, *args: Any) -> None:
        self.fp8_jobs.append(np.array(src))
        return self._native.gather_blocks(bases, src, *args)

    def gather(self, src: Any, *args: Any) -> None:  # fp16 out: addresses, one job per (block, head)
        self.fp8_jobs.append(np.array(src))
        return self._native.gather(src, *args)

    def copy_blocks(self, bases: Any, src: Any, *args: Any) -> None:
        self.copy_jobs.append(np.array(src))
        return self._native.copy_blocks(bases, src, *args)

    def fp8_offsets(self) -> list[int]:
        return [int(o) for call in self.fp8_jobs for o in call]

    def copy_offsets(self) -> list[int]:
        return [int(o) for call in self.copy_jobs for o in call]


def head_offsets(layout: Any, layers: Iterable[int], heads: Sequence[int]) -> list[int]:
    """Payload offsets where each head of K and V of ``layers`` begins (a payload layout's parts are
    ``[heads, block tokens, dim]``, so each head is one run of ``nbytes / heads`` bytes)."""
    index = layout.index()
    out = []
    for i in layers:
        for name in ("k", "v"):
            _, _, shape, nbytes = layout.parts[index[f"{name}.{i}"]]
            out += [layout.offsets[index[f"{name}.{i}"]] + h * (nbytes // shape[0]) for h in heads]
    return out


def stored_fp8(layout: Any, layers: Iterable[int]) -> list[int]:
    """Those of ``layers`` stored as FP8 (the others are kept unquantised)."""
    index = layout.index()
    return [i for i in layers if f"k_scale.{i}" in index]
