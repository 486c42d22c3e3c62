"""What to compute: the missing blocks of many prefixes as a tree of segments, in batches.

Pure logic, no model and no I/O. Given each prefix's block chain and how many leading
blocks the store already holds, the missing blocks form a forest (prefixes that share
a system prompt share its blocks: the key of a block names its whole prefix). Runs of
blocks with one child each are merged into *segments*, as in a radix tree, so that:

- every missing block is computed exactly once, whatever number of prefixes share it;
- a segment starts either right after stored blocks (its past is loaded from the
  store, or empty at block 0) or right after its parent segment (its past is the
  parent's KV, kept in memory for the children of this run);
- segments are computed in *waves* (a segment is ready when its parent is done), and
  inside a wave batched by equal past length and similar own length, because a batch
  shares one stacked cache of one length and right-padding is free for causal models
  (padded positions come after every real one and are dropped).

Batches are ordered by the best priority (lowest ``order``) of the prefixes they serve,
so a deadline cuts the least valuable work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from store.cost import PrefillCost
from store.identity.keys import Block, KeyRoot

#: the runner's relative compute cost (:meth:`Batch.cost`): a token is one unit, and
#: attention costs as much as the rest at about 4,000 tokens; the runner measures its units
#: per second online, so only the shape matters
TOKEN_UNITS = PrefillCost(s_per_token=1.0, s_per_token_pair=1.0 / 2048)


@dataclass(frozen=True)
class PrefixJob:
    """One prefix to warm: its root (tenant and model identity), block chain and TTL."""

    tenant: str
    root: KeyRoot
    blocks: tuple[Block, ...]
    stored: int
    ttl_s: float
    order: int

    @property
    def missing(self) -> tuple[Block, ...]:
        return self.blocks[self.stored:]


@dataclass
class Segment:
    """A run of missing blocks computed in one forward pass over their tokens."""

    id: int
    tenant: str
    root: KeyRoot
    start: int                      # index of the first block in the chain
    blocks: list[Block]
    parent: int | None              # segment computed earlier in this run, or None
    stored_prefix: tuple[Block, ...]  # stored blocks before ``start`` (loaded as the past) when parent is None
    ttl_s: float
    order: int
    children: list[int] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.blocks) * self.root.block_size

    @property
    def past_tokens(self) -> int:
        return self.start * self.root.block_size

    @property
    def token_ids(self) -> list[int]:
        return [t for b in self.blocks for t in b.tokens]


def build_segments(jobs: Sequence[PrefixJob]) -> dict[int, Segment]:
    """Merge the missing blocks of ``jobs`` into segments (a radix tree over block keys)."""
    # key -> (block, parent key or None, root, tenant); children by parent key
    nodes: dict[str, Block] = {}
    meta: dict[str, tuple[str, KeyRoot, float, int, tuple[Block, ...]]] = {}
    children: dict[str, list[str]] = {}
    firsts: list[str] = []  # keys whose parent is stored (or the root): segment starts
    for job in jobs:
        prev_missing: str | None = None
        for i, b in enumerate(job.missing):
            index = job.stored + i
            if b.key in nodes:
                tenant, root, ttl, order, tail = meta[b.key]
                if prev_missing is not None and b.key in firsts:
                    # another job's probe saw the blocks before this one as stored (a
                    # concurrent writer); this job must compute them, so link them up
                    firsts.remove(b.key)
                    children.setdefault(prev_missing, []).append(b.key)
                    tail = ()
                meta[b.key] = (tenant, root, max(ttl, job.ttl_s), min(order, job.order), tail)
            else:
                nodes[b.key] = b
                tail = job.blocks[: job.stored] if i == 0 else ()
                meta[b.key] = (job.tenant, job.root, job.ttl_s, job.order, tail)
                if prev_missing is None:
                    firsts.append(b.key)
                else:
                    children.setdefault(prev_missing, []).append(b.key)
            assert index == b.index, "block chain indices must be consecutive"
            prev_missing = b.key
    # TTL and order of a block cover every prefix through it: propagate from leaves up.
    segments: dict[int, Segment] = {}

    def new_segment(first: str, parent: int | None) -> None:
        stack = [(first, parent)]
        while stack:
            key, par = stack.pop()
            tenant, root, ttl, order, tail = meta[key]
            seg = Segment(id=len(segments), tenant=tenant, root=root, start=nodes[key].index, blocks=[nodes[key]],
                          parent=par, stored_prefix=tail if par is None else (), ttl_s=ttl, order=order)
            segments[seg.id] = seg
            if par is not None:
                segments[par].children.append(seg.id)
            cur = key
            while len(children.get(cur, ())) == 1:
                cur = children[cur][0]
                _, _, ttl, order, _ = meta[cur]
                seg.blocks.append(nodes[cur])
                seg.ttl_s, seg.order = max(seg.ttl_s, ttl), min(seg.order, order)
            for child in reversed(children.get(cur, [])):
                stack.append((child, seg.id))

    for first in firsts:
        new_segment(first, None)
    # A parent's blocks serve its children's prefixes too: keep the longest TTL, best order.
    for seg in sorted(segments.values(), key=lambda s: -s.start):
        if seg.parent is not None:
            p = segments[seg.parent]
            p.ttl_s, p.order = max(p.ttl_s, seg.ttl_s), min(p.order, seg.order)
    return segments


@dataclass(frozen=True)
class Batch:
    """Segments computed together: equal past length, right-padded to the longest."""

    segments: tuple[int, ...]
    past_tokens: int
    max_tokens: int

    @property
    def padded_tokens(self) -> int:
        return self.max_tokens * len(self.segments)

    def cost(self) -> float:
        """Relative compute cost: each segment's padded tokens after its past, in :data:`TOKEN_UNITS`."""
        return len(self.segments) * TOKEN_UNITS.seconds(self.past_tokens + self.max_tokens, self.past_tokens)


