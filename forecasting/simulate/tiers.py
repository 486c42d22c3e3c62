"""One serving node as the replay models it: vLLM's prefix cache over kvwarm's node tier over S3.

What a request meets, level by level, is what the KV connector does (docs/guides/engines.md):

1. **vLLM's prefix cache** (``gpu``, capacity in blocks, LRU; or Belady for the ceiling)
   answers first: its leading blocks cost nothing.
2. **The node tier** (NVMe and the node's shared pool; capacity in full blocks, evicting the
   lowest plan priority first, then the least recently used, a request's tail first) serves
   the blocks that follow, when loading them beats recomputing them
   (:func:`store.cost.load_beats_prefill` with the tier's :class:`store.cost.LoadCost`).
3. **S3** serves the blocks after that which some node wrote back (or the prefill job
   stored) before this request. With ``fetch_mode="background"`` (the loader's default) the
   request misses them and they are copied to the node tier for next time; with ``"sync"``
   the request waits for them when that wait is within the timeout and beats recomputing.

After the request vLLM holds every block of it; with write-back the full blocks it
computed go to the node tier (and S3: :class:`Node`'s ``stored`` array says since when a
block is in S3). Copies from S3 go through two first-come-first-served channels, as the
loader runs them (:mod:`forecasting.simulate.channels`): a plan's prefetch on its own
streams (``prefetch_streams``) and background fetches on the fetch workers
(``fetch_streams``), both over the node's one S3 link (``s3_bytes_per_s``).
"""
from __future__ import annotations

import copy
import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from forecasting.simulate.channels import FetchChannel, S3Link
from forecasting.simulate.replay import BeladyCache, BlockIndex, LRUCache, prefix_hits
from store.cost import LoadCost, PrefillCost, load_beats_prefill
from store.errors import BadInputError

FETCH_MODES = ("background", "sync")
#: loading from the node tier: the H200 loader bench's FP8 load, 538.5 MB in 72.1 ms
#: (``store.cost.LoadCost.fit`` of bench/calibration/load-tiers.json's ``node_tier``)
NODE_TIER = LoadCost(bytes_per_s=7.4689e9, s_per_file=0.0)
#: one S3 read stream: store_bench's GETs, 1 to 256 MiB (the same file's ``s3_stream``)
S3_STREAM = LoadCost(bytes_per_s=2.72834e8, s_per_file=6.7806e-3)
#: the node's S3 link, however many streams: one stream's rate times the speedup the prefetch bench
#: measured at its most streams (1.68 at 8; the same file's ``s3_node_link``)
S3_LINK_BYTES_PER_S = 2.72834e8 * 131.5 / 78.2


