"""New CPU memory for what a hit hands out, backed by huge pages where the OS allows.

Writing newly mapped memory costs one page fault per 4 KiB page, and on a virtual
machine a fault is dear: filling 256 MiB of fresh ``torch.empty`` took 156 ms on the
development VM, against 70 ms for the same bytes in a mapping advised
``MADV_HUGEPAGE`` (one fault per 2 MiB). A large hit's KV is exactly such memory:
written once by the dequantiser, read by the model. :func:`empty` gives tensors of
:data:`HUGE_MIN_BYTES` or more that memory, and ordinary ``torch.empty`` otherwise or
where the platform has no ``MADV_HUGEPAGE`` (the advice is only a hint: with
transparent huge pages off, the kernel uses 4 KiB pages and nothing else changes).

Below 32 MiB glibc's malloc (under torch's allocator) reuses memory it has already
faulted in, so a fresh mapping would be slower there, not faster (22 MiB out: 7.7 ms
against 4.9); from 32 MiB, its largest mmap threshold, every ``torch.empty`` is a new
mapping anyway.
"""
from __future__ import annotations

import math
import mmap
import os

import torch

#: Smallest allocation backed by an advised mapping: glibc's largest mmap threshold (64-bit).
HUGE_MIN_BYTES = 32 << 20

_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)
_ENABLED = _ADVICE is not None and os.environ.get("KVWARM_HUGE_PAGES", "1") != "0"


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, in huge-page-advised memory when large.

    The memory is an anonymous private mapping owned by the tensor's storage: it is
    unmapped when the last tensor viewing it is freed. ``KVWARM_HUGE_PAGES=0`` turns the
    advice off (plain ``torch.empty``).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if not _ENABLED or nbytes < HUGE_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(_ADVICE)
    except OSError:  # a kernel without transparent huge pages: ordinary pages
        pass
    # frombuffer keeps a reference to the mapping for as long as the storage lives
    return torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape)