def plan_batches(segments: dict[int, Segment], ready: Iterable[int], *, max_batch_tokens: int,
                 max_batch_size: int) -> list[Batch]:
    """Batch the ``ready`` segments: equal past length, similar length, under the token budget.

    Within a past length, segments are sorted by length so that padding stays small; a
    batch is closed when adding the next segment would exceed ``max_batch_tokens``
    (padded) or ``max_batch_size``. A segment longer than the budget runs alone.
    """
    by_past: dict[int, list[Segment]] = {}
    for sid in ready:
        s = segments[sid]
        by_past.setdefault(s.past_tokens, []).append(s)
    batches: list[tuple[int, Batch]] = []
    for past, segs in by_past.items():
        segs.sort(key=lambda s: (s.n_tokens, s.order))
        cur: list[Segment] = []
        for s in segs:
            longest = max([c.n_tokens for c in cur] + [s.n_tokens])
            if cur and (longest * (len(cur) + 1) > max_batch_tokens or len(cur) >= max_batch_size):
                batches.append(_close(cur, past))
                cur = []
            cur.append(s)
        if cur:
            batches.append(_close(cur, past))
    batches.sort(key=lambda ob: ob[0])
    return [b for _, b in batches]


def _close(cur: list[Segment], past: int) -> tuple[int, Batch]:
    return (min(s.order for s in cur),
            Batch(tuple(s.id for s in cur), past, max(s.n_tokens for s in cur)))


def split(batch: Batch, segments: dict[int, Segment]) -> list[Batch]:
    """Halve a batch (after an out-of-memory error); a batch of one cannot be split."""
    if len(batch.segments) < 2:
        raise ValueError("a batch of one segment cannot be split")
    half = len(batch.segments) // 2
    parts = (batch.segments[:half], batch.segments[half:])
    return [Batch(p, batch.past_tokens, max(segments[s].n_tokens for s in p)) for p in parts]
