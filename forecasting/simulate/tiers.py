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
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from forecasting.simulate.channels import FetchChannel, S3Link, drain
from forecasting.simulate.node_tier import NodeTier
from forecasting.simulate.replay import BeladyCache, BlockIndex, LRUCache, prefix_hits
from forecasting.simulate.uploads import WRITE_BACK_STREAMS, UploadQueue
from store.cost import LoadCost, PrefillCost, load_beats_prefill
from store.errors import BadInputError

__all__ = ["NODE_TIER", "S3_STREAM", "S3_LINK_BYTES_PER_S", "HOST_S3_STREAM", "HOST_S3_LINK_BYTES_PER_S", "S3_SOURCE",
           "TierCosts", "NodeShape", "NodeTier", "Served", "Node"]

FETCH_MODES = ("background", "sync")
#: loading from the node tier: the H200 loader bench's FP8 load, 538.5 MB in 72.1 ms
#: (``store.cost.LoadCost.fit`` of bench/calibration/load-tiers.json's ``node_tier``)
NODE_TIER = LoadCost(bytes_per_s=7.4689e9, s_per_file=0.0)
#: AWS's guidance for one S3 request (connection) from an EC2 instance in the bucket's region: about 85-90 MB/s
#: each, so "one concurrent request for each 85-90 MB/s of desired network throughput" (Amazon S3 user guide,
#: "Performance design patterns for Amazon S3", :data:`S3_SOURCE`); 87.5 MB/s, the middle of that range
CLOUD_S3_STREAM_BYTES_PER_S = 87.5e6
S3_SOURCE = "https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance-design-patterns.html"
#: the default deployment's S3 read stream: one request at AWS's per-request rate (first-byte latency, 100-200 ms
#: for small objects on the same guide's pages, is inside that throughput figure for blocks of tens of MB)
S3_STREAM = LoadCost(bytes_per_s=CLOUD_S3_STREAM_BYTES_PER_S, s_per_file=0.0)
#: the default node's S3 link: the loader's ``prefetch_streams`` (8) requests at AWS's per-request rate, 700 MB/s
#: (5.6 Gb/s); the background fetches (``fetch_workers``) and write-back uploads share it
S3_LINK_BYTES_PER_S = 8 * CLOUD_S3_STREAM_BYTES_PER_S
#: this host's S3 stream: store_bench's GETs against SeaweedFS on the 2-core host, 1 to 256 MiB (the same file's
#: ``s3_stream``); what ``prefill simulate --s3-profile host`` replays
HOST_S3_STREAM = LoadCost(bytes_per_s=2.72834e8, s_per_file=6.7806e-3)
#: this host's S3 link: one stream's rate times the speedup the prefetch bench measured at its most streams
#: (1.68 at 8; the same file's ``s3_node_link``): 459 MB/s, bound by the host's CPU and disk
HOST_S3_LINK_BYTES_PER_S = 2.72834e8 * 131.5 / 78.2

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
        s3_bytes_per_s: the most the node moves to and from S3 however many streams run (the
            prefetch, the fetches and the write-back uploads share it); ``inf``: each stream at
            ``remote``'s rate.
        save_block_bytes: bytes one block's write-back copy takes in the upload queue (the
            engine's KV of a block; default ``block_bytes``).
        upload_streams: write-back uploads at once (the loader's ``write_back_streams``).
    """

    prefill: PrefillCost
    local: LoadCost
    remote: LoadCost
    block_bytes: float
    prefetch_streams: int = 1
    fetch_streams: int = 1
    s3_bytes_per_s: float = math.inf
    save_block_bytes: float | None = None
    upload_streams: int = WRITE_BACK_STREAMS

    def __post_init__(self) -> None:
        if not (self.block_bytes > 0 and math.isfinite(self.block_bytes)):
            raise BadInputError(f"TierCosts.block_bytes must be a positive number, got {self.block_bytes!r}")
        if not (isinstance(self.s3_bytes_per_s, (int, float)) and self.s3_bytes_per_s > 0):
            raise BadInputError(f"TierCosts.s3_bytes_per_s must be a positive number of bytes a second (inf: no "
                                f"limit), got {self.s3_bytes_per_s!r}")
        for name in ("prefetch_streams", "fetch_streams", "upload_streams"):
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

    @property
    def save_bytes(self) -> float:
        """Bytes a block's write-back copy holds in the upload queue."""
        return self.block_bytes if self.save_block_bytes is None else float(self.save_block_bytes)


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
        write_back_queue_bytes: the most write-back copies that wait for the node's writer
            (:mod:`forecasting.simulate.uploads`); ``inf``: no bound.
    """

    gpu_blocks: int
    node_blocks: int = 0
    store: bool = True
    write_back: bool = True
    fetch_mode: str = "background"
    sync_timeout_s: float = 2.0
    write_back_queue_bytes: float = math.inf

    def __post_init__(self) -> None:
        if not self.write_back_queue_bytes >= 0:
            raise BadInputError(f"the write-back queue must hold 0 or more bytes, got {self.write_back_queue_bytes!r}")
        if self.gpu_blocks < 1:
            raise BadInputError(f"the engine's cache must hold at least one block, got {self.gpu_blocks}")
        if self.store and self.node_blocks < 1:
            raise BadInputError(f"the node tier must hold at least one block, got {self.node_blocks}")
        if self.fetch_mode not in FETCH_MODES:
            raise BadInputError(f"unknown fetch mode {self.fetch_mode!r}; choose one of {', '.join(FETCH_MODES)}")


@dataclass(frozen=True)
class Served:
    """What one request got from each level (blocks), and what its first token cost."""

    gpu: int
    node: int
    s3: int
    load_s: float
    ttft_s: float


class Node:
    """One serving node: :meth:`serve` requests in time order; :meth:`retain`, :meth:`prefetch`, :meth:`restart`.

    Args:
        index: the trace's block index.
        shape, costs: see :class:`NodeShape`, :class:`TierCosts`.
        stored: per dense block id, the first request index that finds it in S3 without this
            node (other nodes' write-back, the prefill job; ``len(trace)`` or more: never). The
            node keeps its own copy, :attr:`stored`, and lowers it as its uploads land.
        next_use: per block occurrence, the next request of this node using the block
            (:func:`forecasting.simulate.replay.next_use`): given, both levels evict by
            Belady's rule (the ceiling); ``None``: vLLM's LRU and the plan's priorities.
    """

    def __init__(self, index: BlockIndex, shape: NodeShape, costs: TierCosts, stored: np.ndarray,
                 next_use: np.ndarray | None = None) -> None:
        self.index, self.shape, self.costs = index, shape, costs
        self.stored = np.array(stored, dtype=np.int64, copy=True)
        self._next = next_use
        self.gpu: LRUCache | BeladyCache = (LRUCache(shape.gpu_blocks) if next_use is None
                                            else BeladyCache(shape.gpu_blocks, next_use))
        self.tier = NodeTier(shape.node_blocks)
        link = S3Link(costs.link_s)
        self.fetch = FetchChannel(costs.fetch_s, link)
        self.prefetcher = FetchChannel(costs.prefetch_s, link)
        self.uploads = UploadQueue(costs.copy_s, link, max_bytes=shape.write_back_queue_bytes,
                                   save_bytes=costs.save_bytes, block_bytes=costs.block_bytes,
                                   streams=costs.upload_streams)
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
        out.uploads = self.uploads.copy(link)
        out.priority = dict(self.priority)
        out.stored = self.stored.copy()
        return out

    # ------------------------------------------------------------------ plan and events

    def retain(self, priority: dict[int, float]) -> None:
        """Retention priorities (the node agent's) replace the last ones; unnamed blocks are 0."""
        self.priority = priority
        self.tier.rekey(lambda b, k: (priority.get(b, 0.0), k[1]))

    def prefetch(self, order: Sequence[int], now: float, row: int) -> int:
        """Queue the copy of ``order``'s blocks that S3 has (for request ``row``) and the tier lacks,
        in place of a previous prefetch still in flight (a new plan replaces the last)."""
        stored, tier = self.stored, self.tier
        todo = [b for b in order if b < len(stored) and stored[b] <= row and b not in tier]
        self.prefetcher.clear()
        return self.prefetcher.submit(todo, now)

    def restart(self) -> None:
        """The engine restarts: its cache, the copies in flight and the write-back queue are gone;
        the node tier stays."""
        self.gpu.clear()
        self.fetch.clear()
        self.prefetcher.clear()
        self.uploads.clear()
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
        """Carry out the copies and uploads finished by ``now``: copies go into the node tier,
        uploads into S3 (found from the first request at or after their landing on)."""
        done, ts = [], self.index.trace.timestamps_s
        for k, b, t in drain((self.prefetcher, self.fetch, self.uploads), now, self.tier):
            if k == 2:
                self.stored[b] = min(int(self.stored[b]), int(np.searchsorted(ts, t, side="left")))
            else:
                done.append(b)
        if done:
            self._seq += 1
            self.tier.put(done, [(self.priority.get(b, 0.0), float(self._seq)) for b in done]
                          if self._next is None else [(-math.inf, 0.0)] * len(done))

    def sync_wait(self, blocks: Sequence[int], now: float, limit: float) -> float | None:
        """Seconds until ``blocks``, queued now on the fetch workers behind what waits there and
        sharing the link with the prefetch and the uploads, have all landed; ``None``: not within
        ``limit`` seconds. Nothing of the node changes."""
        link = self.fetch.link.copy()
        chans = (self.prefetcher.copy(link), self.fetch.copy(link), self.uploads.copy(link))
        chans[1].submit(blocks, now)
        want = set(blocks)
        for _, b, t in drain(chans, now + limit, self.tier):
            want.discard(b)
            if not want:
                return t - now
        return None

    def serve(self, i: int) -> Served:
        """Serve request ``i`` (after :meth:`land`); the levels are updated in place."""
        index, costs, shape = self.index, self.costs, self.shape
        a, z = int(index.trace.offsets[i]), int(index.trace.offsets[i + 1])
        ids = index.ids[a:z]
        cum = self._cum[a:z + 1] - self._cum[a]
        now = float(index.trace.timestamps_s[i])
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
                blocks = ids[k:k + s].tolist()
                load = float(costs.local.seconds(s * bb, s))
                saved = float(costs.prefill.seconds(int(cum[k + s]), int(cum[k])))
                wait = None
                if shape.fetch_mode == "sync" and load < saved:
                    wait = self.sync_wait(blocks, now, min(shape.sync_timeout_s, saved - load))
                self.fetch.submit(blocks, now)  # waited for or not, the copies go on (for next time)
                if wait is not None and wait + load < saved:
                    load_s += wait + load
                else:
                    s = 0
        cached = g + n + s
        ttft = load_s + float(costs.prefill.seconds(int(index.trace.input_tokens[i]), int(cum[cached])))
        self.gpu.admit(index, i)
        if shape.store:
            self._admit_tier(a, ids, g, g + n, cached, now)
        return Served(g, n, s, load_s, ttft)

    def _in_s3(self, block: int, i: int) -> bool:
        return block not in self.tier and self.stored[block] <= i

    def _admit_tier(self, a: int, ids: np.ndarray, g: int, loaded: int, cached: int, now: float) -> None:
        """Blocks loaded from the tier (``g`` to ``loaded``) are touched; those waited for from S3
        land through the fetch channel. With write-back the computed full blocks are one save: its
        leading blocks that the upload queue takes are queued for upload (root first, the ones the
        tier lacks) and kept in the tier; the tail it cannot take is dropped (the product's
        ``queue_full``: it reaches no tier). Root most recent."""
        occ = []
        if self.shape.write_back:
            computed = [o for o in range(a + len(ids) - 1, a + cached - 1, -1) if self._full[o]]
            if computed:
                blocks = ids[np.asarray(computed) - a].tolist()
                kept = self.uploads.submit(blocks[::-1], self.tier, now)
                occ = computed[len(computed) - kept:]
        occ += [o for o in range(a + loaded - 1, a + g - 1, -1) if self._full[o]]
        if occ:
            blocks = ids[np.asarray(occ) - a].tolist()
            self.tier.put(blocks, self._keys(occ, blocks))
