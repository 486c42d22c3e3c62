"""Host staging of a hit's stored bytes: bounded host buffers reused across hits, and the gather to a device.

A hit's parts lie in many mappings (one per snapshot). Code that needs them in one place
(the compiled CPU kernel, a copy to a GPU) copies them into a host buffer that
:class:`Staging` keeps from one hit to the next:

- for a device, :data:`SLOTS` pinned *slots* used in turn, together at most ``max_bytes``
  (``loader.staging_bytes``). A transfer larger than a slot goes through in pieces: while
  one slot's bytes are on their way to the device, the next piece is gathered into the other.
  A slot is reused once the copy out of it is done (a CUDA event recorded after the copy:
  the host waits for that copy, never for a whole stream). A slot is made as large as a
  piece needs (at most its share of the bound) and made smaller again when the pieces of
  the last :data:`SHRINK_AFTER` uses needed under a quarter of it. A part larger than a slot goes
  through in byte pieces, so the pinned bytes never pass ``max_bytes`` (:attr:`Staging.peak_bytes`).
  After :data:`IDLE_TRIM_S` without a transfer every slot is freed (and what torch's cache of pinned
  host memory holds unused, where write-back's pinned copies wait for reuse, with them): an engine
  that stopped loading holds no pinned staging.
- for the CPU, one plain buffer up to :data:`KEEP_STAGING_BYTES` (whole payloads for the
  compiled kernel), kept for the next hit.

:func:`gather_to_device` copies the parts with a few threads (numpy copies: the GIL is
released) and sends each piece on from the calling thread, on its current stream. No
arithmetic here: :mod:`store.kernels.dequant` dequantises what arrives.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from store.kernels.reservation import Frame

#: Threads that copy stored bytes out of the mappings (numpy copies release the GIL).
#: 4: 12.5 GB/s into pinned memory on the H200 host; 8 or 16: ~10 (docs/benchmarks.md).
GATHER_THREADS = max(1, min(4, (os.cpu_count() or 1)))
#: A plain (unpinned) staging buffer up to this size is kept for the next hit.
KEEP_STAGING_BYTES = 256 << 20
#: Default bound on the pinned staging (``loader.staging_bytes``).
STAGING_BYTES = 64 << 20
#: Pinned slots used in turn (one filling while the other is copied out).
SLOTS = 2
#: A slot is made smaller when this many uses in a row needed under a quarter of it.
SHRINK_AFTER = 32
#: Seconds without a transfer after which the slots are freed.
IDLE_TRIM_S = 30.0

_executor: cf.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def gather_pool() -> cf.ThreadPoolExecutor:
    """The process's :data:`GATHER_THREADS` threads for copies out of the mappings."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = cf.ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="kvwarm-gather")
        return _executor