@dataclass(frozen=True)
class TierCosts:
    """What each level costs: the engine's prefill, a load from the node tier, a copy from S3.

    Attributes:
        prefill: the serving engine's prefill (time to first token of the uncached suffix).
        local: loading stored KV from the node tier into the engine.
        remote: one S3 read stream (a block's copy to the node tier takes ``remote.seconds``).
        block_bytes: stored bytes of one full block (kvwarm's format, e.g. FP8).
        prefetch_streams: S3 copies a plan's prefetch runs at once (the loader's
            ``prefetch_streams``).
        fetch_streams: S3 copies background fetches run at once (the loader's
            ``fetch_workers``).
        s3_bytes_per_s: the most the node reads from S3 however many streams run (the
            prefetch and the fetches share it); ``inf``: each stream at ``remote``'s rate.
    """

    prefill: PrefillCost
    local: LoadCost
    remote: LoadCost
    block_bytes: float
    prefetch_streams: int = 1
    fetch_streams: int = 1
    s3_bytes_per_s: float = math.inf

    def __post_init__(self) -> None:
        if not (self.block_bytes > 0 and math.isfinite(self.block_bytes)):
            raise BadInputError(f"TierCosts.block_bytes must be a positive number, got {self.block_bytes!r}")
        if not (isinstance(self.s3_bytes_per_s, (int, float)) and self.s3_bytes_per_s > 0):
            raise BadInputError(f"TierCosts.s3_bytes_per_s must be a positive number of bytes a second (inf: no "
                                f"limit), got {self.s3_bytes_per_s!r}")
        for name in ("prefetch_streams", "fetch_streams"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise BadInputError(f"TierCosts.{name} must be a positive integer, got {value!r}")

    @property
    def copy_s(self) -> float:
        """Seconds one stream takes to copy one block from S3."""
        return float(self.remote.seconds(self.block_bytes, 1))

    @property
    def link_s(self) -> float:
        """Seconds of the node's S3 link per block (0: no limit)."""
        return self.block_bytes / self.s3_bytes_per_s

    @property
    def prefetch_s(self) -> float:
        """Seconds per block of the prefetch channel alone (its streams, or the link if slower)."""
        return max(self.copy_s / self.prefetch_streams, self.link_s)

    @property
    def fetch_s(self) -> float:
        """Seconds per block of the background-fetch channel alone."""
        return max(self.copy_s / self.fetch_streams, self.link_s)


@dataclass(frozen=True)
class NodeShape:
    """A node's capacities and the connector's settings.

    Attributes:
        gpu_blocks: vLLM's prefix cache, in blocks.
        node_blocks: kvwarm's node tier, in full blocks (0 with ``store=False``).
        store: whether kvwarm's tiers are there at all (``False``: the engine alone).
        write_back: computed full blocks go to the node tier and S3.
        fetch_mode: ``background`` or ``sync`` (see the module docstring).
        sync_timeout_s: the longest a request waits for S3 in sync mode.
    """

    gpu_blocks: int
    node_blocks: int = 0
    store: bool = True
    write_back: bool = True
    fetch_mode: str = "background"
    sync_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.gpu_blocks < 1:
            raise BadInputError(f"the engine's cache must hold at least one block, got {self.gpu_blocks}")
        if self.store and self.node_blocks < 1:
            raise BadInputError(f"the node tier must hold at least one block, got {self.node_blocks}")
        if self.fetch_mode not in FETCH_MODES:
            raise BadInputError(f"unknown fetch mode {self.fetch_mode!r}; choose one of {', '.join(FETCH_MODES)}")


class NodeTier:
    """Full blocks up to ``capacity``, evicting the lowest key ``(priority, order)`` first.

    :meth:`put` gives each block its key. The replay's keys are ``(plan priority, access
    order)``, what the node's pool does (plan priority, then least recently used; blocks no
    plan names have priority 0), or, for the ceiling, ``(-next use, -depth)`` (Belady).
    Priority-0 blocks sit in access order (an ordered dict: plain LRU); the others in a
    heap with lazy deletion.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[int, float] = OrderedDict()
        self._key: dict[int, tuple[float, float]] = {}
        self._heap: list[tuple[float, float, int]] = []

    def __len__(self) -> int:
        return len(self._lru) + len(self._key)

    def __contains__(self, block: int) -> bool:
        return block in self._lru or block in self._key

    def blocks(self) -> list[int]:
        """Held blocks, next to be evicted first."""
        keyed = sorted((k[0], k[1], b) for b, k in self._key.items())
        low = [b for p, _, b in keyed if p < 0]
        return low + list(self._lru) + [b for p, _, b in keyed if p >= 0]

    def clear(self) -> None:
        self._lru.clear()
        self._key.clear()
        self._heap.clear()

    def copy(self) -> NodeTier:
        out = NodeTier(self.capacity)
        out._lru, out._key, out._heap = self._lru.copy(), dict(self._key), list(self._heap)
        return out

    def put(self, blocks: Iterable[int], keys: Iterable[tuple[float, float]]) -> None:
        lru, key, heap = self._lru, self._key, self._heap
        for b, k in zip(blocks, keys):
            if k[0] == 0.0:
                key.pop(b, None)
                lru[b] = k[1]
                lru.move_to_end(b)
            else:
                lru.pop(b, None)
                key[b] = k
                heapq.heappush(heap, (k[0], k[1], b))
        while len(lru) + len(key) > self.capacity:
            if heap and heap[0][0] < 0:  # below priority 0: Belady's keys, or a landed copy it does not want
                self._pop_heap()
            elif lru:
                lru.popitem(last=False)
            else:
                self._pop_heap()
        if len(heap) > 4 * self.capacity + 1024:
            self.rekey(lambda b, k: k)

    def _pop_heap(self) -> None:
        while self._heap:
            p, s, b = heapq.heappop(self._heap)
            if self._key.get(b) == (p, s):
                del self._key[b]
                return

    def rekey(self, new_key) -> None:  # noqa: ANN001 - (block, old key) -> new key
        """Give every held block ``new_key(block, old_key)`` (a new plan's priorities)."""
        old = [(b, (0.0, s)) for b, s in self._lru.items()] + list(self._key.items())
        self.clear()
        keys = sorted(((new_key(b, k), b) for b, k in old), key=lambda kb: kb[0][1])
        cap, self.capacity = self.capacity, len(keys) + 1
        self.put([b for _, b in keys], [k for k, _ in keys])
        self.capacity = cap


@dataclass(frozen=True)
class Served:
    """What one request got from each level (blocks), and what its first token cost."""

    gpu: int
    node: int
    s3: int
    load_s: float
    ttft_s: float


class Node:
    """One serving node: :meth:`serve` requests in time order; :meth:`apply_plan`, :meth:`restart`.

    Args:
        index: the trace's block index.
        shape, costs: see :class:`NodeShape`, :class:`TierCosts`.
        stored: per dense block id, the first request index that finds it in S3
            (``len(trace)`` or more: never).
        next_use: per block occurrence, the next request of this node using the block
            (:func:`forecasting.simulate.replay.next_use`): given, both levels evict by
            Belady's rule (the ceiling); ``None``: vLLM's LRU and the plan's priorities.
    """

    def __init__(self, index: BlockIndex, shape: NodeShape, costs: TierCosts, stored: np.ndarray,
                 next_use: np.ndarray | None = None) -> None:
        self.index, self.shape, self.costs = index, shape, costs
        self.stored = stored
        self._next = next_use
        self.gpu: LRUCache | BeladyCache = (LRUCache(shape.gpu_blocks) if next_use is None
                                            else BeladyCache(shape.gpu_blocks, next_use))
        self.tier = NodeTier(shape.node_blocks)
        link = S3Link(costs.link_s)
        self.fetch = FetchChannel(costs.fetch_s, link)
        self.prefetcher = FetchChannel(costs.prefetch_s, link)
        self.priority: dict[int, float] = {}
        self._seq = 0
        self._cum = np.concatenate([[0], np.cumsum(index.tokens)])
        self._full = index.tokens >= index.trace.block_tokens

    def fork(self) -> Node:
        """An independent copy of this node's state (the trace and costs are shared)."""
        out = copy.copy(self)
        if isinstance(self.gpu, LRUCache):
            out.gpu = LRUCache(self.gpu.capacity)
            out.gpu._order = self.gpu._order.copy()
        else:
            out.gpu = copy.copy(self.gpu)
            out.gpu._pri, out.gpu._heap = dict(self.gpu._pri), list(self.gpu._heap)
        link = self.fetch.link.copy()
        out.tier, out.fetch, out.prefetcher = self.tier.copy(), self.fetch.copy(link), self.prefetcher.copy(link)
        out.priority = dict(self.priority)
        return out

    # ------------------------------------------------------------------ plan and events

    def apply_plan(self, priority: dict[int, float], order: Sequence[int], now: float, row: int) -> int:
        """A plan's retention priorities replace the last plan's; its blocks that S3 has and
        this node lacks are queued for copying in ``order``. Returns how many were queued."""
        self.priority = priority
        self.tier.rekey(lambda b, k: (priority.get(b, 0.0), k[1]))
        return self.prefetch(order, now, row)

    def prefetch(self, order: Sequence[int], now: float, row: int) -> int:
        """Queue the copy of ``order``'s blocks that S3 has (for request ``row``) and the tier lacks,
        in place of a previous prefetch still in flight (a new plan replaces the last)."""
        stored, tier = self.stored, self.tier
        todo = [b for b in order if b < len(stored) and stored[b] <= row and b not in tier]
        self.prefetcher.clear()
        return self.prefetcher.submit(todo, now)

    def restart(self) -> None:
        """The engine restarts: its cache and the copies in flight are gone; the node tier stays."""
        self.gpu.clear()
        self.fetch.clear()
        self.prefetcher.clear()
        self.fetch.link.clear()

    # ------------------------------------------------------------------ serving

    def _keys(self, occurrences: Sequence[int], blocks: Sequence[int]) -> list[tuple[float, float]]:
        if self._next is not None:
            return [(-float(self._next[o]), -float(self.index.depth[o])) for o in occurrences]
        out = []
        for b in blocks:
            self._seq += 1
            out.append((self.priority.get(b, 0.0), float(self._seq)))
        return out

    def land(self, now: float) -> None:
        """Put the copies finished by ``now`` into the node tier."""
        done = self.prefetcher.landed(now, self.tier) + self.fetch.landed(now, self.tier)
        if done:
            self._seq += 1
            self.tier.put(done, [(self.priority.get(b, 0.0), float(self._seq)) for b in done]
                          if self._next is None else [(-math.inf, 0.0)] * len(done))

    def serve(self, i: int) -> Served:
        """Serve request ``i`` (after :meth:`land`); the levels are updated in place."""
        index, costs, shape = self.index, self.costs, self.shape
        a, z = int(index.trace.offsets[i]), int(index.trace.offsets[i + 1])
        ids = index.ids[a:z]
        cum = self._cum[a:z + 1] - self._cum[a]
        g = prefix_hits(self.gpu, index, i)
        n = s = 0
        load_s = 0.0
        if shape.store:
            tier, bb = self.tier, costs.block_bytes
            while g + n < len(ids) and int(ids[g + n]) in tier:
                n += 1
            if n and not load_beats_prefill(costs.prefill, costs.local, cached_tokens=int(cum[g]),
                                            hit_tokens=int(cum[g + n] - cum[g]), n_bytes=n * bb, files=n):
                n = 0
            if n:
                load_s += float(costs.local.seconds(n * bb, n))
            k = g + n
            while k + s < len(ids) and self._in_s3(int(ids[k + s]), i):
                s += 1
            if s:
                wait = s * costs.fetch_s + float(costs.local.seconds(s * bb, s))
                saved = float(costs.prefill.seconds(int(cum[k + s]), int(cum[k])))
                if shape.fetch_mode == "sync" and wait <= shape.sync_timeout_s and wait < saved:
                    load_s += wait
                else:
                    self.fetch.submit(ids[k:k + s].tolist(), float(index.trace.timestamps_s[i]))
                    s = 0
        cached = g + n + s
        ttft = load_s + float(costs.prefill.seconds(int(index.trace.input_tokens[i]), int(cum[cached])))
        self.gpu.admit(index, i)
        if shape.store:
            self._admit_tier(a, ids, g, cached)
        return Served(g, n, s, load_s, ttft)

    def _in_s3(self, block: int, i: int) -> bool:
        return block not in self.tier and self.stored[block] <= i

    def _admit_tier(self, a: int, ids: np.ndarray, g: int, cached: int) -> None:
        """Loaded blocks are touched; computed full blocks are written back (root most recent)."""
        upto = len(ids) if self.shape.write_back else cached
        occ = [o for o in range(a + upto - 1, a + g - 1, -1) if self._full[o]]
        if occ:
            blocks = ids[np.asarray(occ) - a].tolist()
            self.tier.put(blocks, self._keys(occ, blocks))
