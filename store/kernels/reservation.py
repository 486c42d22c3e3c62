"""One fixed reservation of device memory per worker and device, for every temporary of the load and write-back kernels.

vLLM sizes its KV cache to ``--gpu-memory-utilization`` of the GPU after profiling a forward; memory
kvwarm takes after that is memory nobody counted. So the device kernels (:mod:`store.kernels.scatter`,
:mod:`store.kernels.gather`, driven chunk by chunk by :mod:`store.kernels.chunks`) never ask torch's
allocator for their temporaries: they take them from one :class:`Reservation` of
``loader.device_scratch_bytes``, allocated once and reused for every load and save, and work that does
not fit is done in chunks of blocks. The user takes its size out of vLLM's budget
(docs/guides/engines.md has the arithmetic).

A :meth:`Reservation.frame` is one user's turn (one chunk of one layer): it holds the lock, so the
load thread and the engine's thread never share the bytes at once, and on CUDA it orders streams by
construction: the stream that enters waits for an event recorded on the stream that left, so a kernel
queued on another stream never overwrites bytes a previous kernel still reads. Inside a frame,
:meth:`Frame.take` hands out aligned slices from the start; :meth:`Frame.mark` / :meth:`Frame.release`
give back what a step of the chunk no longer needs (kernels on one stream run in order, so a later
kernel may reuse the bytes an earlier one read).

:attr:`Reservation.peak` is the high-water mark of bytes taken (a counter: tests assert on it).
"""
from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from store.errors import ConfigError

#: Default size (``loader.device_scratch_bytes``).
SCRATCH_BYTES = 256 << 20
#: Every slice starts at a multiple of this (CUDA kernels read aligned rows fastest).
ALIGN = 256
#: The FP8 table (:data:`store.kernels.gather.FP8_VALUES`) is kept at the start of the reservation.
TABLE_BYTES = ALIGN * 4


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Frame:
    """One turn at a :class:`Reservation`: aligned slices of it, given back when the frame ends."""

    def __init__(self, owner: Reservation) -> None:
        self._owner = owner
        self._at = TABLE_BYTES

    @property
    def device(self) -> torch.device:
        """The reservation's device."""
        return self._owner.device

    @property
    def fp8_values(self) -> torch.Tensor:
        """The FP8 table (:data:`store.kernels.gather.FP8_VALUES`), kept in the reservation."""
        return self._owner.fp8_values

    @property
    def free(self) -> int:
        """Bytes still free in the reservation (before alignment)."""
        return self._owner.size - self._at

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype`` from the reservation.

        Raises:
            ConfigError: it does not fit (the chunk planner sized the work wrong, or the reservation is
                smaller than one block's work: raise ``loader.device_scratch_bytes``).
        """
        nbytes = math.prod(shape) * dtype.itemsize
        end = self._at + _aligned(nbytes)
        owner = self._owner
        if end > owner.size:
            raise ConfigError(f"loader.device_scratch_bytes = {owner.size} is too small for this work: "
                              f"{end - TABLE_BYTES} bytes of temporaries; raise it")
        out = owner.buffer[self._at : self._at + nbytes].view(dtype).view(shape)
        self._at = end
        owner.peak = max(owner.peak, end)
        return out

    def mark(self) -> int:
        """Where the next slice starts: :meth:`release` of it gives back every slice taken after."""
        return self._at

    def release(self, mark: int) -> None:
        """Give back every slice taken since :meth:`mark` returned ``mark`` (on the stream's order)."""
        self._at = mark


class Reservation:
    """``nbytes`` of ``device`` memory, allocated once, lent out one :meth:`frame` at a time.

    Args:
        nbytes: its size, ``loader.device_scratch_bytes``.
        device: where it lives (``cpu`` in the CPU build and in tests: the same code).

    Raises:
        ConfigError: ``nbytes`` cannot hold even the FP8 table.
    """

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        if nbytes < 2 * TABLE_BYTES:
            raise ConfigError(f"loader.device_scratch_bytes = {nbytes} is too small; give at least "
                              f"{2 * TABLE_BYTES} bytes (default {SCRATCH_BYTES})")
        self.size = int(nbytes)
        self.device = torch.device(device)
        self.buffer = torch.empty(self.size, dtype=torch.uint8, device=self.device)
        from store.kernels.gather import FP8_VALUES  # the reservation is below the kernels that use it

        self.fp8_values = self.buffer[: FP8_VALUES.numel() * 4].view(torch.float32)
        self.fp8_values.copy_(FP8_VALUES)
        self.peak = TABLE_BYTES  # the high-water mark of bytes taken
        self.frames = 0  # turns taken: reuse, not new memory, is what grows
        self._lock = threading.Lock()
        self._left: Any = None  # the event recorded when the last frame ended (CUDA)

    @property
    def usable(self) -> int:
        """Bytes a frame can take (the size less the table)."""
        return self.size - TABLE_BYTES

    @contextmanager
    def frame(self) -> Iterator[Frame]:
        """One turn: the lock, and on CUDA the current stream ordered after the previous turn's."""
        with self._lock:
            cuda = self.device.type == "cuda"
            if cuda and self._left is not None:
                torch.cuda.current_stream(self.device).wait_event(self._left)
            self.frames += 1
            try:
                yield Frame(self)
            finally:
                if cuda:
                    self._left = torch.cuda.Event()
                    self._left.record(torch.cuda.current_stream(self.device))


class Loose:
    """What a :class:`Frame` gives, from torch's allocator instead (a kernel called without a reservation)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    @property
    def fp8_values(self) -> torch.Tensor:
        """The FP8 table on the device."""
        from store.kernels.gather import FP8_VALUES

        return FP8_VALUES.to(self.device)

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """``torch.empty`` on the device."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def mark(self) -> int:
        """Nothing to give back."""
        return 0

    def release(self, mark: int) -> None:
        """Nothing to give back."""

