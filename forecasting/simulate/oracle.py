"""The replay's oracle: per request, a time to first token that no policy on the same node can beat.

It is a bound computed request by request, not a node that runs. For request ``i`` of a
node it assumes the best any policy could have had at that moment, at the same link and
streams, and takes the cheapest way to serve the request from it:

1. **Free blocks**: the prefix that vLLM's own cache holds (LRU), replayed over the requests
   the engine served since it (re)started. Every deployable policy runs the engine's own
   cache, and the engine admits every request whole whatever the store did, so that prefix
   is the same for all of them. The ``belady`` row changes vLLM's eviction itself, which no
   store can do: it is a ceiling of eviction and is not bounded here.
2. **Blocks any policy could load from the node tier**, at the node tier's load cost: a
   block this node served before (its tier's lifetime: from the trace start, or from the
   event for a new node), or one that S3 could hold by then at the earliest (the request
   after its first full use anywhere in the trace, or the prefill job's time): no policy's
   S3 has a block earlier, since an upload lands after the block was computed.
3. **The link**: blocks of the second kind that this node never served had to come over
   the link. By ``ts[i]`` the link could have carried at most
   ``C_i = (ts[i] - start) / t`` blocks since the tier's start, at ``t = max(link_s,
   copy_s / (prefetch + fetch streams))`` a block (the fastest the channels copy
   together); a policy that has more of them in the request's prefix fetched the rest
   while the request waited, at least ``t`` each. The bound charges exactly that:
   ``max(0, x - C_i) * t`` for ``x`` such blocks.

The prefix served is the one of lowest cost (load plus the prefill of the rest,
:class:`store.cost.PrefillCost`). Every policy's request takes a prefix of free blocks
(its vLLM hit), then node-tier loads and S3 waits whose
costs are at least those charged here, so no policy's TTFT on any request is below the
bound, and no mean over a window is either. It ignores the node tier's capacity, the
uploads' share of the link and the fact that one copy serves one block, so it is not
reachable: the gap between a policy and it is an upper bound on what any prewarming could
still win.
"""
from __future__ import annotations

import math

import numpy as np

from forecasting.simulate.prewarm import first_use
from forecasting.simulate.replay import BlockIndex, LRUCache, replay
from forecasting.simulate.tiers import Served, TierCosts


def engine_hits(index: BlockIndex, engine: np.ndarray, gpu_blocks: int) -> dict[int, int]:
    """Per request of ``engine`` (served in order since the engine started), its prefix hit in
    vLLM's cache (LRU, as the engine runs it)."""
    engine = np.asarray(engine, dtype=np.int64)
    lru = replay(index, LRUCache(gpu_blocks), engine.tolist())
    return dict(zip(engine.tolist(), np.asarray(lru).tolist()))


def oracle_served(index: BlockIndex, costs: TierCosts, gpu_blocks: int, rows: np.ndarray, *, history: np.ndarray,
                  engine: np.ndarray, stored: np.ndarray, start_s: float,
                  hits: dict[int, int] | None = None) -> list[Served]:
    """The bound (module docstring) for each of ``rows``.

    Args:
        rows: the requests to bound, in order.
        history: every request this node's tier saw from its start, in order (includes ``rows``).
        engine: the requests since the engine's (re)start, in order (includes ``rows``).
        stored: per block, the earliest request that could find it in S3 (any policy).
        start_s: when the node's tier started (the link carries copies from then on).
        hits: :func:`engine_hits` of ``engine`` when already computed.
    """
    tr = index.trace
    hits = engine_hits(index, engine, gpu_blocks) if hits is None else hits
    seen_first = first_use(index, np.asarray(history, dtype=np.int64))
    per_block = max(costs.link_s, costs.copy_s / (costs.prefetch_streams + costs.fetch_streams))
    cum_all = np.concatenate([[0], np.cumsum(index.tokens)])
    bb, local, prefill = costs.block_bytes, costs.local, costs.prefill
    out = []
    for i in np.asarray(rows, dtype=np.int64).tolist():
        a, z = int(tr.offsets[i]), int(tr.offsets[i + 1])
        ids = index.ids[a:z]
        cum = cum_all[a:z + 1] - cum_all[a]
        g = int(hits[i])
        seen = seen_first[ids[g:]] < i
        avail = seen | (stored[ids[g:]] <= i)
        stop = int(np.argmin(avail)) if not avail.all() else len(avail)
        m = np.arange(stop + 1)
        x = np.concatenate([[0], np.cumsum(~seen[:stop])])
        cap = math.floor((float(tr.timestamps_s[i]) - start_s) / per_block) if per_block > 0 else math.inf
        wait = np.maximum(0, x - cap) * per_block if math.isfinite(cap) else np.zeros(stop + 1)
        load = local.seconds(m * bb, m) if stop else np.zeros(1)
        total = int(tr.input_tokens[i])
        ttft = load + wait + prefill.seconds(total, cum[g + m])
        k = int(np.argmin(ttft))
        out.append(Served(g, k - int(x[k]), int(x[k]), float(load[k] + wait[k]), float(ttft[k])))
    return out
