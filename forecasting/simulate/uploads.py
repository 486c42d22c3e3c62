"""A node's write-back uploads, as the replay models them: one bounded queue over the node's S3 link.

The product (``store/engines/vllm/writeback.py``) copies a request's computed full blocks
out of the engine's cache and queues them for one background writer, which writes each
block to NVMe and S3 in turn. The queue is bounded (the loader's ``write_back_queue_bytes``,
256 MiB by default) in the engine's copied bytes, not the stored ones: a save that does not
fit is dropped whole and counted (``write_back_dropped:queue_full``), never waited for, and
reaches no tier. The writer skips blocks the node tier already holds. A save's bytes wait
until its last block is written.

:class:`UploadQueue` is that queue: one writer, each block taking ``upload_s`` seconds of it
and its share of the node's :class:`~forecasting.simulate.channels.S3Link` (the same link the
prefetch and the background fetches read over). A block is in S3 when its upload lands.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Container, Sequence

from forecasting.simulate.channels import S3Link


class UploadQueue:
    """Bounded write-back uploads over ``link``; the :class:`~forecasting.simulate.channels.FetchChannel`
    interface (:meth:`head`, :meth:`take`) so :func:`~forecasting.simulate.channels.drain` runs them
    beside the copies from S3.

    Args:
        upload_s: seconds of the writer per block (one stream's PUT).
        link: the node's S3 link.
        max_bytes: the most copied bytes that wait (``inf``: no bound).
        save_bytes: copied bytes per block (the engine's KV of one block).

    :attr:`uploaded` and :attr:`dropped` count blocks; :attr:`queued_bytes` is what waits now.
    """

    def __init__(self, upload_s: float, link: S3Link, *, max_bytes: float = math.inf, save_bytes: float = 0.0) -> None:
        self.upload_s = float(upload_s)
        self.link = link
        self.max_bytes = float(max_bytes)
        self.save_bytes = float(save_bytes)
        self._busy_until = -math.inf
        self._queue: deque[tuple[float, int, int]] = deque()  # (submitted, block, save id)
        self._left: dict[int, list[float]] = {}  # save id -> [blocks left, bytes]
        self._saves = 0
        self.queued_bytes = 0.0
        self.uploaded = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, n_blocks: int, upload: Sequence[int], now: float) -> bool:
        """A save of ``n_blocks`` computed blocks, of which ``upload`` are not on the node yet:
        queued whole (``True``), or dropped whole when its bytes do not fit (``False``)."""
        nbytes = n_blocks * self.save_bytes
        if self.queued_bytes + nbytes > self.max_bytes:
            self.dropped += n_blocks
            return False
        if not upload:
            return True  # every block present: the writer skips them at once
        self._saves += 1
        self._left[self._saves] = [float(len(upload)), nbytes]
        self.queued_bytes += nbytes
        for b in upload:
            self._queue.append((now, int(b), self._saves))
        return True

    def head(self, present: Container[int] = ()) -> tuple[float, float, int] | None:
        """The next upload, ``(done, start, block)`` (``None``: nothing queued). ``present`` is unused:
        the writer decided what to skip when the save came."""
        if not self._queue:
            return None
        submitted, b, _ = self._queue[0]
        start = max(self._busy_until, submitted)
        return max(start + self.upload_s, self.link.ends(start)), start, b

    def take(self, head: tuple[float, float, int]) -> int:
        """Carry out the upload :meth:`head` returned; a save's bytes are freed with its last block."""
        done, start, b = head
        self.link.take(start)
        _, _, save = self._queue.popleft()
        self._busy_until = done
        self.uploaded += 1
        left = self._left[save]
        left[0] -= 1
        if left[0] <= 0:
            self.queued_bytes -= left[1]
            del self._left[save]
        return b

    def copy(self, link: S3Link) -> UploadQueue:
        """An independent copy drawing on ``link``."""
        out = UploadQueue(self.upload_s, link, max_bytes=self.max_bytes, save_bytes=self.save_bytes)
        out._busy_until, out._queue, out._saves = self._busy_until, deque(self._queue), self._saves
        out._left = {k: list(v) for k, v in self._left.items()}
        out.queued_bytes, out.uploaded, out.dropped = self.queued_bytes, self.uploaded, self.dropped
        return out

    def clear(self) -> None:
        """Drop every save waiting (the process that held the copies is gone)."""
        self._queue.clear()
        self._left.clear()
        self.queued_bytes = 0.0
        self._busy_until = -math.inf
