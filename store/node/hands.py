"""The node agent's hands in the node process: the node tier and the shared tiers, by object name.

The node process serves every engine on the machine, whatever their models: it follows the plans
the pipeline publishes to the store (:class:`store.serving.agent.StorePlans`: keys, no prompts),
every entry of them, and the fleet's memory of the namespaces those plans and the configured
tenants name. Copies go through :class:`store.node.copier.Copier` (checked as ``verify`` does);
the tokens of a copied block are checked by the engine's load that maps it. Retention
priorities are kept for the node's stats; the node tier evicts by its own LRU.
"""
from __future__ import annotations

import logging
import sqlite3
from typing import Any, Sequence

from store.identity.tenant import PUBLIC
from store.node.copier import Copier
from store.plan import Plan
from store.published_plan import PublishedPlan
from store.serving.fleet_file import read_fleet
from store.serving.loader_node import HeldNames
from store.serving.urgency import PlanChain, UseLike
from store.tiers.base import Tier, object_name
from store.tiers.stats import StoreStats

log = logging.getLogger("kvwarm.node")


class StoreHands:
    """:class:`store.serving.agent.NodeHands` over a node's tiers.

    Args:
        tiers: the store's tiers, the node tier first.
        copier: where copies go.
        namespaces: namespaces whose fleet memory counts besides those the plans name
            (the configured tenants' and ``public``).
        node_id: this node's name in the fleet's memory.
        link_bytes_per_s: the read rate from the shared tier (``agent.link_bytes_per_s``).
        max_file_bytes: the largest fleet file read.
    """

    def __init__(self, tiers: Sequence[Tier], copier: Copier, *, namespaces: Sequence[str], node_id: str,
                 link_bytes_per_s: float, max_file_bytes: int) -> None:
        self.tiers = list(tiers)
        self.local = self.tiers[0]
        self.copier = copier
        self.namespaces = list(dict.fromkeys([*namespaces, PUBLIC]))
        self.node_id = node_id
        self.link = float(link_bytes_per_s)
        self.max_file_bytes = max_file_bytes
        self.stats = StoreStats()
        self.priority: dict[str, float] = {}
        self._chains: dict[str, tuple[str, ...]] = {}  # a plan chain's block name -> the chain up to it

    def plan_chains(self, plan: Plan | PublishedPlan) -> list[PlanChain[str]]:
        if not isinstance(plan, PublishedPlan):
            return []  # a plan file names prompts: the engines' own agents key them
        out, chains = [], {}
        for e in plan.entries:
            names = tuple(object_name(e.namespace, k) for k in e.keys)
            for i, name in enumerate(names):
                chains.setdefault(name, names[:i + 1])
            out.append(PlanChain(names, float(e.expected_hits), float(e.score)))
            if e.namespace not in self.namespaces:
                self.namespaces.append(e.namespace)
        self._chains = chains
        return out

    def fleet(self, since: float, *, others_only: bool) -> Sequence[UseLike[str]]:
        return read_fleet(self.tiers, self.namespaces, since=since,
                          exclude_node=self.node_id if others_only else None, stats=self.stats,
                          max_file_bytes=self.max_file_bytes)

    def held(self) -> HeldNames:
        return HeldNames(self.local)

    def _block_bytes(self) -> float:
        try:
            index: Any = getattr(self.local, "index", None)
            n = index.count() if index is not None else 0
            return self.local.usage() / n if n else 0.0  # type: ignore[attr-defined]
        except (AttributeError, sqlite3.Error, OSError):
            return 0.0

    def capacity(self) -> int:
        size = self._block_bytes()
        cap = getattr(self.local, "cap_bytes", 0)
        return int(cap // size) if size and cap else 1 << 40

    def copy_s(self) -> float:
        return self._block_bytes() / self.link

    def retain(self, priority: dict[str, float]) -> None:
        self.priority = dict(priority)

    def prefetch(self, order: list[str]) -> None:
        """``order`` as chains: a plan block with the rest of its chain's run before it; a block
        only the fleet names alone."""
        chains: list[list[str]] = []
        for name in order:
            prefix = self._chains.get(name)
            if chains and prefix is not None and len(prefix) > 1 and chains[-1] and chains[-1][-1] == prefix[-2]:
                chains[-1].append(name)
            else:
                chains.append([name])
        self.copier.replace(chains)