class _Slot:
    """One reusable host buffer, the event after which it is free again, and its recent needs."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.free_after: Any = None  # a CUDA event, or None: free now
        self.needs: deque[int] = deque(maxlen=SHRINK_AFTER)


class Staging:
    """Host buffers reused across hits; hold :attr:`lock` from :meth:`buffer` until done with it.

    Args:
        max_bytes: the most pinned memory kept for transfers to a device (all slots together).
        idle_s: seconds without a transfer after which the slots are freed (a timer thread, started
            with the first slot).
    """

    def __init__(self, max_bytes: int = STAGING_BYTES, *, idle_s: float = IDLE_TRIM_S) -> None:
        if max_bytes < SLOTS:
            raise ValueError(f"staging needs at least {SLOTS} bytes, got {max_bytes}")
        self.lock = threading.Lock()
        self.max_bytes = int(max_bytes)
        self.idle_s = float(idle_s)
        self.host: torch.Tensor | None = None  # for the CPU (whole payloads for the compiled kernel)
        self._slots = [_Slot() for _ in range(SLOTS)]
        self._turn = 0
        self.allocations = 0  # pinned (or device-bound) buffers made: reuse keeps it low
        self.peak_bytes = 0  # the most slot bytes held at once (never above max_bytes)
        self.trims = 0  # idle trims that freed slots
        self._used = 0.0  # time.monotonic() of the last transfer
        self._timer: threading.Thread | None = None
        self._closed = threading.Event()

    @property
    def slot_bytes(self) -> int:
        """The most one slot holds: a piece of a transfer is at most this large."""
        return self.max_bytes // SLOTS

    @property
    def pinned_bytes(self) -> int:
        """Host bytes the slots hold now (at most ``max_bytes``)."""
        return sum(s.buf.numel() for s in self._slots if s.buf is not None)

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A plain ``uint8`` host buffer of ``nbytes`` (the CPU's): the kept one when it is large enough."""
        if self.host is not None and self.host.numel() >= nbytes:
            return self.host[:nbytes]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes <= KEEP_STAGING_BYTES:
            self.host = buf
        return buf

    def acquire(self, nbytes: int, *, pin: bool) -> tuple[torch.Tensor, int]:
        """The next slot as a ``uint8`` buffer of ``nbytes``, once the copy out of it is done; and its number.

        Raises:
            ValueError: ``nbytes`` is larger than :attr:`slot_bytes` (the caller sends smaller pieces).
        """
        if nbytes > self.slot_bytes:
            raise ValueError(f"a staging piece of {nbytes} bytes is larger than a slot ({self.slot_bytes})")
        self._used = time.monotonic()
        if self._timer is None:  # it holds no reference: it ends once this staging is closed or gone
            self._timer = threading.Thread(target=_trim_when_idle, args=(weakref.ref(self), self._closed, self.idle_s),
                                           name="kvwarm-staging-trim", daemon=True)
            self._timer.start()
        i = self._turn
        self._turn = (self._turn + 1) % SLOTS
        slot = self._slots[i]
        if slot.free_after is not None:
            slot.free_after.synchronize()  # the copy out of this slot, not the stream
            slot.free_after = None
        slot.needs.append(nbytes)
        size = 0 if slot.buf is None else slot.buf.numel()
        shrink = size >= 4 * nbytes and len(slot.needs) == SHRINK_AFTER and max(slot.needs) * 4 <= size
        if size < nbytes or shrink:
            slot.buf = None  # drop the old one before making the new: the bound holds throughout
            slot.buf = torch.empty(nbytes if shrink else min(self.slot_bytes, max(nbytes, size)),
                                   dtype=torch.uint8, pin_memory=pin)
            self.allocations += 1
            self.peak_bytes = max(self.peak_bytes, self.pinned_bytes)
            if shrink:
                slot.needs.clear()
        return slot.buf[:nbytes], i

    def release(self, slot: int, event: Any) -> None:
        """The copy out of ``slot`` ends with ``event`` (a CUDA event; ``None``: it is done already)."""
        self._slots[slot].free_after = event

    def trim_if_idle(self) -> bool:
        """Free the slots if no transfer came for :attr:`idle_s` (the timer thread calls it); whether it did."""
        with self.lock:
            if not self.pinned_bytes or time.monotonic() - self._used < self.idle_s:
                return False
            self.trim()
            self.trims += 1
            return True

    def close(self) -> None:
        """Free every kept buffer and stop the timer thread."""
        self._closed.set()
        with self.lock:
            self.trim()

    def trim(self) -> None:
        """Give back every kept buffer (idle, or shutting down); the caller holds :attr:`lock`."""
        for s in self._slots:
            if s.free_after is not None:
                s.free_after.synchronize()
            s.buf, s.free_after = None, None
            s.needs.clear()
        self.host = None
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if callable(empty) and torch.cuda.is_available():
            empty()  # the caching host allocator would keep the pages otherwise


def _trim_when_idle(ref: weakref.ref[Staging], closed: threading.Event, idle_s: float) -> None:
    """A staging's timer thread: every quarter of ``idle_s``, :meth:`Staging.trim_if_idle`, until it is closed
    or gone."""
    while not closed.wait(idle_s / 4):
        staging = ref()
        if staging is None:
            return
        staging.trim_if_idle()
        del staging


