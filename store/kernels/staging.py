"""Host staging of a hit's stored bytes: reused host buffers, and the gather bound for a device.

A hit's parts lie in many mappings (one per snapshot). Code that needs them in one
place (the compiled CPU kernel, a copy to a GPU) copies them into a host buffer that
:class:`Staging` keeps from one hit to the next: a pinned one always (pinning costs
milliseconds), a plain one up to :data:`KEEP_STAGING_BYTES`. :func:`gather_to_device`
copies the parts there with a few threads, each sending its slice on to the device as
soon as it has copied it, so the gather and the transfer overlap. No arithmetic here:
:mod:`store.kernels.dequant` dequantises what arrives.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Sequence

import numpy as np
import torch

#: Threads that copy stored bytes out of the mappings (numpy copies release the GIL).
#: 4: 12.5 GB/s into pinned memory on the H200 host; 8 or 16: ~10 (docs/benchmarks.md).
GATHER_THREADS = max(1, min(4, (os.cpu_count() or 1)))
#: A plain (unpinned) staging buffer up to this size is kept for the next hit.
KEEP_STAGING_BYTES = 256 << 20

_executor: cf.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def gather_pool() -> cf.ThreadPoolExecutor:
    """The process's :data:`GATHER_THREADS` threads for copies out of the mappings."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = cf.ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="kvwarm-gather")
        return _executor


class Staging:
    """Host buffers reused across hits; hold :attr:`lock` from :meth:`buffer` until done with it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pinned: torch.Tensor | None = None  # for hits bound for a GPU
        self.host: torch.Tensor | None = None  # for the CPU (whole payloads for the compiled kernel)

    def buffer(self, nbytes: int, *, pin: bool) -> torch.Tensor:
        """A ``uint8`` buffer of ``nbytes``: the kept one when it is large enough."""
        kept = self.pinned if pin else self.host
        if kept is not None and kept.numel() >= nbytes:
            return kept[:nbytes]
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        if pin:
            self.pinned = buf
        elif nbytes <= KEEP_STAGING_BYTES:
            self.host = buf
        return buf


def gather_to_device(raw: Sequence[torch.Tensor], dev: torch.device, staging: Staging) -> torch.Tensor:
    """Equal-shaped CPU byte tensors (``uint8`` views of stored parts) as one ``[len(raw), *shape]``
    ``uint8`` tensor on ``dev``, through ``staging``'s (pinned, for CUDA) buffer."""
    shape = raw[0].shape
    dst = torch.empty((len(raw), *shape), dtype=torch.uint8, device=dev)
    with staging.lock:  # held until the copies out of the staging buffer are done
        host = staging.buffer(len(raw) * shape.numel(), pin=dev.type == "cuda" and torch.cuda.is_available())
        host = host.view(len(raw), *shape)
        host_np = host.numpy()
        step = -(-len(raw) // GATHER_THREADS)

        def gather(lo: int) -> None:
            # numpy's copy: one thread per call and the GIL released (torch's copy would
            # start an OpenMP team inside each of these threads)
            hi = min(lo + step, len(raw))
            for i in range(lo, hi):
                np.copyto(host_np[i], raw[i].numpy())
            dst[lo:hi].copy_(host[lo:hi], non_blocking=True)
        list(gather_pool().map(gather, range(0, len(raw), step)))
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # the buffer is free again after this
    return dst
