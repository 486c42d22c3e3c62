"""A node's write-back uploads, as the replay models them: two bounded stages over the node's S3 link.

The product (``store/engines/vllm/writeback.py``) copies a request's computed full blocks out
of the engine's cache and queues them for its writer, which encodes each block, writes it to
NVMe and hands it to ``write_back_streams`` upload threads (the loader's, 4 by default) that
PUT it to S3. Two bounds, each the loader's ``write_back_queue_bytes`` (256 MiB by default):

- the **copies** waiting to be encoded, in the engine's bytes: a save that does not fit keeps
  its leading blocks that do (a block is found only after its parents) and the tail is
  dropped and counted (``write_back_dropped:queue_full``), never waited for; the dropped
  blocks reach no tier. A save's copies are freed once its blocks are encoded.
- the **encoded blocks** waiting for or in an upload, in stored bytes: the writer waits for
  room, so while S3 is behind the copies wait too, and the next saves lose their tails.

Blocks the node tier already holds are skipped. :class:`UploadQueue` is those stages: a block
enters the upload stage (its save's copies freed with its last such block) when there is
room, and its upload starts when one of the ``streams`` is free; each takes ``upload_s``
seconds of its stream (one PUT) and its share of the node's
:class:`~forecasting.simulate.channels.S3Link` (the link the prefetch and the background
fetches read over), so the streams together never move more than the link carries. A block
is in S3 when its upload lands. Encoding and the NVMe write take no time here. The product
also plans a dropped tail again when the request computes prompt tokens again (the next chunk
of a long prompt); the replay's request is one save, so its tail is lost.
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

    :attr:`uploaded` and :attr:`dropped` count blocks; :attr:`queued_bytes` is the copies that wait now.
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
        self._waiting: deque[tuple[float, int, int]] = deque()  # copies: (submitted, block, save id)
        self._stage: deque[tuple[float, int]] = deque()  # encoded: (entered, block)
        self._free = [-math.inf] * streams  # a heap: when each stream is free
        self._left: dict[int, list[float]] = {}  # save id -> [blocks still copies, copied bytes]
        self._saves = 0
        self.queued_bytes = 0.0
        self.uploaded = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._waiting) + len(self._stage)

    def submit(self, blocks: Sequence[int], present: Container[int], now: float) -> int:
        """A save of ``blocks`` computed blocks, root first: queues as many leading blocks as the copies'
        bound takes and drops the rest (counted in :attr:`dropped`); those in ``present`` (the node
        tier) are not uploaded. Returns how many leading blocks were kept."""
        n = len(blocks)
        if self.save_bytes <= 0 or math.isinf(self.max_bytes):
            fit = n
        else:
            fit = min(n, max(0, math.floor((self.max_bytes - self.queued_bytes) / self.save_bytes + 1e-9)))
        self.dropped += n - fit
        upload = [int(b) for b in blocks[:fit] if b not in present]
        if upload:  # a save whose blocks are all present is skipped at once
            self._saves += 1
            self._left[self._saves] = [float(len(upload)), fit * self.save_bytes]
            self.queued_bytes += fit * self.save_bytes
            self._waiting.extend((now, b, self._saves) for b in upload)
            self._advance(now)
        return fit

    def _advance(self, t: float) -> None:
        """Blocks move from copies to the upload stage while it has room (from ``t`` on)."""
        while self._waiting and len(self._stage) < self.stage_blocks:
            submitted, b, save = self._waiting.popleft()
            self._stage.append((max(submitted, t), b))
            left = self._left[save]
            left[0] -= 1
            if left[0] <= 0:
                self.queued_bytes -= left[1]
                del self._left[save]

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
        self._advance(done)
        return b

    def copy(self, link: S3Link) -> UploadQueue:
        """An independent copy drawing on ``link``."""
        out = UploadQueue(self.upload_s, link, max_bytes=self.max_bytes, save_bytes=self.save_bytes,
                          block_bytes=self.block_bytes, streams=self.streams)
        out._waiting, out._stage, out._free = deque(self._waiting), deque(self._stage), list(self._free)
        out._left, out._saves = {k: list(v) for k, v in self._left.items()}, self._saves
        out.queued_bytes, out.uploaded, out.dropped = self.queued_bytes, self.uploaded, self.dropped
        return out

    def clear(self) -> None:
        """Drop every save waiting (the process that held the copies is gone)."""
        self._waiting.clear()
        self._stage.clear()
        self._left.clear()
        self._free = [-math.inf] * self.streams
        self.queued_bytes = 0.0
