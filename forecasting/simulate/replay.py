"""Replaying block chains against a prefix cache of fixed capacity: LRU and Belady.

Semantics (those of vLLM's prefix cache): a request's block ``j`` is a hit only when
blocks ``0..j`` are all cached; after the request every block of its chain is cached
(inserted or touched), and when the cache is over capacity it evicts, among the least
valuable blocks, the deepest first (vLLM frees a request's blocks tail first).

Evictions:

- :class:`LRUCache`: least recently used (vLLM, LMCache, SGLang's radix cache).
- :class:`BeladyCache`: evict the block whose next use is furthest away (offline, uses
  the future: the eviction ceiling, not a policy anyone can run).

Everything here is pure: a :class:`BlockIndex` of numpy arrays is built once per trace,
and :func:`replay` returns the number of prefix blocks hit by each request. The node
the deployment-shaped replay models (vLLM's cache over kvwarm's tiers) is in
:mod:`forecasting.simulate.tiers`.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from forecasting.ingest.traces import Trace
from forecasting.planning.reuse import NEVER, chain_links


@dataclass(frozen=True, eq=False)
class BlockIndex:
    """Per-occurrence arrays of a trace, computed once and shared by every replay.

    Attributes:
        trace: the trace.
        ids: dense block ids (``0..n_unique-1``) for each entry of ``trace.block_ids``.
        depth: position of each occurrence in its chain.
        request: request index of each occurrence.
        tokens: prompt tokens each occurrence stands for.
        prev_request: request index of the previous use of the same block (-1: first use).
        next_request: request index of the next use of the same block (``NEVER``: none).
        lead_seen: per request, how many leading blocks were seen before (infinite cache).
        n_unique: number of distinct blocks.
        original: the trace's block id of each dense id (``original[ids] == trace.block_ids``).
        parent: dense id of each block's parent (-1 for root blocks).
    """

    trace: Trace
    ids: np.ndarray
    depth: np.ndarray
    request: np.ndarray
    tokens: np.ndarray
    prev_request: np.ndarray
    next_request: np.ndarray
    lead_seen: np.ndarray
    n_unique: int
    original: np.ndarray
    parent: np.ndarray

    @classmethod
    def build(cls, trace: Trace) -> BlockIndex:
        """Index ``trace`` (vectorised; about 0.1 s for 288k blocks)."""
        uniq, ids = np.unique(trace.block_ids, return_inverse=True)
        ids = ids.astype(np.int64)
        request, depth, prv, nxt, lead = chain_links(trace.offsets, ids, len(uniq))
        parent = np.full(len(uniq), -1, dtype=np.int64)
        inner = np.flatnonzero(depth > 0)
        parent[ids[inner]] = ids[inner - 1]
        return cls(trace, ids, depth, request, trace.block_token_counts(), prv, nxt, lead, len(uniq), uniq, parent)


# ----------------------------------------------------------------------------- caches


class LRUCache:
    """Least-recently-used block cache; a request's blocks are touched tail first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def blocks(self) -> list[int]:
        """Cached blocks, next to be evicted first."""
        return list(self._order)

    def clear(self) -> None:
        self._order.clear()

    def load(self, blocks: Sequence[int], scores: Sequence[float] | None = None) -> None:
        """Fill with ``blocks`` given least valuable first (prewarm); ``scores`` are ignored."""
        for b in blocks:
            self._order[b] = None
            self._order.move_to_end(b)
        self._trim()

    def admit(self, index: BlockIndex, i: int) -> None:
        a, z = index.trace.offsets[i], index.trace.offsets[i + 1]
        order = self._order
        # NOTE: reversed so the root ends most recent and the tail is evicted first.
        for b in index.ids[a:z][::-1].tolist():
            if b in order:
                order.move_to_end(b)
            else:
                order[b] = None
        self._trim()

    def _trim(self) -> None:
        while len(self._order) > self.capacity:
            self._order.popitem(last=False)


