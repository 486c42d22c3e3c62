"""Sharding a plan over N prefill workers along its prefix tree, every block computed by one shard.

Pure logic, no model and no I/O: :func:`make_shards` takes each plan entry's token ids
(tokenised, through the chat template where the entry asks) and returns N
:class:`Shard` s, each a list of plan entries plus what it must compute first and what
it must wait for. :mod:`prefill.shard_job` runs one.

The plan's full blocks form a forest: entries of one tenant (and one chat flag, which
changes the key root) that begin with the same tokens share those blocks. Each block is
a node costed at the GPU-seconds of prefilling its tokens after the ones before it
(:meth:`store.cost.PrefillCost.seconds`, with attention's quadratic term), and a
subtree's cost is its nodes' sum. The sharder:

1. starts from one *item* per top-level subtree and assigns items to shards longest
   processing time first (the costliest item to the least loaded shard);
2. while the largest shard is over ``(1 + tolerance)`` x the mean, splits the costliest
   item that has a branch *below its shared prefix*: the chain of blocks down to its
   first branching node stays one item (the *head*, owned by the shard it lands on),
   and each child subtree becomes an item of its own, which may land on another shard;
3. records, for every child item placed on a shard other than its head's owner, a
   :class:`SharedPrefix` to wait for, and for every head, a :class:`SharedPrefix` its
   owner computes first.

So every block belongs to exactly one item and one shard. A shard that waits lets the
owner compute the shared prefix, then continues from the stored KV (the runner probes
the store and loads the stored blocks as the past) instead of recomputing it.

Priority holds across shards: each shard's entries are in plan order (most valuable
first), so a window cut short loses each shard's least valuable work. The result is
deterministic: a rerun of the parent shards the same plan the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from store.cost import PrefillCost
from store.plan import PlanEntry

#: the largest shard may exceed the mean by this fraction before a subtree is split
DEFAULT_TOLERANCE = 0.05


@dataclass(frozen=True)
class PrefixTokens:
    """One plan entry as the sharder sees it: its index (priority: lower first), key group and tokens.

    ``group`` separates entries that can never share a block: blocks share keys only
    within one tenant and one chat flag.
    """

    entry: int
    group: Hashable
    token_ids: tuple[int, ...]


def prefixes_of(entries: Sequence[PlanEntry], encode: Callable[[str, bool], Sequence[int]]) -> list[PrefixTokens]:
    """The plan's entries as the sharder sees them; ``encode(text, chat)`` tokenises a text entry
    (:func:`prefill.models.encode` with the model's tokenizer)."""
    out = []
    for i, e in enumerate(entries):
        ids = tuple(e.token_ids) if e.token_ids is not None else tuple(int(t) for t in encode(e.text or "", e.chat))
        out.append(PrefixTokens(entry=i, group=(e.tenant, e.chat), token_ids=ids))
    return out


@dataclass(frozen=True)
class SharedPrefix:
    """The first ``blocks`` full blocks of plan entry ``entry``, computed by shard ``owner``."""

    entry: int
    blocks: int
    owner: int


@dataclass(frozen=True)
class Shard:
    """One shard of a plan: what one prefill worker computes.

    Attributes:
        index: this shard, ``0 .. count-1``.
        count: the number of shards the plan was split into.
        entries: plan entry indices, in priority order (most valuable first).
        computes: shared prefixes this shard computes before its entries, shallowest first
            (other shards wait for them).
        waits: shared prefixes other shards compute, that some of these entries begin with.
        est_gpu_s: the estimated GPU-seconds of the blocks this shard owns.
        est_tokens: the tokens of those blocks.
    """

    index: int
    count: int
    entries: tuple[int, ...]
    computes: tuple[SharedPrefix, ...] = ()
    waits: tuple[SharedPrefix, ...] = ()
    est_gpu_s: float = 0.0
    est_tokens: int = 0


@dataclass
class _Node:
    depth: int                          # block index in the chain
    cost: float
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    entries: list[int] = field(default_factory=list)  # entries whose last full block this is
    subtree: float = 0.0
    first: int = 0                      # the best (lowest) entry whose chain passes through this node


@dataclass
class _Item:
    """A subtree assigned whole (``head`` is the chain's top node), after ``wait`` (its parent head's last node)."""

    top: _Node
    wait: _Node | None
    split: bool = False                 # a head: its subtree below the chain's end belongs to other items
    shard: int = -1

    def chain(self) -> list[_Node]:
        """The nodes of the shared chain: ``top`` down to the first node that branches (or ends an entry deeper)."""
        out = [self.top]
        while len(out[-1].children) == 1:
            out.append(next(iter(out[-1].children.values())))
        return out

    def cost(self) -> float:
        if not self.split:
            return self.top.subtree
        return sum(n.cost for n in self.chain())

    def entries(self) -> list[int]:
        nodes = self.chain() if self.split else _walk(self.top)
        return [e for n in nodes for e in n.entries]

    def tokens(self, block_size: int) -> int:
        nodes = self.chain() if self.split else _walk(self.top)
        return len(nodes) * block_size


def _walk(top: _Node) -> list[_Node]:
    out, stack = [], [top]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def _build_forest(prefixes: Sequence[PrefixTokens], block_size: int, cost: PrefillCost) -> tuple[list[_Node], list[int]]:
    """The block trie's top nodes, and the entries with no full block (they own no block)."""
    roots: dict[Hashable, dict[tuple[int, ...], _Node]] = {}
    no_block: list[int] = []
    for p in prefixes:
        n_blocks = len(p.token_ids) // block_size
        if n_blocks == 0:
            no_block.append(p.entry)
            continue
        level = roots.setdefault(p.group, {})
        node: _Node | None = None
        for d in range(n_blocks):
            key = tuple(p.token_ids[d * block_size:(d + 1) * block_size])
            nxt = level.get(key)
            if nxt is None:
                nxt = _Node(depth=d, cost=float(cost.seconds((d + 1) * block_size, d * block_size)), parent=node,
                            first=p.entry)
                level[key] = nxt
            nxt.first = min(nxt.first, p.entry)
            node, level = nxt, nxt.children
        assert node is not None
        node.entries.append(p.entry)
    tops = [n for level in roots.values() for n in level.values()]
    for top in tops:  # subtree costs, leaves first
        for n in sorted(_walk(top), key=lambda n: -n.depth):
            n.subtree = n.cost + sum(c.subtree for c in n.children.values())
    return tops, no_block


def _assign(items: list[_Item], n: int) -> list[float]:
    """Longest processing time first; ties go to the best entry first and the lowest shard. Returns the loads."""
    loads = [0.0] * n
    for item in sorted(items, key=lambda i: (-i.cost(), i.top.first)):
        item.shard = min(range(n), key=lambda s: (loads[s], s))
        loads[item.shard] += item.cost()
    return loads


def make_shards(prefixes: Sequence[PrefixTokens], n: int, *, block_size: int, cost: PrefillCost = PrefillCost(),
                tolerance: float = DEFAULT_TOLERANCE) -> list[Shard]:
    """Split the plan's entries into ``n`` shards balanced by estimated GPU-seconds (see the module doc).

    Args:
        prefixes: every plan entry, tokenised; ``entry`` is its index in the plan.
        n: the number of shards (some may be empty when the plan has fewer blocks).
        block_size: tokens per block (only full blocks are stored).
        cost: the prefill time model the blocks are priced with.
        tolerance: stop splitting once the largest shard is within ``1 + tolerance`` of the mean.

    Raises:
        ValueError: ``n`` or ``block_size`` is not a positive integer, or two prefixes share an entry index.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of shards must be a positive integer, got {n!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if len({p.entry for p in prefixes}) != len(prefixes):
        raise ValueError("every prefix must name a different plan entry")
    tops, no_block = _build_forest(prefixes, block_size, cost)
    items = [_Item(top, None) for top in tops]
    loads = _assign(items, n)
    while n > 1 and loads and max(loads) > (1.0 + tolerance) * (sum(loads) / n):
        splittable = [i for i in items if not i.split and i.chain()[-1].children]
        if not splittable:
            break
        big = max(splittable, key=lambda i: (i.cost(), -i.top.first))
        big.split = True
        end = big.chain()[-1]
        items.extend(_Item(child, end) for child in end.children.values())
        loads = _assign(items, n)
    return _shards(items, no_block, n, block_size, loads)


def _shards(items: list[_Item], no_block: list[int], n: int, block_size: int, loads: list[float]) -> list[Shard]:
    owner = {id(i.chain()[-1]): i.shard for i in items if i.split}
    entries: list[list[int]] = [[] for _ in range(n)]
    computes: list[list[SharedPrefix]] = [[] for _ in range(n)]
    waits: list[dict[tuple[int, int], SharedPrefix]] = [{} for _ in range(n)]
    tokens = [0] * n
    for item in items:
        entries[item.shard].extend(item.entries())
        tokens[item.shard] += item.tokens(block_size)
        if item.split:
            end = item.chain()[-1]
            computes[item.shard].append(SharedPrefix(end.first, end.depth + 1, item.shard))
        # every head above this item that another shard owns: its blocks must be stored first
        node = item.wait
        while node is not None:
            o = owner.get(id(node))
            if o is not None and o != item.shard:
                waits[item.shard].setdefault((node.first, node.depth + 1), SharedPrefix(node.first, node.depth + 1, o))
            node = node.parent
    light = min(range(n), key=lambda s: (loads[s], s))
    entries[light].extend(no_block)  # no block to compute: the job reports them (too short to store)
    return [Shard(index=s, count=n, entries=tuple(sorted(entries[s])),
                  computes=tuple(sorted(computes[s], key=lambda p: (p.blocks, p.entry))),
                  waits=tuple(sorted(waits[s].values(), key=lambda p: (p.blocks, p.entry))),
                  est_gpu_s=loads[s], est_tokens=tokens[s]) for s in range(n)]


def balance(shards: Sequence[Shard]) -> dict[str, float]:
    """The shards' estimated GPU-seconds: ``max``, ``mean`` and ``max_over_mean`` (1.0 is perfect)."""
    gpu = [s.est_gpu_s for s in shards]
    mean = sum(gpu) / len(gpu) if gpu else 0.0
    return {"shards": len(gpu), "max_gpu_s": max(gpu, default=0.0), "mean_gpu_s": mean,
            "max_over_mean": max(gpu) / mean if mean > 0 else 1.0}
