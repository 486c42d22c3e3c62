"""The policies the replay runs side by side, each as a deployment runs it (docs/guides/simulate.md).

- ``vllm``: the engine alone: its prefix cache (LRU), no kvwarm.
- ``reactive-store``: the tiers as LMCache runs them, no prediction: write-back, an S3 hit
  served synchronously when waiting for it (behind the fetch queue, over the shared link)
  beats recomputing, and copied to the node tier for next time either way. The baseline
  kvwarm must beat.
- ``kvwarm``: the same tiers as kvwarm's loader runs them by default (``fetch_mode:
  background``: an S3-only hit is a miss now, copied for next time), run by the pipeline's
  plans. At each cadence tick the plan :func:`forecasting.planning.cadence.plan_now` makes
  from the trace before the tick becomes the node's retention priorities and is prefetched
  (it replaces the last one); a node that starts (a restart, a replacement, a scale-out)
  prefetches the latest plan, at most one cadence old, as the connector's ``plan: latest`` does.
- ``restore``: reactive-store, plus at the event the new node replays the last hour's
  access log of the node(s) it follows (:func:`restore_order`) through the prefetch
  channel: what an operator can script today with LMCache's prefetch API.
- ``oracle``: a bound, not a node (:mod:`forecasting.simulate.oracle`).
- ``belady``: reactive-store's levels, both evicting by Belady's rule: the ceiling of eviction.

The oracle and Belady read the future; they live here, in the simulator, and policy code
(``forecasting.planning``) never imports this package.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from forecasting.mining.prefix_tree import PrefixTree
from forecasting.planning.cadence import CadenceSpec, plan_now
from forecasting.planning.planner import PlanCosts
from forecasting.simulate.live_node import AgentRun, SimFleet
from forecasting.simulate.prewarm import plan_priorities, tree_blocks
from forecasting.simulate.replay import BlockIndex, next_use
from forecasting.simulate.tiers import Node, NodeShape, Served, TierCosts
from store.cost import PrefillCost
from store.errors import BadInputError
from store.identity.keys import KeyRoot
from store.plan import Plan

POLICIES = ("vllm", "reactive-store", "kvwarm", "restore", "oracle", "belady")
#: the policies whose S3 hits wait when waiting beats recomputing (LMCache's synchronous remote hit)
SYNC_POLICIES = ("reactive-store", "restore", "belady")
#: how far back ``restore`` replays the access log
RESTORE_LOOKBACK_S = 3600.0


@dataclass(frozen=True)
class PlanTick:
    """One plan of kvwarm's cadence, as the pipeline publishes it.

    Attributes:
        at_s: the plan's time (trace seconds): it learned from the requests before it, and a
            node agent sees it from its next poll on.
        plan: the plan itself.
    """

    at_s: float
    plan: Plan


@dataclass(frozen=True)
class Planner:
    """How the replay asks the pipeline for kvwarm's plans: the same call the cadence flow makes.

    Attributes:
        requests: the trace's requests as log rows (what the pipeline mines).
        origin: the log time of the trace's time 0.
        cost, spec: the planner's prices and budgets.
        cadence_s: seconds between plans.
        roots: the tenants' key roots when the rows carry tokens (the trace's simulation roots).
        base: the latest off-peak plan, whose prefill entries every plan keeps.
    """

    requests: pd.DataFrame
    origin: pd.Timestamp
    cost: PlanCosts
    spec: CadenceSpec
    cadence_s: float = 300.0
    roots: Mapping[str, KeyRoot] | None = None
    base: Plan | None = None

    def __post_init__(self) -> None:
        if not (self.cadence_s > 0 and math.isfinite(self.cadence_s)):
            raise BadInputError(f"the plan cadence must be a positive number of seconds, got {self.cadence_s!r}")


def written_back(index: BlockIndex, rows: np.ndarray | None = None) -> np.ndarray:
    """Per block, the first request that finds it in S3 when the nodes serving ``rows`` (default:
    every request) write back at once: the one after its first full use among them (partial
    tail blocks are never written). The replay's node uploads through its queue instead
    (:mod:`forecasting.simulate.uploads`); this is the other nodes of a fleet, and the earliest
    any node's S3 can have a block (the oracle's)."""
    stored = np.full(index.n_unique, len(index.trace) + 1, dtype=np.int64)
    full = index.tokens >= index.trace.block_tokens
    if rows is not None:
        keep = np.zeros(len(index.trace), dtype=bool)
        keep[np.asarray(rows, dtype=np.int64)] = True
        full &= keep[index.request]
    np.minimum.at(stored, index.ids[full], index.request[full] + 1)
    return stored


def restore_order(index: BlockIndex, at_s: float, lookback_s: float = RESTORE_LOOKBACK_S) -> np.ndarray:
    """The blocks the requests of ``[at_s - lookback_s, at_s)`` used (served from any level), most
    recent request first, each request root first, each block once: the access log ``restore`` replays."""
    ts = index.trace.timestamps_s
    lo, hi = int(np.searchsorted(ts, at_s - lookback_s, side="left")), int(np.searchsorted(ts, at_s, side="left"))
    offsets = index.trace.offsets
    seen: dict[int, None] = {}
    for i in range(hi - 1, lo - 1, -1):
        for b in index.ids[offsets[i]:offsets[i + 1]].tolist():
            seen.setdefault(b, None)
    return np.fromiter(seen, dtype=np.int64, count=len(seen))


def kvwarm_plans(index: BlockIndex, planner: Planner, stored: np.ndarray, until_s: float) -> list[PlanTick]:
    """The plans kvwarm's cadence makes over ``[cadence, until_s]``, each from the requests before it.

    ``stored`` (per block, the first request that finds it in S3) answers the planner's
    question of which mined prefixes the store holds at the plan's time.
    """
    ts = index.trace.timestamps_s
    ticks = []
    for at in np.arange(planner.cadence_s, until_s + 1e-9, planner.cadence_s):
        row = int(np.searchsorted(ts, at, side="left"))

        def present(tree: PrefixTree, nodes: np.ndarray, row: int = row) -> np.ndarray:
            dense = tree_blocks(index, tree)[nodes]
            return (dense >= 0) & (stored[np.maximum(dense, 0)] <= row)

        plan = plan_now(planner.requests, planner.origin + pd.Timedelta(seconds=float(at)), cost=planner.cost,
                        spec=planner.spec, block_size=index.trace.block_tokens, roots=planner.roots,
                        present=present, base=planner.base, created_at=0.0)
        ticks.append(PlanTick(float(at), plan))
    return ticks


@dataclass
class Run:
    """One node's run: what each served request got, and the warm-up set at its event."""

    rows: np.ndarray
    served: list[Served]
    warm: set[int] | None = None
    plan: PlanTick | None = None


