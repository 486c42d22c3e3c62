"""Stored prefixes to prefetch and retain on serving nodes: the plan's ``retain`` entries.

Every block of a mined prefix tree that the store holds (prefilled, or written back by
an engine) is a candidate. Its value is the planner's one value model
(:func:`forecasting.planning.planner.prefix_value`, as a stored prefix): its expected
uses in the coming horizon (:class:`forecasting.planning.reuse.ReuseModel`, or a demand
forecast) times the prefill seconds the block saves after its parent, minus what its
fetch is priced at and what keeping it costs.

A block hits only behind its parent, so what a block is worth to fetch is its whole
chain's value per block fetched: the mean value of the blocks from the root down to it
(the attention term makes deep blocks save more, but the chain to them must be fetched
too). Each block ranks at the highest such mean in its subtree (a parent ranks at least
as high as any child), and the blocks are taken in that order, shallower first on ties,
while the budgets last: the chosen set is always a set of whole prefixes. The plan names each chosen branch once, by its deepest chosen
block (an entry covers its ancestors), most valuable first; a loader gives each block
the highest score of the entries through it, which is that block's rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from forecasting.mining.prefix_tree import PrefixTree
from forecasting.planning.planner import PlanCosts, prefix_value
from store.errors import BadInputError
from store.plan import PlanEntry

#: which of a tree's nodes the store holds: ``present(tree, nodes) -> bool array``
Present = Callable[[PrefixTree, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class RetainBudget:
    """What retaining may take: bytes on a serving node's tier, and bytes kept in the store."""

    node_bytes: float
    store_bytes: float = math.inf

    def __post_init__(self) -> None:
        for name in ("node_bytes", "store_bytes"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and not math.isnan(v)):
                raise BadInputError(f"RetainBudget.{name} must be a number >= 0, got {v!r}")


def path_mean(tree: PrefixTree, value: np.ndarray) -> np.ndarray:
    """Per node, the mean ``value`` of the blocks from the root down to it (root level first)."""
    total = np.asarray(value, dtype=np.float64).copy()
    depth = np.asarray(tree.depth)
    for d in range(2, int(depth.max(initial=1)) + 1):
        kids = np.flatnonzero(depth == d)
        total[kids] += total[tree.parent[kids]]
    return total / np.maximum(depth, 1)


def closed_under_prefix(tree: PrefixTree, key: np.ndarray) -> np.ndarray:
    """``key`` raised so that every node's is at least each child's (deepest level first)."""
    key = key.copy()
    depth = np.asarray(tree.depth)
    for d in range(int(depth.max(initial=1)), 1, -1):
        kids = np.flatnonzero(depth == d)
        np.maximum.at(key, tree.parent[kids], key[kids])
    return key


def available(tree: PrefixTree, held: np.ndarray) -> np.ndarray:
    """``held`` narrowed to nodes whose every ancestor is held too (a chain needs its parents)."""
    ok = held.copy()
    depth = np.asarray(tree.depth)
    for d in range(2, int(depth.max(initial=1)) + 1):
        kids = np.flatnonzero(depth == d)
        ok[kids] &= ok[tree.parent[kids]]
    return ok


def retain_nodes(tree: PrefixTree, uses: np.ndarray, cost: PlanCosts, budget: RetainBudget, *,
                 horizon_s: float, present: np.ndarray | None = None,
                 min_value: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The nodes to retain, in rank order, and their ranks (GPU-seconds per block).

    Args:
        tree: the mined logs before the plan's time.
        uses: per node, expected uses within ``horizon_s`` after the plan's time.
        cost: prices (:class:`forecasting.planning.planner.PlanCosts`).
        budget: node and store bytes (each block takes ``tree.block_size`` tokens of KV).
        horizon_s: how long a retained block is kept for (its storage cost).
        present: per node, whether the store holds it (default: every node, as with
            engines writing their KV back).
        min_value: a rank at or below this is not worth a place.
    """
    b = tree.block_size
    depth = np.asarray(tree.depth, dtype=np.float64)
    saved = cost.prefill.seconds(depth * b, (depth - 1) * b)
    value = prefix_value(np.asarray(uses, dtype=np.float64), saved, b, horizon_s, cost, present=True)
    held = np.ones(tree.n_nodes, dtype=bool) if present is None else np.asarray(present, dtype=bool)
    ok = available(tree, held)
    rank = closed_under_prefix(tree, np.where(ok, path_mean(tree, value), -np.inf))
    cand = np.flatnonzero(ok & (rank > min_value))
    cand = cand[np.lexsort((depth[cand], -rank[cand]))]
    room = min(budget.node_bytes, budget.store_bytes) / cost.bytes(b)
    chosen = cand[: int(min(room, len(cand)))]
    return chosen, rank[chosen]


def retain_entries(tree: PrefixTree, uses: np.ndarray, chosen: np.ndarray, rank: np.ndarray,
                   urgency: np.ndarray | None = None) -> list[PlanEntry]:
    """One ``retain`` entry per chosen branch (its deepest chosen node), most valuable first.

    An entry names its prefix by token ids (a tree of tokens) or by hash ids, with its
    rank as ``score``, its expected uses, its node's ``urgency`` (per node, expected uses
    in the reuse model's short window; omitted when not given) and the node's key as
    ``prefix_id``.
    """
    if not len(chosen):
        return []
    inner = np.zeros(tree.n_nodes, dtype=bool)
    parents = tree.parent[chosen]
    inner[parents[parents >= 0]] = True
    leaves = [(int(n), float(r)) for n, r in zip(chosen, rank) if not inner[n]]
    keys = tree.node_keys([n for n, _ in leaves])
    field = "token_ids" if tree.unit == "tokens" else "hash_ids"
    return [PlanEntry(tenant=tree.tenants[int(tree.node_tenant[n])], action="retain", score=round(r, 9),
                      expected_hits=round(float(uses[n]), 6), prefix_id=key,
                      urgency=None if urgency is None else round(float(urgency[n]), 6),
                      **{field: tuple(int(v) for v in tree.prefix_values(n))})
            for (n, r), key in zip(leaves, keys)]