class _HeapCache:
    """A cache evicting the lowest ``(priority, -depth)`` first, with lazy heap deletion."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._pri: dict[int, float] = {}
        self._heap: list[tuple[float, int, int]] = []

    def __len__(self) -> int:
        return len(self._pri)

    def __contains__(self, block: int) -> bool:
        return block in self._pri

    def blocks(self) -> list[int]:
        """Cached blocks, next to be evicted first."""
        live = sorted((p, d, b) for p, d, b in self._heap if self._pri.get(b) == p)
        seen: set[int] = set()
        return [b for _, _, b in live if not (b in seen or seen.add(b))]

    def clear(self) -> None:
        self._pri.clear()
        self._heap.clear()

    def _set(self, blocks: Iterable[int], priorities: Iterable[float], depths: Iterable[int]) -> None:
        pri, heap = self._pri, self._heap
        for b, p, d in zip(blocks, priorities, depths):
            pri[b] = p
            heapq.heappush(heap, (p, -d, b))
        while len(pri) > self.capacity:
            p, _, b = heapq.heappop(heap)
            if pri.get(b) == p:
                del pri[b]
        if len(heap) > 4 * self.capacity + 1024:
            self._heap = [(p, -d, b) for p, d, b in self._live()]
            heapq.heapify(self._heap)

    def _live(self) -> list[tuple[float, int, int]]:
        best: dict[int, tuple[float, int]] = {}
        for p, nd, b in self._heap:
            if self._pri.get(b) == p:
                best[b] = (p, -nd)
        return [(p, d, b) for b, (p, d) in best.items()]


def next_use(index: BlockIndex, rows: np.ndarray) -> np.ndarray:
    """For every block occurrence of requests ``rows``, the next of ``rows`` that uses the block.

    Occurrences outside ``rows``, and uses never repeated within ``rows``, get ``NEVER``.
    This is how Belady sees the future of one replica when it serves only some requests.
    """
    rows = np.asarray(rows, dtype=np.int64)
    offsets = index.trace.offsets
    if len(rows) == len(index.trace) and (len(rows) == 0 or rows[-1] == len(rows) - 1):
        return index.next_request
    lengths = offsets[rows + 1] - offsets[rows]
    starts = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    occ = np.repeat(offsets[rows] - starts, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
    ids = index.ids[occ]
    order = np.lexsort((occ, ids))
    same = ids[order[1:]] == ids[order[:-1]]
    out = np.full(len(index.ids), NEVER, dtype=np.int64)
    out[occ[order[:-1][same]]] = index.request[occ[order[1:][same]]]
    return out


class BeladyCache(_HeapCache):
    """Belady's MIN: evict the block used again furthest in the future (ties: deepest first).

    Blocks never used again go first, so this also covers "do not cache at all".

    Args:
        capacity: blocks.
        next_request: per block occurrence, the request index of the next use by the
            requests this cache serves (:func:`next_use`; default: every request).
    """

    def __init__(self, capacity: int, next_request: np.ndarray | None = None) -> None:
        super().__init__(capacity)
        self._next = next_request

    def load(self, blocks: Sequence[int], scores: Sequence[float] | None = None) -> None:
        """Belady is the eviction ceiling from a cold start: prewarming it is not supported."""
        raise ValueError("BeladyCache cannot be prewarmed; it is the eviction ceiling from a cold cache")

    def admit(self, index: BlockIndex, i: int) -> None:
        a, z = index.trace.offsets[i], index.trace.offsets[i + 1]
        nxt = (index.next_request if self._next is None else self._next)[a:z]
        self._set(index.ids[a:z].tolist(), (-nxt.astype(np.float64)).tolist(), index.depth[a:z].tolist())


# ----------------------------------------------------------------------------- replay


def prefix_hits(cache: LRUCache | BeladyCache, index: BlockIndex, i: int) -> int:
    """How many leading blocks of request ``i`` are in ``cache``."""
    a, z = index.trace.offsets[i], index.trace.offsets[i + 1]
    h = 0
    for b in index.ids[a:z].tolist():
        if b not in cache:
            break
        h += 1
    return h


def replay(index: BlockIndex, cache: LRUCache | BeladyCache, rows: Iterable[int]) -> np.ndarray:
    """Serve requests ``rows`` (increasing indices) from ``cache``; the cache is updated in place.

    Returns:
        int64 array, for each served row, the number of leading blocks that hit.
    """
    out = []
    for i in rows:
        out.append(prefix_hits(cache, index, i))
        cache.admit(index, i)
    return np.asarray(out, dtype=np.int64)
