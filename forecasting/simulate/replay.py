"""Replaying block chains against a prefix cache of fixed capacity, under three evictions.

Semantics (those of vLLM's prefix cache): a request's block ``j`` is a hit only when
blocks ``0..j`` are all cached; after the request every block of its chain is cached
(inserted or touched), and when the cache is over capacity it evicts, among the least
valuable blocks, the deepest first (vLLM frees a request's blocks tail first).

Evictions:

- :class:`LRUCache`: least recently used (vLLM, LMCache, SGLang's radix cache).
- :class:`BeladyCache`: evict the block whose next use is furthest away (offline, uses
  the future: the eviction ceiling, not a policy anyone can run).
- :class:`RetentionCache`: kvwarm's forecast-informed retention: evict the block whose
  predicted reuse is lowest, ``log p(reuse | class) + t_last / tau`` where the class
  probabilities come from :class:`ReusePredictor`, learned only from outcomes already
  observed at decision time.

Everything here is pure: a :class:`BlockIndex` of numpy arrays is built once per trace,
and :func:`replay` returns the number of prefix blocks hit by each request.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from forecasting.ingest.traces import Trace
from store.errors import BadInputError

NEVER = np.iinfo(np.int64).max
_LEN_EDGES = np.array([4, 8, 16, 32, 64])
_GAP_EDGES = np.array([30.0, 120.0, 600.0])


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
        request = trace.block_request()
        n = len(ids)
        order = np.lexsort((np.arange(n), ids))
        same = ids[order[1:]] == ids[order[:-1]]
        nxt = np.full(n, NEVER, dtype=np.int64)
        nxt[order[:-1][same]] = request[order[1:][same]]
        prv = np.full(n, -1, dtype=np.int64)
        prv[order[1:][same]] = request[order[:-1][same]]
        depth = trace.block_depths()
        # Leading seen-before blocks: the first depth whose block is new, per request.
        lengths = trace.chain_lengths()
        first_new = np.where(prv < 0, depth, NEVER)
        lead = np.zeros(len(trace), dtype=np.int64)
        has = lengths > 0
        if n:
            lead[has] = np.minimum.reduceat(first_new, trace.offsets[:-1][has])
        lead = np.minimum(lead, lengths)
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


# ------------------------------------------------------------------ reuse prediction


@dataclass(frozen=True)
class PredictorConfig:
    """Knobs of :class:`ReusePredictor` and of the retention priority.

    Attributes:
        horizon_s: a block occurrence counts as reused when its block is used again
            within this many seconds.
        tau_s: recency scale of the priority ``log p + t_last / tau_s`` (larger: the
            class probability matters longer against recency).
        refresh_s: how often the class table is re-estimated from closed outcomes.
            The defaults of these three were chosen by ``bench/replay_bench.py --tune``.
        prior_weight: pseudo-count pulling a class towards the overall reuse rate.
        prior_rate: reuse probability assumed before any outcome has been observed.
    """

    horizon_s: float = 300.0
    tau_s: float = 300.0
    refresh_s: float = 15.0
    prior_weight: float = 20.0
    prior_rate: float = 0.3

    def __post_init__(self) -> None:
        for name in ("horizon_s", "tau_s", "refresh_s", "prior_weight"):
            if not getattr(self, name) > 0:
                raise BadInputError(f"PredictorConfig.{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.prior_rate < 1:
            raise BadInputError(f"PredictorConfig.prior_rate must be in (0, 1), got {self.prior_rate!r}")


N_CLASSES = 3 * 2 * (len(_LEN_EDGES) + 1) * (len(_GAP_EDGES) + 2)


def occurrence_classes(index: BlockIndex) -> np.ndarray:
    """The reuse class of each block occurrence, from what is known when its request arrives.

    Features: how many times the block was used before (1, 2, 3+), whether it is the
    last block of its chain (a partial tail is almost never reused), the request's
    chain length (short conversations come back more often) and the gap since the
    conversation's previous turn (none, <30 s, <2 min, <10 min, longer).
    """
    tr = index.trace
    lengths = tr.chain_lengths()
    seen = np.zeros(len(index.ids), dtype=np.int64)
    # Use count so far = rank of the occurrence among its block's occurrences.
    order = np.lexsort((np.arange(len(index.ids)), index.ids))
    starts = np.r_[True, index.ids[order[1:]] != index.ids[order[:-1]]] if len(order) else np.zeros(0, bool)
    pos = np.arange(len(order))
    seen[order] = pos - np.maximum.accumulate(np.where(starts, pos, 0))
    count_b = np.minimum(seen, 2)
    tail = np.zeros(len(index.ids), dtype=np.int64)
    tail[tr.offsets[1:][lengths > 0] - 1] = 1
    len_b = np.digitize(lengths, _LEN_EDGES)
    gap = np.full(len(tr), -1.0)
    k = index.lead_seen
    cont = k >= 2
    last_shared = tr.offsets[:-1][cont] + k[cont] - 1
    gap[cont] = tr.timestamps_s[cont] - tr.timestamps_s[index.prev_request[last_shared]]
    gap_b = np.where(gap < 0, 0, 1 + np.digitize(gap, _GAP_EDGES))
    per_request = len_b * (len(_GAP_EDGES) + 2) + gap_b
    return ((count_b * 2 + tail) * ((len(_LEN_EDGES) + 1) * (len(_GAP_EDGES) + 2))
            + np.repeat(per_request, lengths)).astype(np.int64)


@dataclass
class ReusePredictor:
    """P(block used again within ``horizon_s`` | class), estimated from closed outcomes only.

    An occurrence's outcome is *closed* at decision time ``t`` when its horizon ended
    strictly before ``t``: then whether it was reused is already a fact of the past.
    Outcomes still open are ignored, so the estimate never looks past ``t``.
    """

    index: BlockIndex
    config: PredictorConfig = field(default_factory=PredictorConfig)

    def __post_init__(self) -> None:
        self.classes = occurrence_classes(self.index)
        ts = self.index.trace.timestamps_s
        occ_t = ts[self.index.request]
        nxt = self.index.next_request
        reuse_t = np.where(nxt == NEVER, np.inf, ts[np.minimum(nxt, len(ts) - 1)])
        self._reused = (reuse_t - occ_t) <= self.config.horizon_s
        self._close_t = occ_t + self.config.horizon_s
        self._closed = 0
        self._n = np.zeros(N_CLASSES)
        self._r = np.zeros(N_CLASSES)
        self._as_of = -math.inf
        self.log_p = np.full(N_CLASSES, math.log(self.config.prior_rate))

    def update(self, t: float) -> None:
        """Fold in every outcome closed before ``t`` (``t`` must not decrease)."""
        if t < self._as_of:
            raise ValueError(f"ReusePredictor.update went back in time: {t} < {self._as_of}")
        self._as_of = t
        m = int(np.searchsorted(self._close_t, t, side="left"))
        if m > self._closed:
            c = self.classes[self._closed : m]
            self._n += np.bincount(c, minlength=N_CLASSES)
            self._r += np.bincount(c, weights=self._reused[self._closed : m], minlength=N_CLASSES)
            self._closed = m
        total_n, total_r = self._n.sum(), self._r.sum()
        base = (total_r + self.config.prior_rate) / (total_n + 1.0)
        w = self.config.prior_weight
        p = (self._r + w * base) / (self._n + w)
        self.log_p = np.log(np.clip(p, 1e-4, 1.0))

    def priorities(self, a: int, z: int, t: float) -> np.ndarray:
        """Retention priorities of occurrences ``a..z`` (one chain) touched at time ``t``.

        Made non-increasing along the chain: a block is worth no more than its parent,
        which every hit on it needs.
        """
        return np.minimum.accumulate(self.log_p[self.classes[a:z]]) + t / self.config.tau_s


class RetentionCache(_HeapCache):
    """Forecast-informed retention: evict the lowest predicted reuse (ties: deepest first)."""

    def __init__(self, capacity: int, predictor: ReusePredictor) -> None:
        super().__init__(capacity)
        self.predictor = predictor
        self._next_refresh = -math.inf

    def load(self, blocks: Sequence[int], scores: Sequence[float] | None = None) -> None:
        """Fill with ``blocks`` at retention priorities ``scores`` (same scale as :meth:`admit`)."""
        if scores is None:
            scores = np.arange(len(blocks), dtype=np.float64) - len(blocks)
        self._set(blocks, (float(s) for s in scores), (0 for _ in blocks))

    def admit(self, index: BlockIndex, i: int) -> None:
        t = float(index.trace.timestamps_s[i])
        if t >= self._next_refresh:
            self.predictor.update(t)
            self._next_refresh = t + self.predictor.config.refresh_s
        a, z = index.trace.offsets[i], index.trace.offsets[i + 1]
        self._set(index.ids[a:z].tolist(), self.predictor.priorities(a, z, t).tolist(), index.depth[a:z].tolist())


# ----------------------------------------------------------------------------- replay


def prefix_hits(cache: LRUCache | _HeapCache, index: BlockIndex, i: int) -> int:
    """How many leading blocks of request ``i`` are in ``cache``."""
    a, z = index.trace.offsets[i], index.trace.offsets[i + 1]
    h = 0
    for b in index.ids[a:z].tolist():
        if b not in cache:
            break
        h += 1
    return h


def replay(index: BlockIndex, cache: LRUCache | _HeapCache, rows: Iterable[int]) -> np.ndarray:
    """Serve requests ``rows`` (increasing indices) from ``cache``; the cache is updated in place.

    Returns:
        int64 array, for each served row, the number of leading blocks that hit.
    """
    out = []
    for i in rows:
        out.append(prefix_hits(cache, index, i))
        cache.admit(index, i)
    return np.asarray(out, dtype=np.int64)
