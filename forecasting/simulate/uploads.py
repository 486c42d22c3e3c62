"""A node's write-back uploads, as the replay models them: two bounded stages over the node's S3 link.

The product (``store/engines/vllm/writeback.py``) copies a request's computed full blocks out
of the engine's cache and queues them for its writer, which encodes each block, writes it to
NVMe and hands it to ``write_back_streams`` upload threads (the loader's, 4 by default) that
PUT it to S3. Two bounds, each the loader's ``write_back_queue_bytes``:

- the **copies** waiting to be encoded, in the engine's bytes: a save that does not fit keeps
  its leading blocks that do (a block is found only after its parents) and the tail is
  dropped and counted (``write_back_dropped:queue_full``); the dropped blocks reach no tier.
  Encoding and the NVMe write take no time here, so the copies wait for nothing and the
  bound is one save's: a save of more than ``max_bytes / save_bytes`` blocks loses its tail.
- the **encoded blocks** waiting for or in an upload, in stored bytes: a block that finds no
  room stays on NVMe only (``written_back_nvme_only``); the writer never waits for S3.

Blocks the node tier already holds are skipped. :class:`UploadQueue` is those stages: each
upload starts when one of the ``streams`` is free, takes ``upload_s`` seconds of its stream
(one PUT) and its share of the node's :class:`~forecasting.simulate.channels.S3Link` (the link
the prefetch and the background fetches read over), so the streams together never move more
than the link carries. A block is in S3 when its upload lands.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Container, Sequence

from forecasting.simulate.channels import S3Link
from store.config import LoaderConfig

#: the product's upload threads by default (``loader.write_back_streams``)
WRITE_BACK_STREAMS = LoaderConfig().write_back_streams


class UploadQueue:
    """Bounded write-back uploads over ``link``; the :class:`~forecasting.simulate.channels.FetchChannel`
    interface (:meth:`head`, :meth:`take`) so :func:`~forecasting.simulate.channels.drain` runs them
    beside the copies from S3.

    Args:
        upload_s: seconds of one stream per block (one PUT).
        link: the node's S3 link.
        max_bytes: each stage's bound: the most copied bytes that wait to be encoded, and the
            most encoded bytes that wait for or are in an upload (``inf``: no bound).
        save_bytes: copied bytes per block (the engine's KV of one block).
        block_bytes: encoded bytes per block (kvwarm's stored block; 0: the upload stage is
            bounded by ``streams`` alone).
        streams: uploads at once (the loader's ``write_back_streams``).

    :attr:`uploaded` and :attr:`dropped` count blocks; :attr:`nvme_only` the blocks no upload took.
    """

    def __init__(self, upload_s: float, link: S3Link, *, max_bytes: float = math.inf, save_bytes: float = 0.0,
                 block_bytes: float = 0.0, streams: int = WRITE_BACK_STREAMS) -> None:
        if not (isinstance(streams, int) and streams >= 1):
            raise ValueError(f"write-back uploads need at least one stream, got {streams!r}")
        self.upload_s = float(upload_s)
        self.link = link
        self.max_bytes = float(max_bytes)
        self.save_bytes = float(save_bytes)
        self.block_bytes = float(block_bytes)
        self.streams = streams
        #: blocks the upload stage holds at once (at least one)
        self.stage_blocks = (math.inf if math.isinf(self.max_bytes) or self.block_bytes <= 0
                             else max(1, int(self.max_bytes // self.block_bytes)))
        self._stage: deque[tuple[float, int]] = deque()  # encoded: (entered, block)
        self._free = [-math.inf] * streams  # a heap: when each stream is free
        self.uploaded = 0
        self.dropped = 0
        self.nvme_only = 0

    def __len__(self) -> int:
        return len(self._stage)

    @property
    def queued_bytes(self) -> float:
        """Copied bytes waiting to be encoded: none here (the writer encodes at once)."""
        return 0.0

    def submit(self, blocks: Sequence[int], present: Container[int], now: float) -> int:
        """A save of ``blocks`` computed blocks, root first: keeps as many leading blocks as the copies'
        bound takes and drops the rest (counted in :attr:`dropped`). The kept ones go to the node
        tier; those not in ``present`` (the node tier) enter the upload stage while it has room,
        and the rest stay on NVMe only (:attr:`nvme_only`): the writer never waits for S3.
        Returns how many leading blocks were kept."""
        n = len(blocks)
        if self.save_bytes <= 0 or math.isinf(self.max_bytes):
            fit = n
        else:  # the writer encodes at once here: the copies wait for nothing, so the bound is one save's
            fit = min(n, max(0, math.floor(self.max_bytes / self.save_bytes + 1e-9)))
        self.dropped += n - fit
        for b in blocks[:fit]:
            if b in present:
                continue
            if len(self._stage) < self.stage_blocks:
                self._stage.append((now, int(b)))
            else:
                self.nvme_only += 1
        return fit

    def head(self, present: Container[int] = ()) -> tuple[float, float, int] | None:
        """The next upload, ``(done, start, block)`` (``None``: nothing queued). ``present`` is unused:
        the writer decided what to skip when the save came."""
        if not self._stage:
            return None
        entered, b = self._stage[0]
        start = max(entered, self._free[0])
        return max(start + self.upload_s, self.link.ends(start)), start, b

    def take(self, head: tuple[float, float, int]) -> int:
        """Carry out the upload :meth:`head` returned; its stream and its room are free when it lands."""
        done, start, b = head
        self.link.take(start)
        self._stage.popleft()
        heapq.heapreplace(self._free, done)
        self.uploaded += 1
        return b

    def copy(self, link: S3Link) -> UploadQueue:
        """An independent copy drawing on ``link``."""
        out = UploadQueue(self.upload_s, link, max_bytes=self.max_bytes, save_bytes=self.save_bytes,
                          block_bytes=self.block_bytes, streams=self.streams)
        out._stage, out._free = deque(self._stage), list(self._free)
        out.uploaded, out.dropped, out.nvme_only = self.uploaded, self.dropped, self.nvme_only
        return out

    def clear(self) -> None:
        """Drop every upload waiting (the process that held them is gone)."""
        self._stage.clear()
        self._free = [-math.inf] * self.streams
