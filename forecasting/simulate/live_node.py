"""kvwarm's node in the replay: the shipped node agent (:class:`store.serving.agent.NodeAgent`)
driving a simulated node on the trace's clock.

The agent is the code a serving node runs; only its surroundings are simulated here:

- :class:`SimPlans`: the plans the pipeline's cadence made (:func:`~forecasting.simulate.policies.kvwarm_plans`),
  each published at its time; the agent sees a new one when it next polls its version;
- :class:`SimFleet`: the fleet's memory as the nodes' recorders would have written it: for
  each block the fleet's requests used, its last use, its uses within the window, and the
  traffic (requests) the fleet served since; a record is readable ``flush_s`` after its use
  (the recorder's flush);
- :class:`SimHands`: the agent's hands on a :class:`~forecasting.simulate.tiers.Node`
  (its tier, its priorities, its prefetch channel over the node's S3 link);
- :class:`AgentRun`: a :class:`~forecasting.simulate.policies.NodeRun` whose plans go through the agent.

``tests/forecasting/simulate/test_live_node.py`` checks that the replay's node and the
connector's node take plans through the same agent class.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from forecasting.simulate.prewarm import _dense_lookup, entry_blocks
from forecasting.simulate.replay import BlockIndex
from forecasting.simulate.tiers import Node, Served
from store.config import FleetMemoryConfig
from store.plan import Plan
from store.serving.agent import AgentSettings, NodeAgent
from store.serving.urgency import PlanChain

#: the fleet recorder's flush period (the config's ``fleet_memory.flush_s``): a use is readable this long after it
FLUSH_S = FleetMemoryConfig().flush_s
#: the recorder's bound on the names it keeps (the config's ``fleet_memory.max_names``)
MAX_NAMES = FleetMemoryConfig().max_names


class SimClock:
    """The replay's clock: the time of the request being served."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = float(t)

    def __call__(self) -> float:
        return self.t


class SimPlans:
    """The cadence's plans as a :class:`store.serving.agent.PlanSource`: the newest made by now."""

    def __init__(self, ticks: Sequence, clock: SimClock) -> None:
        self.ticks = list(ticks)
        self._at = np.array([t.at_s for t in self.ticks], dtype=np.float64)
        self.clock = clock

    def _newest(self) -> int:
        return int(np.searchsorted(self._at, self.clock.t, side="right")) - 1

    def version(self) -> str | None:
        i = self._newest()
        return None if i < 0 else str(i)

    def read(self) -> Plan | None:
        i = self._newest()
        return None if i < 0 else self.ticks[i].plan


@dataclass(frozen=True)
class SimUse:
    """A fleet record (:class:`store.serving.fleet.Use`'s fields the agent reads)."""

    name: int
    at: float
    uses: int
    traffic_age: int


class SimFleet:
    """The fleet's memory over the trace: the rows the fleet's other nodes served (``others``),
    and the rows this node served itself (``own``: added as it serves)."""

    def __init__(self, index: BlockIndex, others: np.ndarray, *, flush_s: float = FLUSH_S,
                 max_names: int = MAX_NAMES) -> None:
        self.index = index
        self.others = np.asarray(others, dtype=np.int64)
        self.own: list[int] = []
        self.flush_s = flush_s
        self.max_names = max_names
        self._full = index.tokens >= index.trace.block_tokens

    def copy(self) -> "SimFleet":
        """An independent copy (a forked node records its own rows from here on)."""
        out = SimFleet(self.index, self.others, flush_s=self.flush_s, max_names=self.max_names)
        out.own = list(self.own)
        return out

    def uses(self, since: float, now: float, *, others_only: bool) -> list[SimUse]:
        """The records readable at ``now`` of uses at or after ``since``, most recent first."""
        ts = self.index.trace.timestamps_s
        rows = self.others if others_only or not self.own else np.union1d(self.others, np.asarray(self.own))
        until = now - self.flush_s
        rows = rows[(ts[rows] >= since) & (ts[rows] < until)]
        if not len(rows):
            return []
        offsets = self.index.trace.offsets
        starts, ends = offsets[rows], offsets[rows + 1]
        occ = np.concatenate([np.arange(a, z) for a, z in zip(starts.tolist(), ends.tolist())])
        pos = np.repeat(np.arange(len(rows)), ends - starts)
        keep = self._full[occ]
        ids, pos = self.index.ids[occ[keep]], pos[keep]
        order = np.lexsort((pos, ids))
        ids, pos = ids[order], pos[order]
        last = np.r_[ids[1:] != ids[:-1], True]
        uniq, counts = np.unique(ids, return_counts=True)
        last_pos = pos[last]
        if len(uniq) > self.max_names:  # the recorder keeps the most recently used names
            top = np.argsort(-last_pos, kind="stable")[: self.max_names]
            uniq, counts, last_pos = uniq[top], counts[top], last_pos[top]
        at = ts[rows[last_pos]]
        age = len(rows) - 1 - last_pos
        out = [SimUse(int(b), float(t), int(c), int(a)) for b, t, c, a in zip(uniq, at, counts, age)]
        out.sort(key=lambda u: -u.at)
        return out