class NodeRun:
    """Serves rows through a :class:`~forecasting.simulate.tiers.Node` that follows no plan
    (``vllm``, ``reactive-store``, ``restore``, ``belady``; kvwarm's node is an
    :class:`~forecasting.simulate.live_node.AgentRun`)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def fork(self) -> NodeRun:
        return NodeRun(self.node.fork())

    def serve(self, rows: np.ndarray) -> list[Served]:
        ts = self.node.index.trace.timestamps_s
        out = []
        for i in rows.tolist():
            self.node.land(float(ts[i]))
            out.append(self.node.serve(i))
        return out


def make_node(policy: str, index: BlockIndex, shape: NodeShape, costs: TierCosts, stored: np.ndarray,
              rows: np.ndarray, ticks: Sequence[PlanTick], fleet: np.ndarray | None = None) -> NodeRun | AgentRun:
    """A fresh node running ``policy`` for ``rows`` (Belady needs to know which rows it serves).

    kvwarm's node is the shipped node agent (:class:`forecasting.simulate.live_node.AgentRun`);
    ``fleet`` are the rows the fleet's other nodes serve (their records are its fleet memory).
    """
    if policy not in POLICIES:
        raise BadInputError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy == "oracle":
        raise BadInputError("the oracle is a bound, not a node: forecasting.simulate.oracle.oracle_served")
    if policy == "vllm":
        return NodeRun(Node(index, NodeShape(shape.gpu_blocks, 0, store=False), costs, stored))
    if policy == "kvwarm":
        others = np.zeros(0, dtype=np.int64) if fleet is None else fleet
        return AgentRun(Node(index, shape, costs, stored), ticks, SimFleet(index, others))
    if policy in SYNC_POLICIES:
        shape = replace(shape, fetch_mode="sync")
    nxt = next_use(index, rows) if policy == "belady" else None
    return NodeRun(Node(index, shape, costs, stored, nxt))


def start(policy: str, run: NodeRun | AgentRun, served: np.ndarray, at_s: float) -> tuple[set[int] | None, Plan | None]:
    """What a node does when it starts (or restarts) at ``at_s`` before serving ``served``:
    kvwarm's agent warms it (the latest plan with the fleet's memory), restore replays the
    last hour's access log (at most the node tier's capacity, most recent first). Returns the
    warm-up set (the blocks held or queued) and kvwarm's plan."""
    node = run.node
    if not len(served) or policy == "vllm":
        return None, None
    row = int(served[0])
    if isinstance(run, AgentRun):
        warm = run.start(at_s, row)
        return warm, run.agent.plan
    if policy == "restore":
        order = restore_order(node.index, at_s)
        node.prefetch(order[: node.shape.node_blocks].tolist(), at_s, row)
    return set(node.tier.blocks()) | node.prefetcher.pending, None


def prefill_blocks(index: BlockIndex, base: Plan | None, origin: pd.Timestamp) -> tuple[np.ndarray, float]:
    """The blocks the base plan prefills, and when they are stored (trace seconds: its window's end)."""
    if base is None or not base.prefill_entries():
        return np.zeros(0, dtype=np.int64), math.inf
    order, _ = plan_priorities(index, Plan(entries=tuple(base.prefill_entries())))
    done = (base.window_end if base.window_end is not None else base.created_at) - origin.value / 1e9
    return order[order < index.n_unique], float(done)


def stored_with_prefill(index: BlockIndex, stored: np.ndarray, blocks: np.ndarray, done_s: float) -> np.ndarray:
    """``stored`` with the prefilled ``blocks`` in S3 from ``done_s`` on."""
    out = stored.copy()
    row = int(np.searchsorted(index.trace.timestamps_s, done_s, side="left"))
    if len(blocks):
        out[blocks] = np.minimum(out[blocks], row)
    return out


def prefill_gpu_s(index: BlockIndex, blocks: np.ndarray, stored: np.ndarray, done_s: float, cost: PrefillCost) -> float:
    """GPU-seconds the prefill job spends on ``blocks`` not already stored by ``done_s`` (it skips those)."""
    if not len(blocks):
        return 0.0
    row = int(np.searchsorted(index.trace.timestamps_s, done_s, side="left"))
    new = blocks[stored[blocks] > row]
    depth = np.zeros(index.n_unique, dtype=np.int64)
    depth[index.ids] = index.depth
    b = index.trace.block_tokens
    d = depth[new].astype(np.float64)
    return float(np.sum(cost.seconds((d + 1) * b, d * b)))
