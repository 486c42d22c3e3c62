"""New CPU memory for what a hit hands out: huge-page mappings, recycled once freed.

Writing newly mapped memory costs one page fault per 4 KiB page, and on a virtual
machine a fault is dear (about 2.5 us on the development VM): the 24 MiB a 2k-token hit
of the reference model fills took 6,200 faults, 14 ms, against 3 ms for the same gather
into memory already faulted in. glibc's malloc (under ``torch.empty``) sometimes reuses
such memory and sometimes maps it anew, so the cost of a hit swung by 3x with the heap's
history.

:func:`empty` makes it deterministic. A tensor of :data:`RECYCLE_MIN_BYTES` or more is
an anonymous private mapping, advised ``MADV_HUGEPAGE`` (one fault per 2 MiB where the
kernel has transparent huge pages; only a hint otherwise). When the last tensor viewing
it is freed, the mapping goes back to a free list instead of to the kernel, and the next
request of about its size (at most :data:`SLACK` larger) takes it, already faulted in.
The free list holds at most ``KVWARM_RECYCLE_BYTES`` bytes (default 512 MiB; the oldest
buffers are unmapped first); :func:`release_cached` empties it. ``KVWARM_HUGE_PAGES=0``
turns all of this off (plain ``torch.empty``).

A recycled buffer holds whatever its last user wrote, as ``torch.empty``'s memory may:
callers overwrite every element they hand out.
"""
from __future__ import annotations

import collections
import math
import mmap
import os
import threading

import numpy as np
import torch

#: Smallest allocation served from a recycled mapping (smaller ones are glibc's business).
RECYCLE_MIN_BYTES = 1 << 20
#: A free buffer serves a request at most this factor smaller than itself.
SLACK = 1.25
_ROUND = 2 << 20  # mappings are whole huge pages

_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)
_ENABLED = os.environ.get("KVWARM_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MAP_ANONYMOUS")


def _cap_from_env() -> int:
    raw = os.environ.get("KVWARM_RECYCLE_BYTES", str(512 << 20))
    try:
        cap = int(raw)
    except ValueError:
        cap = -1
    if cap < 0:
        raise ValueError(f"KVWARM_RECYCLE_BYTES must be a whole number of bytes >= 0, got {raw!r}")
    return cap


_CAP = _cap_from_env()

_lock = threading.Lock()
_free: list[mmap.mmap] = []  # oldest first
_free_bytes = 0
# Mappings whose last tensor went. Filled from finalisers, which may run inside any allocation
# on any thread (even while this module holds its lock), so only deque.append happens there.
_returned: collections.deque[mmap.mmap] = collections.deque()


def _after_fork_in_child() -> None:
    # a fork while another thread held the lock would leave it held forever in the child;
    # the child starts with a lock of its own and keeps the (copied) free list
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Exporter(np.ndarray):
    """The array a recycled tensor's storage holds: when torch frees the storage (the last
    view of the tensor), this array goes, and its mapping is returned to the free list."""

    def __del__(self) -> None:
        mm = getattr(self, "mapping", None)
        if mm is not None and _returned is not None:  # None at interpreter shutdown
            _returned.append(mm)


def _drain() -> None:
    """Move returned mappings to the free list, unmapping the oldest beyond the cap (lock held)."""
    global _free_bytes
    while _returned:
        mm = _returned.popleft()
        _free.append(mm)
        _free_bytes += len(mm)
    while _free_bytes > _CAP and _free:
        _free_bytes -= len(_free.pop(0))  # unmapped when this last reference goes


def _take(nbytes: int) -> mmap.mmap | None:
    """The smallest free mapping that holds ``nbytes`` within :data:`SLACK`, removed from the list."""
    global _free_bytes
    with _lock:
        _drain()
        best = None
        for i, mm in enumerate(_free):
            if nbytes <= len(mm) <= nbytes * SLACK + _ROUND and (best is None or len(mm) < len(_free[best])):
                best = i
        if best is None:
            return None
        mm = _free.pop(best)
        _free_bytes -= len(mm)
        return mm


def _new(nbytes: int) -> mmap.mmap:
    mm = mmap.mmap(-1, -(-nbytes // _ROUND) * _ROUND, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _ADVICE is not None:
        try:
            mm.madvise(_ADVICE)
        except OSError:  # a kernel without transparent huge pages: ordinary pages
            pass
    return mm


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor; from a recycled huge-page mapping when large.

    The mapping belongs to the tensor's storage until the last tensor viewing it is
    freed; then it returns to the free list (see the module docstring).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if not _ENABLED or nbytes < RECYCLE_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    mm = _take(nbytes) or _new(nbytes)
    arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes).view(_Exporter)
    arr.mapping = mm  # type: ignore[attr-defined]
    # frombuffer holds ``arr`` for as long as the storage lives; its finaliser returns ``mm``
    return torch.frombuffer(arr, dtype=torch.uint8).view(dtype).view(shape)


def cached_bytes() -> int:
    """Bytes of freed mappings held for reuse."""
    with _lock:
        _drain()
        return _free_bytes


def release_cached() -> int:
    """Unmap every freed mapping held for reuse; returns the bytes released."""
    global _free_bytes
    with _lock:
        _drain()
        released, _free_bytes = _free_bytes, 0
        _free.clear()
    return released
