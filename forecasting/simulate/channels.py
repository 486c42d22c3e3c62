"""Copies from S3 to a node's tier, as the replay models them: channels over one shared link.

The loader copies in two places (docs/guides/loader.md): a plan's prefetch, on its own
``prefetch_streams``, and background fetches after a lookup's S3 hit, on the
``fetch_workers``. Each is a :class:`FetchChannel`: first come first served, a block's copy
taking ``fetch_s`` seconds of the channel (one stream's copy time over its streams). Both
draw on the node's one :class:`S3Link`: however many streams run, the node reads from S3
at most ``link_s`` seconds a block (the node's measured aggregate S3 read rate), so two
channels never copy faster together than the link allows.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Container, Iterable, Sequence


class S3Link:
    """A node's S3 read bandwidth: each copy takes ``link_s`` seconds of it, one after another."""

    def __init__(self, link_s: float = 0.0) -> None:
        self.link_s = float(link_s)
        self.busy_until = -math.inf

    def ends(self, start: float) -> float:
        """When one block's transfer from ``start`` on would be carried (nothing reserved)."""
        return max(self.busy_until, start) + self.link_s

    def take(self, start: float) -> float:
        """Reserve one block's transfer from ``start`` on; returns when the link has carried it."""
        self.busy_until = self.ends(start)
        return self.busy_until

    def copy(self) -> S3Link:
        out = S3Link(self.link_s)
        out.busy_until = self.busy_until
        return out

    def clear(self) -> None:
        self.busy_until = -math.inf


class FetchChannel:
    """Copies from S3 to the node tier, first come first served, ``fetch_s`` seconds of channel each.

    A copy ends when both its channel time and its share of ``link`` (default: a link of
    its own with no limit) are spent. A queued block that the node tier holds by the time
    its turn comes is skipped at no cost, as the loader's fetcher skips what NVMe already
    has. :attr:`copied` counts the copies made (what the channel spent).
    """

    def __init__(self, fetch_s: float, link: S3Link | None = None) -> None:
        self.fetch_s = fetch_s
        self.link = link if link is not None else S3Link()
        self._busy_until = -math.inf
        self._queue: deque[tuple[float, int]] = deque()
        self.pending: set[int] = set()
        self.copied = 0

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, blocks: Iterable[int], now: float) -> int:
        """Queue the copy of ``blocks`` not already queued; returns how many were queued."""
        n = 0
        for b in blocks:
            if b not in self.pending:
                self._queue.append((now, b))
                self.pending.add(b)
                n += 1
        return n

    def head(self, present: Container[int]) -> tuple[float, float, int] | None:
        """The next copy, ``(done, start, block)``, at the link's state now (``None``: nothing queued);
        queued blocks in ``present`` are dropped first, at no cost."""
        q = self._queue
        while q and q[0][1] in present:
            self.pending.discard(q.popleft()[1])
        if not q:
            return None
        submitted, b = q[0]
        start = max(self._busy_until, submitted)
        return max(start + self.fetch_s, self.link.ends(start)), start, b

    def take(self, head: tuple[float, float, int]) -> int:
        """Carry out the copy :meth:`head` returned (its link time is reserved); returns its block."""
        done, start, b = head
        self.link.take(start)
        self._queue.popleft()
        self.pending.discard(b)
        self._busy_until = done
        self.copied += 1
        return b

    def landed(self, now: float, present: Container[int]) -> list[int]:
        """The blocks whose copy has finished by ``now``, in landing order (``present``'s are skipped)."""
        out = []
        while (h := self.head(present)) is not None and h[0] <= now:
            out.append(self.take(h))
        return out

    def copy(self, link: S3Link | None = None) -> FetchChannel:
        """An independent copy, drawing on ``link`` (default: a copy of this one's)."""
        out = FetchChannel(self.fetch_s, link if link is not None else self.link.copy())
        out._busy_until, out._queue, out.pending = self._busy_until, deque(self._queue), set(self.pending)
        out.copied = self.copied
        return out

    def clear(self) -> None:
        """Drop every copy in flight (the process that ran them is gone)."""
        self._queue.clear()
        self.pending.clear()
        self._busy_until = -math.inf


def drain(channels: Sequence, now: float, present: Container[int]) -> list[tuple[int, int, float]]:
    """Carry out every copy of ``channels`` (sharing one link) that finishes by ``now``, in the
    order they finish: ``(channel index, block, time landed)`` each. A copy takes its link time
    when it is carried out, so the channels share the link in the order their copies end."""
    out = []
    while True:
        best = None
        for k, ch in enumerate(channels):
            h = ch.head(present)
            if h is not None and h[0] <= now and (best is None or h[0] < best[1][0]):
                best = (k, h)
        if best is None:
            return out
        k, h = best
        out.append((k, channels[k].take(h), h[0]))