def gather_to_device(raw: Sequence[torch.Tensor], dev: torch.device, staging: Staging,
                     dst: torch.Tensor | None = None) -> torch.Tensor:
    """Equal-shaped CPU byte tensors (``uint8`` views of stored parts) as one ``[len(raw), *shape]``
    ``uint8`` tensor on ``dev`` (``dst`` where given: a slice of the device's reservation), through
    ``staging``'s slots (pinned for CUDA), piece by piece: whole parts, or byte pieces of a part larger
    than a slot."""
    shape = raw[0].shape
    per = shape.numel()
    if dst is None:
        dst = torch.empty((len(raw), *shape), dtype=torch.uint8, device=dev)
    cuda = dev.type == "cuda" and torch.cuda.is_available()
    chunk = staging.slot_bytes // per
    flat = dst.view(len(raw), per)
    with staging.lock:  # the slots are used in turn: one transfer at a time
        if chunk == 0:  # a part larger than a slot: its bytes in slot-sized pieces
            for j, part in enumerate(raw):
                src = part.reshape(-1)
                for lo in range(0, per, staging.slot_bytes):
                    hi = min(lo + staging.slot_bytes, per)
                    _send(staging, [src[lo:hi]], flat[j, lo:hi], cuda, dev)
            return dst
        for lo in range(0, len(raw), chunk):
            hi = min(lo + chunk, len(raw))
            _send(staging, raw[lo:hi], flat[lo:hi], cuda, dev)
    return dst


def _send(staging: Staging, parts: Sequence[torch.Tensor], dst: torch.Tensor, cuda: bool, dev: torch.device) -> None:
    """Equal-sized byte tensors gathered into the next slot (threads) and copied on to ``dst`` (the slot's
    event recorded after the copy); the caller holds ``staging.lock``."""
    per = parts[0].numel()
    host, slot = staging.acquire(len(parts) * per, pin=cuda)
    host_np = host.numpy().reshape(len(parts), per)
    step = -(-len(parts) // GATHER_THREADS)

    def gather(a: int) -> None:
        # numpy's copy: one thread per call and the GIL released (torch's copy would
        # start an OpenMP team inside each of these threads)
        for j in range(a, min(a + step, len(parts))):
            np.copyto(host_np[j], parts[j].reshape(-1).numpy())

    list(gather_pool().map(gather, range(0, len(parts), step)))
    dst.copy_(host.view(dst.shape), non_blocking=cuda)
    event = None
    if cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
    staging.release(slot, event)


def stage_runs(runs: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor | None]]], dev: torch.device,
               staging: Staging, scratch: Frame | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Runs of stored parts (``runs[j]``: ``n`` blocks' ``(part, scales)``) moved to ``dev`` as they are stored:
    ``[runs, n, heads, tokens, dim]`` in the stored dtype, and their scales ``[runs, n, heads]`` (per group:
    ``[runs, n, heads, groups]``; ``None`` unquantised), through :func:`gather_to_device`.

    Only uniform runs of host parts qualify: every part of one shape and dtype, FP8 with per-head or
    per-group scales, or unscaled. ``None`` for anything else (the caller dequantises part by part). With ``scratch`` (a
    :class:`store.kernels.reservation.Frame`) the bytes and scales land in the device's reservation.
    """
    stored0, scale0 = runs[0][0]
    n = len(runs[0])
    fp8 = stored0.dtype == torch.float8_e4m3fn and scale0 is not None and scale0.dim() in (1, 2)
    uniform = (stored0.device.type == "cpu" and (fp8 or scale0 is None)
               and all(len(run) == n and all(p.shape == stored0.shape and p.dtype == stored0.dtype
                                             and (s is None) == (scale0 is None)
                                             and (s is None or s.shape == scale0.shape) for p, s in run)
                       for run in runs))
    if not uniform:
        return None
    raw = [p.view(torch.uint8) for run in runs for p, _ in run]
    into = None if scratch is None else scratch.take((len(raw), *raw[0].shape), torch.uint8)
    dst = gather_to_device(raw, dev, staging, into)
    stored = dst.view(stored0.dtype).view(len(runs), n, *stored0.shape)
    if scale0 is None:
        return stored, None
    scales = torch.stack([s for run in runs for _, s in run]).view(len(runs), n, *scale0.shape)  # type: ignore[misc]
    return stored, scales.to(dev) if scratch is None else scratch.take(scales.shape, scales.dtype).copy_(scales)