class SimHands:
    """The agent's hands on a simulated :class:`Node` (dense block ids for names)."""

    def __init__(self, node: Node, fleet: SimFleet, clock: SimClock) -> None:
        self.node = node
        self.fleet_memory = fleet
        self.clock = clock
        self.row = 0  # the request being served: what S3 holds is as of it
        self._chains: dict[int, list[PlanChain[int]]] = {}

    def plan_chains(self, plan: Plan) -> list[PlanChain[int]]:
        got = self._chains.get(id(plan))
        if got is None:
            index = self.node.index
            dense, extra = _dense_lookup(index), {}
            got = []
            for e in plan.entries:
                blocks = tuple(b for b in entry_blocks(index, e, dense, extra) if b < index.n_unique)
                if blocks:
                    got.append(PlanChain(blocks, float(e.expected_hits), float(e.score)))
            self._chains = {id(plan): got}  # one plan at a time: bounded
        return got

    def fleet(self, since: float, *, others_only: bool) -> list[SimUse]:
        return self.fleet_memory.uses(since, self.clock.t, others_only=others_only)

    def held(self):  # noqa: ANN201 - the node tier (a container of block ids)
        return self.node.tier

    def capacity(self) -> int:
        return self.node.shape.node_blocks

    def copy_s(self) -> float:
        return self.node.costs.prefetch_s

    def retain(self, priority: dict[int, float]) -> None:
        self.node.retain(priority)

    def prefetch(self, order: list[int]) -> None:
        self.node.prefetch(order, self.clock.t, self.row)


class AgentRun:
    """A node run by the shipped agent: it polls the cadence's plans as it serves, and warms at start."""

    def __init__(self, node: Node, ticks: Sequence, fleet: SimFleet, settings: AgentSettings = AgentSettings(),
                 clock: SimClock | None = None) -> None:
        self.node = node
        self.ticks = list(ticks)
        self.clock = clock or SimClock()
        self.hands = SimHands(node, fleet, self.clock)
        self.agent = NodeAgent(self.hands, SimPlans(self.ticks, self.clock), settings, clock=self.clock)

    def fork(self, fleet: SimFleet | None = None) -> "AgentRun":
        """An independent copy of this run: the node, the agent's state and this node's records."""
        out = AgentRun(self.node.fork(), self.ticks, fleet or self.hands.fleet_memory.copy(), self.agent.settings,
                       SimClock(self.clock.t))
        a, b = self.agent, out.agent
        b.plan, b._version, b._next_poll, b._started = a.plan, a._version, a._next_poll, a._started
        return out

    def start(self, at_s: float, row: int) -> set[int]:
        """The node (re)starts at ``at_s`` before serving ``row``: the agent's warm-up. Returns the
        warm-up set (the blocks held or queued)."""
        self.clock.t, self.hands.row = float(at_s), int(row)
        self.agent.start(at_s)
        return set(self.node.tier.blocks()) | self.node.prefetcher.pending

    def serve(self, rows: np.ndarray) -> list[Served]:
        ts = self.node.index.trace.timestamps_s
        out = []
        own = self.hands.fleet_memory.own
        for i in rows.tolist():
            t = float(ts[i])
            self.clock.t, self.hands.row = t, i
            self.agent.tick(t)
            self.node.land(t)
            out.append(self.node.serve(i))
            own.append(i)
        return out
